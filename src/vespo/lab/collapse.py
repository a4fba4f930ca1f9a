"""Collapse detection: did a run die, and when?

A pure function of a run's per-step curves (the rows of metrics.jsonl). A run has collapsed when
any of these holds:

    nonfinite   an update had a non-finite loss or gradient (optim/n_skipped > 0), or the run was
                stopped for it (the trainer raises after run.max_nonfinite_steps in a row)
    reward      the reward fell below ``fraction`` x its best and stayed below until the end
    eos         the share of responses that end with EOS fell below ``eos_floor`` and stayed
                there until the end (dying runs stop ending their answers, hit the length cap
                and score 0)

"Until the end" must last at least ``patience_share`` of the run's rollout steps (and at least
``patience`` steps). A share, not a count, so that the rule means the same at every N under the
paper's protocol: with equal optimizer steps a run at N = 1 has 64x the rollout steps of a run at
N = 64, and a share of the steps is the same share of its optimizer steps and samples.

The first rule that fires (in step order) is the one reported.

    from vespo.lab.collapse import detect_collapse
    c = detect_collapse(rewards=[.4, .5, .1, 0, 0], skipped=[0] * 5)   # Collapse(True, "reward", 3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Collapse:
    collapsed: bool
    reason: str | None = None  # "nonfinite", "reward" or "eos"
    step: int | None = None  # 1-based rollout step where the collapse began


@dataclass(frozen=True)
class CollapseRule:
    fraction: float = 0.5  # reward below fraction * best counts as fallen
    patience_share: float = 0.1  # fallen for at least this share of the run's steps, through its end ...
    patience: int = 1  # ... and for at least this many steps
    min_best: float = 0.05  # a best reward below this is too small to fall from
    eos_floor: float = 0.5  # EOS rate below this counts as "responses stopped ending"

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {self.fraction}")
        if not 0.0 <= self.patience_share <= 1.0:
            raise ValueError(f"patience_share must be in [0, 1], got {self.patience_share}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not 0.0 < self.eos_floor <= 1.0:
            raise ValueError(f"eos_floor must be in (0, 1], got {self.eos_floor}")

    def steps_needed(self, n_steps: int) -> int:
        """How many final steps a fall must last in a run of ``n_steps`` rollout steps."""
        return max(self.patience, math.ceil(self.patience_share * n_steps - 1e-9))


def detect_collapse(rewards: Sequence[float], skipped: Sequence[float] | None = None,
                    eos_rates: Sequence[float] | None = None, stopped_nonfinite: bool = False,
                    rule: CollapseRule = CollapseRule()) -> Collapse:
    """Apply the three rules to one run's curves (index i is rollout step i + 1)."""
    _check_lengths(rewards, skipped, eos_rates)
    found = [c for c in (_nonfinite(rewards, skipped, stopped_nonfinite), _reward_fall(rewards, rule),
                         _eos_fall(eos_rates, rule)) if c.collapsed]
    if not found:
        return Collapse(False)
    return min(found, key=lambda c: c.step)


def _check_lengths(rewards, skipped, eos_rates) -> None:
    for name, seq in (("skipped", skipped), ("eos_rates", eos_rates)):
        if seq is not None and len(seq) != len(rewards):
            raise ValueError(f"{name} has {len(seq)} steps but rewards has {len(rewards)}")


def _nonfinite(rewards, skipped, stopped: bool) -> Collapse:
    for i, s in enumerate(skipped or []):
        if s > 0 or not math.isfinite(s):
            return Collapse(True, "nonfinite", i + 1)
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            return Collapse(True, "nonfinite", i + 1)
    if stopped:
        return Collapse(True, "nonfinite", len(rewards) + 1)
    return Collapse(False)


def _reward_fall(rewards: Sequence[float], rule: CollapseRule) -> Collapse:
    """The earliest step after which the reward stays below fraction x (best so far)."""
    best, start = -math.inf, None
    for i, r in enumerate(rewards):
        best = max(best, r)
        fallen = best >= rule.min_best and r < rule.fraction * best
        start = (i if start is None else start) if fallen else None
    return _if_long_enough(start, len(rewards), "reward", rule)


def _eos_fall(eos_rates: Sequence[float] | None, rule: CollapseRule) -> Collapse:
    start = None
    for i, e in enumerate(eos_rates or []):
        start = (i if start is None else start) if e < rule.eos_floor else None
    return _if_long_enough(start, len(eos_rates or []), "eos", rule)


def _if_long_enough(start: int | None, n: int, reason: str, rule: CollapseRule) -> Collapse:
    if start is None or n - start < rule.steps_needed(n):
        return Collapse(False)
    return Collapse(True, reason, start + 1)


def collapse_of_rows(rows: list[dict], stopped_nonfinite: bool = False, rule: CollapseRule = CollapseRule()) -> Collapse:
    """detect_collapse on the rows of a metrics.jsonl (reward/mean, optim/n_skipped, rollout/eos_rate)."""
    for i, row in enumerate(rows):
        if "reward/mean" not in row:
            raise ValueError(f"metrics row {i} (step {row.get('step')}) has no 'reward/mean'")
    rewards = [float(r["reward/mean"]) for r in rows]
    skipped = [float(r.get("optim/n_skipped", 0.0)) for r in rows]
    eos = [float(r["rollout/eos_rate"]) for r in rows] if all("rollout/eos_rate" in r for r in rows) else None
    return detect_collapse(rewards, skipped, eos, stopped_nonfinite, rule)
