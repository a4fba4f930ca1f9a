"""The learner in its own place: built in the driver, or as a Ray actor with its own resources.

    learner = build_learner(run)      # async.learner=local (default): a Learner in this process
                                      # async.learner=actor: RemoteLearner, the same Learner in a Ray
                                      # actor with async.learner_num_cpus / _num_gpus (a cluster's GPU node)

``RemoteLearner`` satisfies the same ``Learner`` protocol (vespo.trainer.protocols), so the training
loop and the sample sources do not know where it runs. Only items, results and (once per push) an
object-store reference to the weights cross the process boundary; checkpoints are written by the
actor, into run.out_dir as seen from its node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vespo.config import Config, from_dict, to_dict, validate
from vespo.trainer.learner import Learner
from vespo.trainer.protocols import Learner as LearnerProtocol
from vespo.trainer.protocols import Rows, TrainItem, UpdateResult
from vespo.trainer.run import Run


def make_learner(cfg: Config, policy) -> Learner:
    """The Learner of a config, on model.device."""
    from vespo.models.device import resolve_device

    return Learner(policy, cfg.loss.name, cfg.loss.options, cfg.optim, cfg.total_updates, behavior=cfg.behavior,
                   replay=cfg.rollout.router_replay, temperature=cfg.rollout.temperature,
                   max_nonfinite=cfg.run.max_nonfinite_steps, device=resolve_device(cfg.model.device),
                   autocast=cfg.model.autocast, compile=cfg.run.compile)


def build_learner(run: Run) -> LearnerProtocol:
    """A local Learner, or a RemoteLearner when async.learner=actor (Ray must be running)."""
    if run.cfg.run.mode == "async" and run.cfg.async_.learner == "actor":
        return RemoteLearner(run)
    return make_learner(run.cfg, run.policy)


class LearnerActor:
    """The Learner inside a Ray actor; the policy arrives as the driver's (warm-started) weights."""

    def __init__(self, cfg_dict: dict, weights: dict, tokenizer: Any):
        from vespo.trainer.run import build_policy

        cfg = validate(from_dict(cfg_dict))
        if cfg.run.threads:
            import torch

            torch.set_num_threads(cfg.run.threads)
        policy, _ = build_policy(cfg)  # the architecture
        policy.load_state_dict(weights)
        self.learner = make_learner(cfg, policy)
        self.tokenizer = tokenizer

    def prepare(self, items: list[TrainItem]) -> Rows:
        return self.learner.prepare(items)

    def update(self, item: TrainItem) -> tuple[UpdateResult, int]:
        return self.learner.update(item), self.learner.version

    def shared_weights(self) -> list:
        return [self.learner.shared_weights()]  # a list, so the caller receives the reference itself

    def weights(self) -> dict:
        return self.learner.weights()

    def save_checkpoint(self, run_dir: str, step: int, extra: dict, config: dict) -> str:
        return str(self.learner.save_checkpoint(run_dir, step, extra, config))

    def load_checkpoint(self, path: str) -> tuple[dict, int, int]:
        extra = self.learner.load_checkpoint(path)
        return extra, self.learner.version, self.learner.nonfinite_total

    def save_policy(self, run_dir: str, config: dict) -> str:
        return str(self.learner.save_policy(run_dir, self.tokenizer, config))

    def counters(self) -> tuple[int, int]:
        return self.learner.version, self.learner.nonfinite_total


class RemoteLearner:
    """A Learner running in a Ray actor, behind the Learner protocol."""

    def __init__(self, run: Run):
        import ray

        a = run.cfg.async_
        actor = ray.remote(LearnerActor).options(num_cpus=a.learner_num_cpus, num_gpus=a.learner_num_gpus,
                                                 max_restarts=0)
        weights = {k: v.detach().cpu() for k, v in run.policy.state_dict().items()}
        self.actor = actor.remote(to_dict(run.cfg), weights, run.tokenizer)
        self.version, self.nonfinite_total = self._get(self.actor.counters.remote())

    def _get(self, ref):
        import ray

        return ray.get(ref)

    def prepare(self, items: list[TrainItem]) -> Rows:
        return self._get(self.actor.prepare.remote(items))

    def update(self, item: TrainItem) -> UpdateResult:
        result, self.version = self._get(self.actor.update.remote(item))
        self.nonfinite_total += int(result.skipped)
        return result

    def shared_weights(self):
        return self._get(self.actor.shared_weights.remote())[0]

    def weights(self) -> dict:
        return self._get(self.actor.weights.remote())

    def save_checkpoint(self, run_dir, step: int, extra: dict, config: dict) -> Path:
        return Path(self._get(self.actor.save_checkpoint.remote(str(run_dir), step, extra, config)))

    def load_checkpoint(self, path) -> dict:
        extra, self.version, self.nonfinite_total = self._get(self.actor.load_checkpoint.remote(str(path)))
        return extra

    def save_policy(self, run_dir, tokenizer, config: dict) -> Path:
        return Path(self._get(self.actor.save_policy.remote(str(run_dir), config)))

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # Ray is already going down
            pass
