"""The seams of the trainer: what a sample source delivers, what a learner does with it, and what comes back.

    source.next()            -> [TrainItem, ...]   mini-batches that were sampled together (sync: one
                                                   rollout step's N; async: one ticket's one)
    learner.prepare(items)   -> Rows               μ for each item, decided by the learner alone; the
                                                   behaviour rows (engine vs trainer) of passes run now
    learner.update(item)     -> UpdateResult       one optimizer step; metrics, behaviour rows of a pass
                                                   shared with the update, and what it learned per row

Both sides run on one ``Schedule``, made once from the config (``Run.schedule``): N updates per rollout step,
the run's steps, and the largest lag a row can have.

Items are immutable: a source fills them once with samples, their rollout log-probs and versions,
and nothing downstream writes into them. The two implementations of each protocol: LocalSource
(vespo.trainer.sources) and RaySource (vespo.trainer.ray_source); Learner (vespo.trainer.learner)
and RemoteLearner (vespo.trainer.remote, the same learner in a Ray actor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from vespo.config import Config
from vespo.losses.diagnostics import Rows
from vespo.rollout.base import SamplingParams
from vespo.types import Problem, TrainBatch


@dataclass(frozen=True)
class Schedule:
    """The run's schedule: a rollout step is N = staleness.n updates (one metrics row, the unit of run.steps,
    checkpoints and evaluations), the run ``steps`` of them."""

    n: int  # updates per rollout step
    steps: int  # rollout steps of the run (cfg.steps)
    max_lag: int  # the largest lag a row can have: N - 1 in sync mode, async.max_staleness in async mode

    @classmethod
    def of(cls, cfg: Config) -> Schedule:
        n = cfg.staleness.n
        return cls(n, cfg.steps, cfg.async_.max_staleness if cfg.run.mode == "async" else n - 1)

    @property
    def total(self) -> int:
        """Updates of the whole run."""
        return self.steps * self.n

    def step(self, updates: int) -> int:
        """Rollout steps done after ``updates`` updates."""
        return updates // self.n

    def ends_step(self, updates: int) -> bool:
        """``updates`` updates end a rollout step (its row is due; a sync run resumes only there)."""
        return updates % self.n == 0


@dataclass(frozen=True)
class TrainItem:
    """One mini-batch for one optimizer step."""

    index: int  # the update it is for, 0-based over the whole run
    batch: TrainBatch  # samples with the engine's log-probs (rollout_logp) and versions; no μ
    sampled_version: int | None  # the learner version whose weights sampled every token; None if rows span versions
    rollout_rows: Rows = field(default_factory=dict)  # per-row rollout statistics of the samples drawn with it
    perf: dict[str, float] = field(default_factory=dict)  # timings of its rollout (perf/*)


@dataclass(frozen=True)
class UpdateResult:
    """What one update reports and learned about its rows."""

    metrics: dict[str, float]  # loss diagnostics of the whole mini-batch, optimizer figures
    skipped: bool  # a non-finite loss or gradient: the weights were not touched
    behavior_rows: Rows  # engine-vs-trainer rows of a behaviour pass this update's forward also served (else {})
    lags: Tensor  # [b] int64, learner version when trained minus the oldest version that sampled a token
    log_w: Tensor  # [b] each row's sequence log-weight in the update
    weight: Tensor  # [b] the loss's gradient weight on each row relative to REINFORCE (NaN where A = 0)


class SampleSource(Protocol):
    """A stream of mini-batches for the learner, in update order."""

    def start(self, first_update: int) -> None:
        """Begin at update ``first_update`` (0, or where a checkpoint left off)."""

    def next(self) -> list[TrainItem]:
        """The next items, sampled together, in update order."""

    def after_update(self, version: int) -> None:
        """The learner has moved to ``version`` (or skipped a non-finite update)."""

    def generate(self, problems: list[Problem], n: int, sampling: SamplingParams, seed: int) -> list[list[str]]:
        """n completions per problem with the learner's newest weights (held-out evaluation)."""

    def checkpointable(self) -> bool:
        """Whether ``state_dict`` can describe where the source is now."""

    def state_dict(self) -> dict:
        """What a checkpoint holds so that ``load_state_dict`` resumes at the first untrained update."""

    def load_state_dict(self, state: dict) -> None: ...

    def step_metrics(self) -> dict[str, float]:
        """Figures for the current rollout step's metrics row (weight pushes, restarts, ...)."""

    def summary(self) -> dict:
        """Figures for the run summary."""

    def close(self) -> None: ...


class Learner(Protocol):
    """The policy, its optimizer, and the one owner of μ (staleness.behavior, rollout.router_replay)."""

    version: int  # optimizer steps taken = the policy version
    nonfinite_total: int  # updates skipped as non-finite
    world_size: int  # processes the learner is sharded over

    def prepare(self, items: list[TrainItem]) -> Rows:
        """Decide μ for each item before any of them is trained; the behaviour rows of passes run now."""

    def update(self, item: TrainItem) -> UpdateResult:
        """One optimizer step on a prepared item."""

    def weights(self) -> dict[str, Tensor]:
        """The policy's full weights on the CPU (what engines load)."""

    def shared_weights(self) -> Any:
        """The weights in Ray's object store, put once by the process that holds them (async mode)."""

    def memory(self) -> dict[str, float]:
        """mem/param_bytes_per_rank and mem/optim_bytes_per_rank: the bytes of one rank's shards."""

    def save_checkpoint(self, run_dir: str | Path, step: int, extra: dict, config: dict) -> Path: ...

    def load_checkpoint(self, path: str | Path) -> dict:
        """Weights and optimizer from a checkpoint; returns the loop's ``extra`` state."""

    def save_policy(self, run_dir: str | Path, tokenizer: Any, config: dict) -> Path: ...

    def close(self) -> None: ...
