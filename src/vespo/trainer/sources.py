"""Where the training loop's mini-batches come from: the sample-source protocol and the local source.

The loop (vespo.trainer.loop) asks a source for one mini-batch per optimizer step, with μ already
set, and never needs to know how it was made. Two sources:

    LocalSource  (sync mode)   one rollout batch of rollout.prompts_per_step prompts x G responses at
                               one policy version v, split into N = staleness.n mini-batches; μ for all
                               of them is set before the first update (recomputed by the trainer, or
                               the engine's log-probs), so mini-batch j is trained at lag j.
    RaySource    (async mode)  rollout workers on Ray generate mini-batches continuously with the newest
                               weights they have (vespo.trainer.ray_source).

Staleness is one concept in both: a row's lag is the learner's version when it is trained minus
the oldest policy version that sampled one of its tokens (``TrainBatch.versions``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vespo.buffer import split_minibatches
from vespo.config import Config
from vespo.data import PromptStream
from vespo.rollout.base import SamplingParams
from vespo.rollout.text import TextGenerator
from vespo.trainer.producer import RolloutProducer
from vespo.trainer.run import Run
from torch import Tensor

from vespo.types import Problem, TrainBatch


@dataclass
class TrainItem:
    """One mini-batch for one optimizer step."""

    index: int  # the update it is for, 0-based over the whole run
    batch: TrainBatch  # old_logp (μ) set
    metrics: dict[str, float] = field(default_factory=dict)  # rollout and behavior metrics that came with it
    behavior_pass: bool = False  # the update's forward is the batch's behavior pass (lag 0; μ None if recomputed)
    lags: Tensor | None = None  # [b] int64, each row's lag when trained (set by the loop)
    log_w: Tensor | None = None  # [b] each row's sequence log-weight in its update (set by the loop)
    weight: Tensor | None = None  # [b] the loss's weight on each row in its update (set by the loop)


class SampleSource(Protocol):
    """A stream of mini-batches for the learner, one per update, in order."""

    max_lag: int  # the largest lag a row can have (N - 1, or async.max_staleness)

    def start(self, first_update: int) -> None:
        """Begin at update ``first_update`` (0, or where a checkpoint left off)."""
        ...

    def next(self) -> TrainItem:
        """The mini-batch for the next update."""
        ...

    def after_update(self, version: int) -> None:
        """The learner has moved to ``version`` (or skipped a non-finite update)."""
        ...

    def generate(self, problems: list[Problem], n: int, sampling: SamplingParams, seed: int) -> list[list[str]]:
        """n completions per problem with the learner's newest weights (held-out evaluation)."""
        ...

    def checkpointable(self) -> bool:
        """Whether ``state_dict`` can describe where the source is now."""
        ...

    def state_dict(self) -> dict:
        """What a checkpoint holds so that ``load_state_dict`` resumes at the first untrained update."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def summary(self) -> dict:
        """Figures for the run summary (weight pushes, restarts, ...)."""
        ...

    def close(self) -> None: ...


def build_source(run: Run, learner) -> SampleSource:
    """The sample source of run.mode: LocalSource (sync) or RaySource (async; Ray must be running)."""
    if run.cfg.run.mode == "async":
        from vespo.trainer.ray_source import RaySource

        return RaySource(run, learner)
    return LocalSource(run, learner)


def step_seed(cfg: Config, step: int, stream: int) -> int:
    """A seed per (run seed, rollout step or ticket, purpose) so a resumed run draws the same samples."""
    return (cfg.run.seed * 1_000_003 + step * 7919 + stream) % (2**62)


class LocalSource:
    """Sync mode: rollout in this process, one batch per rollout step, split into N stale mini-batches."""

    def __init__(self, run: Run, learner):
        self.cfg, self.learner = run.cfg, learner
        self.n = run.cfg.staleness.n
        self.max_lag = self.n - 1
        self.engine = run.make_engine(run.policy)
        self.engine_version: int | None = None  # learner version whose weights the engine holds
        self.stream = PromptStream(run.train_problems, seed=run.cfg.run.seed)
        self.producer = RolloutProducer(self.engine, run.tokenizer, self.stream, run.rewards, run.sampling,
                                        run.cfg.rollout.group_size, run.cfg.advantage)
        self.text = TextGenerator(self.engine, run.tokenizer)
        self.pending: list[TrainBatch] = []
        self.first_of_step = False  # the next pending mini-batch is the rollout step's first (lag 0)
        self.share_first = learner.shares_behavior_forward(run.cfg.rollout.router_replay)
        self.next_index = 0

    def start(self, first_update: int) -> None:
        if first_update % self.n:
            raise ValueError(f"a sync run resumes at a rollout-step boundary; update {first_update} is not a "
                             f"multiple of staleness.n={self.n}")
        self.next_index, self.pending = first_update, []

    def next(self) -> TrainItem:
        metrics: dict[str, float] = {}
        if not self.pending:
            metrics = self._rollout(self.next_index // self.n)
        item = TrainItem(self.next_index, self.pending.pop(0), metrics, behavior_pass=self.first_of_step)
        self.first_of_step = False
        self.next_index += 1
        return item

    def _rollout(self, step: int) -> dict[str, float]:
        """One rollout batch at the learner's current version, split into N mini-batches with μ set."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self._sync_engine()
        batch, metrics = self.producer.produce(cfg.rollout.prompts_per_step, seed=step_seed(cfg, step, 1),
                                               first_group_id=step * cfg.rollout.prompts_per_step)
        shuffle = torch.Generator().manual_seed(step_seed(cfg, step, 2)) if cfg.staleness.shuffle else None
        minibatches = split_minibatches(batch, self.n, shuffle)
        # μ of every mini-batch before the first update; the first one (lag 0) can take its behavior
        # pass from its own update's forward (the same weights), one forward fewer per rollout step
        first, rest = (minibatches[:1], minibatches[1:]) if self.share_first else ([], minibatches)
        rest, behavior = self.learner.prepare(rest, cfg.behavior, cfg.rollout.router_replay) if rest else ([], {})
        for mb in first:
            mb.old_logp = mb.rollout_logp if cfg.behavior == "rollout" else None
        self.pending, self.first_of_step = first + rest, bool(first)
        metrics.update(behavior)
        metrics["perf/rollout_and_mu_s"] = time.perf_counter() - t0
        return metrics

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
        return not self.pending  # between rollout steps: nothing sampled and untrained

    def state_dict(self) -> dict:
        if self.pending:
            raise RuntimeError("LocalSource.state_dict mid rollout step: checkpoints fall between rollout steps")
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        pass
