"""The local sample source (sync mode): rollout in this process, one batch per rollout step.

One rollout batch of ``rollout.prompts_per_step`` prompts x G responses is sampled with the
learner's weights at version v and split into N = staleness.n mini-batches, handed to the loop
together (``next()``), so the learner can set μ for all of them before the first is trained:
mini-batch j is trained at lag j. The async counterpart is vespo.trainer.ray_source.RaySource;
both satisfy vespo.trainer.protocols.SampleSource.

On P learner ranks, every rank draws the same prompts from the same stream and rolls out its own
share of them (whole groups), so rank r's mini-batch j is its part of the global mini-batch j.

Staleness is one concept in both: a row's lag is the learner's version when it is trained minus
the oldest policy version that sampled one of its tokens (``TrainBatch.versions``).
"""

from __future__ import annotations

import time

import torch

from vespo.buffer import split_minibatches
from vespo.config import Config
from vespo.data import PromptStream
from vespo.rollout.base import SamplingParams
from vespo.rollout.text import TextGenerator
from vespo.trainer.distributed import Dist
from vespo.trainer.producer import PromptSampler, RolloutScorer
from vespo.trainer.protocols import Learner, TrainItem
from vespo.trainer.run import Run
from vespo.types import Problem


def step_seed(cfg: Config, step: int, stream: int) -> int:
    """A seed per (run seed, rollout step or ticket, purpose) so a resumed run draws the same samples."""
    return (cfg.run.seed * 1_000_003 + step * 7919 + stream) % (2**62)


class LocalSource:
    """Sync mode: rollout in this process, one batch per rollout step, split into N stale mini-batches."""

    def __init__(self, run: Run, learner: Learner, dist: Dist | None = None, engine=None):
        self.cfg, self.learner = run.cfg, learner
        self.dist = dist or Dist.single()
        self.schedule = run.schedule
        # the engine runs the learner's own module where it can (one process, nothing trains while it samples)
        self.engine = engine if engine is not None else run.make_engine(run.policy, share=not self.dist.active)
        self.engine_version: int | None = None  # learner version whose weights the engine holds
        self.stream = PromptStream(run.train_problems, seed=run.cfg.run.seed)
        self.sampler = PromptSampler(run.tokenizer, self.stream, run.cfg.rollout.group_size)
        self.scorer = RolloutScorer(run.tokenizer, run.rewards, run.cfg.rollout.group_size, run.cfg.advantage)
        self.text = TextGenerator(self.engine, run.tokenizer)
        self.sampling = run.sampling
        self.next_index = 0

    def start(self, first_update: int) -> None:
        if not self.schedule.ends_step(first_update):
            raise ValueError(f"a sync run resumes at a rollout-step boundary; update {first_update} is not a "
                             f"multiple of staleness.n={self.schedule.n}")
        self.next_index = first_update

    def next(self) -> list[TrainItem]:
        """One rollout batch at the learner's current version, as N items in update order."""
        cfg, step, dist = self.cfg, self.schedule.step(self.next_index), self.dist
        t0 = time.perf_counter()
        self._sync_engine()
        n_prompts = cfg.prompts_per_step
        prompts = self.sampler.sample(n_prompts, first_group_id=step * n_prompts).part(dist.rank, dist.world)
        seed = step_seed(cfg, step, 1 if dist.is_main else 1000 + dist.rank)  # rank 0 samples as one process does
        rollout = self.engine.generate(prompts.prompt_ids, self.sampling, seed=seed)
        gen_s = time.perf_counter() - t0
        batch, rows, info = self.scorer.score(prompts, rollout)
        shuffle = torch.Generator().manual_seed(step_seed(cfg, step, 2)) if cfg.staleness.shuffle else None
        perf = {**info, "perf/rollout_s": gen_s, "perf/rollout_tokens_per_s": float(rows["length"].sum()) / gen_s}
        items = [TrainItem(self.next_index + j, mb, sampled_version=self.learner.version,
                           rollout_rows=rows if j == 0 else {}, perf=perf if j == 0 else {})
                 for j, mb in enumerate(split_minibatches(batch, self.schedule.n, shuffle))]
        self.next_index += self.schedule.n
        return items

    def _sync_engine(self) -> None:
        """Give the engine the learner's weights if it does not hold them yet."""
        if self.engine_version != self.learner.version:
            self.engine.load_weights(self.learner.weights(), self.learner.version)
            self.engine_version = self.learner.version

    def after_update(self, version: int) -> None:
        pass  # the engine takes the new weights when the next rollout batch starts

    def generate(self, problems: list[Problem], n: int, sampling: SamplingParams, seed: int) -> list[list[str]]:
        self._sync_engine()
        return self.text(problems, n, sampling, seed)

    def checkpointable(self) -> bool:
        return False  # only between rollout steps (nothing sampled and untrained), where the loop checkpoints

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])

    def step_metrics(self) -> dict[str, float]:
        return {}

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        pass
