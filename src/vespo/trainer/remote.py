"""The learner in its own place: built in the driver, or as a Ray actor with its own resources.

    learner = build_learner(run)      # async.learner=local (default): a Learner in this process
                                      # async.learner=actor: RemoteLearner, the same Learner in
                                      # async.learner_workers Ray actors with async.learner_num_cpus / _num_gpus
                                      # each (a cluster's GPU nodes), sharded with FSDP2 when there are several

``RemoteLearner`` satisfies the same ``Learner`` protocol (vespo.trainer.protocols), so the training
loop and the sample sources do not know where it runs. Only items, results and (once per push) an
object-store reference to the weights cross the process boundary; checkpoints are written by the
actor, into run.out_dir as seen from its node.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vespo.config import from_dict, to_dict
from vespo.losses import concat_rows
from vespo.trainer.distributed import Dist
from vespo.trainer.learner import Learner
from vespo.trainer.protocols import Learner as LearnerProtocol
from vespo.trainer.protocols import Rows, TrainItem, UpdateResult
from vespo.trainer.run import Run


def build_learner(run: Run, dist: Dist | None = None) -> LearnerProtocol:
    """A local Learner (sharded over ``dist``'s ranks), or a RemoteLearner when async.learner=actor (Ray must be
    running)."""
    if run.cfg.run.mode == "async" and run.cfg.async_.learner == "actor":
        return RemoteLearner(run)
    return Learner(run.policy, run.cfg, dist)


class LearnerActor:
    """The Learner inside a Ray actor, rank ``rank`` of ``world`` (one process group over the actors); the
    policy arrives as the driver's (warm-started) weights."""

    def address(self) -> tuple[str, int]:
        """Where rank 0 of the group listens: this node's address and a free port."""
        import ray

        from vespo.trainer.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, cfg_dict: dict, weights: dict, tokenizer: Any, rank: int = 0, world: int = 1,
              address: tuple[str, int] | None = None) -> None:
        import torch

        from vespo.models.device import resolve_device
        from vespo.trainer.distributed import init_group, local_device
        from vespo.trainer.run import attach_run_lora, build_policy

        cfg = from_dict(cfg_dict)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        dist = Dist.single()
        if world > 1:
            dist = init_group(rank, world, *address, local_device(resolve_device(cfg.model.device)))
        policy, _ = build_policy(cfg)  # the architecture
        attach_run_lora(cfg, policy)  # the driver's policy has its adapters: the same keys
        policy.load_state_dict(weights)
        self.learner = Learner(policy, cfg, dist)
        self.tokenizer = tokenizer

    def prepare(self, items: list[TrainItem]) -> Rows:
        return self.learner.prepare(items)

    def update(self, item: TrainItem) -> tuple[UpdateResult, int]:
        return self.learner.update(item), self.learner.version

    def shared_weights(self) -> list:
        weights = self.learner.weights()  # a collective on several ranks: every actor calls it
        if not self.learner.dist.is_main:
            return [None]
        import ray

        return [ray.put(weights)]  # a list, so the caller receives the reference itself

    def weights(self) -> dict:
        return self.learner.weights()

    def save_checkpoint(self, run_dir: str, step: int, extra: dict, config: dict) -> str:
        return str(self.learner.save_checkpoint(run_dir, step, extra, config))

    def load_checkpoint(self, path: str) -> tuple[dict, int, int]:
        extra = self.learner.load_checkpoint(path)
        return extra, self.learner.version, self.learner.nonfinite_total

    def save_policy(self, run_dir: str, config: dict) -> str | None:
        path = self.learner.save_policy(run_dir, self.tokenizer, config)
        return None if path is None else str(path)

    def counters(self) -> tuple[int, int]:
        return self.learner.version, self.learner.nonfinite_total

    def memory(self) -> dict[str, float]:
        return self.learner.memory()

    def close(self) -> None:
        from vespo.trainer.distributed import shutdown

        shutdown(self.learner.dist)


class RemoteLearner:
    """The Learner as ``async.learner_workers`` Ray actors behind the Learner protocol: P > 1 actors form one
    torch.distributed group (FSDP2) and each trains a contiguous share of every mini-batch's rows.

    Plain actors rather than Ray Train's TorchTrainer: the loop drives the learner one item at a time
    (prepare, update, weights, checkpoint), which actor calls express directly, while TorchTrainer runs a
    training function to its end inside its workers."""

    def __init__(self, run: Run):
        import ray

        a = run.cfg.async_
        self.world = self.world_size = a.learner_workers
        actor = ray.remote(LearnerActor).options(num_cpus=a.learner_num_cpus, num_gpus=a.learner_num_gpus,
                                                 max_restarts=0)
        self.actors = [actor.remote() for _ in range(self.world)]
        address = self._get(self.actors[0].address.remote()) if self.world > 1 else None
        weights = ray.put({k: v.detach().cpu() for k, v in run.policy.state_dict().items()})
        self._all(lambda rank, act: act.setup.remote(to_dict(run.cfg), weights, run.tokenizer, rank, self.world,
                                                     address))
        self.version, self.nonfinite_total = self._get(self.actors[0].counters.remote())

    def _get(self, ref):
        import ray

        return ray.get(ref)

    def _all(self, call) -> list:
        """``call(rank, actor)`` on every actor at once (the collectives inside need all of them); their results."""
        return self._get([call(rank, act) for rank, act in enumerate(self.actors)])

    def _shard(self, item: TrainItem, rank: int) -> TrainItem:
        """Rank ``rank``'s contiguous share of the item's rows (the item itself on one actor)."""
        if self.world == 1:
            return item
        rows = torch.tensor_split(torch.arange(len(item.batch)), self.world)[rank]
        return replace(item, batch=item.batch.select(rows), rollout_rows={}, perf={})

    def prepare(self, items: list[TrainItem]) -> Rows:
        parts = self._all(lambda rank, act: act.prepare.remote([self._shard(i, rank) for i in items]))
        return concat_rows(parts)

    def update(self, item: TrainItem) -> UpdateResult:
        results = self._all(lambda rank, act: act.update.remote(self._shard(item, rank)))
        first, self.version = results[0]
        self.nonfinite_total += int(first.skipped)
        parts = [r for r, _ in results]
        return replace(first, behavior_rows=concat_rows([r.behavior_rows for r in parts]),
                       lags=torch.cat([r.lags for r in parts]), log_w=torch.cat([r.log_w for r in parts]),
                       weight=torch.cat([r.weight for r in parts]))

    def shared_weights(self):
        return self._all(lambda rank, act: act.shared_weights.remote())[0][0]

    def weights(self) -> dict:
        return self._all(lambda rank, act: act.weights.remote())[0]

    def memory(self) -> dict[str, float]:
        return self._get(self.actors[0].memory.remote())

    def save_checkpoint(self, run_dir, step: int, extra: dict, config: dict) -> Path:
        return Path(self._all(lambda rank, act: act.save_checkpoint.remote(str(run_dir), step, extra, config))[0])

    def load_checkpoint(self, path) -> dict:
        extra, self.version, self.nonfinite_total = self._all(lambda rank, act: act.load_checkpoint.remote(str(path)))[0]
        return extra

    def save_policy(self, run_dir, tokenizer, config: dict) -> Path:
        return Path(self._all(lambda rank, act: act.save_policy.remote(str(run_dir), config))[0])

    def close(self) -> None:
        import ray

        for act in self.actors:
            try:
                ray.kill(act, no_restart=True)
            except Exception:  # Ray is already going down
                pass
