"""Collapse detection: did a run die, and when? Judged on the same evidence at every N.

The evidence is a series of points taken after the same optimizer steps in every run, so a run at
N = 1 and one at N = 64 are judged on equal footing:

    held-out   the held-out evaluations the trainer makes every run.eval_every_updates updates
               (metrics rows with eval/reward_sampled; the lab evaluates every 64 updates on 256
               problems), with the evaluation before training as the starting best
    train      for a run without such evaluations: the training reward averaged over windows of
               ``rule.every`` updates (under the paper's protocol a window holds the same samples
               at every N: 64 rows of 64 responses at N = 1, one row of 4096 at N = 64)

The EOS rate and skipped updates are read over the same windows. A run has collapsed when any of
these holds:

    nonfinite   an update had a non-finite loss or gradient (optim/n_skipped > 0), or the trainer
                stopped the run for it (after run.max_nonfinite_steps in a row)
    reward      the evidence fell below ``fraction`` x its best so far and stayed below through the
                last point
    eos         the share of responses that end with EOS fell below ``eos_floor`` and stayed there
                through the last window (dying runs stop ending their answers and score 0)

"Through the last point" must span at least ``patience`` points and ``patience_share`` of them. The
first rule that fires (in update order) is the one reported. `describe` writes the rule in words from
these fields, for the report and the results page.

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
    step: int | None = None  # 1-based evidence point where the collapse began
    update: int | None = None  # optimizer steps taken at that point (None from detect_collapse alone)
    evidence: str | None = None  # "held-out" or "train" (None from detect_collapse alone)


@dataclass(frozen=True)
class CollapseRule:
    fraction: float = 0.5  # evidence below fraction x its best so far counts as fallen
    patience: int = 2  # fallen for at least this many points through the last ...
    patience_share: float = 0.1  # ... and at least this share of the run's points
    min_best: float = 0.05  # a best below this is too small to fall from
    eos_floor: float = 0.5  # EOS rate below this counts as "responses stopped ending"
    every: int = 64  # updates per window of training rows (the lab's run.eval_every_updates)

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {self.fraction}")
        if not 0.0 <= self.patience_share <= 1.0:
            raise ValueError(f"patience_share must be in [0, 1], got {self.patience_share}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not 0.0 < self.eos_floor <= 1.0:
            raise ValueError(f"eos_floor must be in (0, 1], got {self.eos_floor}")
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")

    def points_needed(self, n_points: int) -> int:
        """How many final points a fall must span in a run of ``n_points`` evidence points."""
        return max(self.patience, math.ceil(self.patience_share * n_points - 1e-9))


RULE = CollapseRule()


def describe(rule: CollapseRule = RULE) -> str:
    """The rule in words, from its fields."""
    return (f"Collapsed = held-out accuracy (evaluated after the same optimizer steps in every run) below "
            f"{rule.fraction:g} x its best so far (the best at least {rule.min_best:g}), or a share of responses "
            f"ending with EOS below {rule.eos_floor:g} over windows of {rule.every} updates, through the end of the "
            f"run for at least {rule.patience} evaluations and {rule.patience_share:.0%} of them; or non-finite "
            f"updates. Runs without held-out evaluations during training are judged on their training reward "
            f"over windows of {rule.every} updates instead")


# ---------------------------------------------------------------- the rule on a series of points


def detect_collapse(rewards: Sequence[float], skipped: Sequence[float] | None = None,
                    eos_rates: Sequence[float] | None = None, stopped_nonfinite: bool = False,
                    rule: CollapseRule = RULE, start: float | None = None) -> Collapse:
    """Apply the three rules to aligned evidence points (index i is point i + 1); ``start`` is the
    reward before the first point (the evaluation before training), counted in the best so far."""
    _check_lengths(rewards, skipped, eos_rates)
    found = [c for c in (_nonfinite(rewards, skipped, stopped_nonfinite), _reward_fall(rewards, rule, start),
                         _eos_fall(eos_rates, rule)) if c.collapsed]
    if not found:
        return Collapse(False)
    return min(found, key=lambda c: c.step)


def _check_lengths(rewards, skipped, eos_rates) -> None:
    for name, seq in (("skipped", skipped), ("eos_rates", eos_rates)):
        if seq is not None and len(seq) != len(rewards):
            raise ValueError(f"{name} has {len(seq)} points but rewards has {len(rewards)}")


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


def _reward_fall(rewards: Sequence[float], rule: CollapseRule, start: float | None) -> Collapse:
    """The earliest point after which the reward stays below fraction x (best so far)."""
    best, first = (start if start is not None and math.isfinite(start) else -math.inf), None
    for i, r in enumerate(rewards):
        best = max(best, r)
        fallen = best >= rule.min_best and r < rule.fraction * best
        first = (i if first is None else first) if fallen else None
    return _if_long_enough(first, len(rewards), "reward", rule)


def _eos_fall(eos_rates: Sequence[float] | None, rule: CollapseRule) -> Collapse:
    first = None
    for i, e in enumerate(eos_rates or []):
        first = (i if first is None else first) if e < rule.eos_floor else None
    return _if_long_enough(first, len(eos_rates or []), "eos", rule)


def _if_long_enough(first: int | None, n: int, reason: str, rule: CollapseRule) -> Collapse:
    if first is None or n - first < rule.points_needed(n):
        return Collapse(False)
    return Collapse(True, reason, first + 1)


# ---------------------------------------------------------------- the evidence of a run


@dataclass(frozen=True)
class Evidence:
    source: str  # "held-out" or "train"
    updates: list[int]  # optimizer steps taken at each point
    rewards: list[float]  # held-out sampled accuracy, or the window's mean training reward
    skipped: list[float]  # updates skipped for non-finite values up to each point (since the previous)
    eos: list[float] | None  # the window's mean EOS rate (None when the rows have none)
    start: float | None  # held-out accuracy before training (held-out evidence only)


def evidence_of_rows(rows: list[dict], n: int, before: float | None = None, rule: CollapseRule = RULE) -> Evidence:
    """The points a run is judged on: its held-out evaluations when it has them, else windows of
    ``rule.every`` updates of its training rows. Row k (1-based) of a run at N holds the samples
    trained in updates (k - 1) x N .. k x N - 1."""
    for i, row in enumerate(rows):
        if "reward/mean" not in row:
            raise ValueError(f"metrics row {i} (step {row.get('step')}) has no 'reward/mean'")
    evals = [(int(r["step"]) * n, float(r["eval/reward_sampled"])) for r in rows if "eval/reward_sampled" in r]
    ends = [u for u, _ in evals] or _window_ends(rows, n, rule.every)
    windows = _windows(rows, n, ends)
    skipped = [sum(float(r.get("optim/n_skipped", 0.0)) for r in w) for w in windows]
    eos = [_mean([float(r["rollout/eos_rate"]) for r in w]) for w in windows] \
        if all("rollout/eos_rate" in r for r in rows) else None
    if evals:
        return Evidence("held-out", ends, [v for _, v in evals], skipped, eos, before)
    return Evidence("train", ends, [_mean([float(r["reward/mean"]) for r in w]) for w in windows], skipped, eos, None)


def _window_ends(rows: list[dict], n: int, every: int) -> list[int]:
    """Ends (in updates) of the windows of ``every`` updates that hold a row; the last one is where
    the run's rows end (a shorter window when the run is not a whole number of them)."""
    last = max((int(r["step"]) * n for r in rows), default=0)
    ends = sorted({min(math.ceil(int(r["step"]) * n / every) * every, last) for r in rows})
    return ends


def _windows(rows: list[dict], n: int, ends: list[int]) -> list[list[dict]]:
    """The rows trained in each window (previous end, end]."""
    out, starts = [], [0] + ends[:-1]
    for lo, hi in zip(starts, ends):
        out.append([r for r in rows if lo < int(r["step"]) * n <= hi])
    return out


def collapse_of_rows(rows: list[dict], n: int = 1, before: float | None = None, stopped_nonfinite: bool = False,
                     rule: CollapseRule = RULE) -> Collapse:
    """detect_collapse on a run's evidence (vespo.lab.collapse.evidence_of_rows); the result names the
    optimizer step where the collapse began and which evidence decided."""
    ev = evidence_of_rows(rows, n, before, rule)
    c = detect_collapse(ev.rewards, ev.skipped, ev.eos, stopped_nonfinite, rule, ev.start)
    if not c.collapsed:
        return Collapse(False, evidence=ev.source)
    update = ev.updates[c.step - 1] if c.step <= len(ev.updates) else (ev.updates[-1] if ev.updates else 0)
    return Collapse(True, c.reason, c.step, update, ev.source)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
