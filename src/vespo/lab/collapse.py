"""Collapse detection: did a run die, and when? Judged on the same evidence at every N.

The evidence is a series of points taken after the same optimizer steps in every run:

    held-out   the held-out evaluations the trainer makes every run.eval_every_updates updates
               (rows with eval/reward_sampled; the lab: every 64 updates on 256 problems), with the
               evaluation before training as the starting best
    train      for a run without them: the training reward averaged over windows of ``rule.every``
               updates (under the paper's protocol a window holds the same samples at every N)

The EOS rate and skipped updates are read over the same windows. A run has collapsed when the first
of these happens:

    nonfinite   an update had a non-finite loss or gradient (optim/n_skipped > 0), or the trainer
                stopped the run for it
    reward      the evidence fell below ``fraction`` x its best so far and stayed below through the
                last point, for at least ``patience`` points
    eos         the share of responses that end with EOS fell below ``eos_floor`` and stayed there as long

RULE is chosen from simulated runs on the lab's own schedules (vespo.lab.simulate): falls to a half
down to a third of the accuracy, caught at 4 and at 8 evaluation points with at most 1 miss in 10.
PREVIOUS (half the best, two points) missed 4 in 10 of them; the page prints both rates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Collapse:
    collapsed: bool
    reason: str | None = None  # "nonfinite", "reward" or "eos"
    step: int | None = None  # 1-based evidence point where the collapse began
    update: int | None = None  # optimizer steps taken at that point
    evidence: str | None = None  # "held-out" or "train"


@dataclass(frozen=True)
class CollapseRule:
    fraction: float = 0.6  # evidence below fraction x its best so far counts as fallen
    patience: int = 1  # fallen for at least this many points through the last
    min_best: float = 0.05  # a best below this is too small to fall from
    eos_floor: float = 0.5  # EOS rate below this counts as "responses stopped ending"
    every: int = 64  # updates per window of training rows (the lab's run.eval_every_updates)

    def __post_init__(self) -> None:
        for name, ok in (("fraction", 0 < self.fraction < 1), ("patience", self.patience >= 1),
                         ("eos_floor", 0 < self.eos_floor <= 1), ("every", self.every >= 1)):
            if not ok:
                raise ValueError(f"collapse rule: bad {name} {getattr(self, name)!r}")


RULE = CollapseRule()
PREVIOUS = CollapseRule(fraction=0.5, patience=2)  # the rule before RULE (for the page's comparison)


def describe(rule: CollapseRule = RULE) -> str:
    points = "the last evaluation" if rule.patience == 1 else f"at least the last {rule.patience} evaluations"
    return (f"Collapsed = held-out accuracy (evaluated after the same optimizer steps in every run) below "
            f"{rule.fraction:g} x its best so far (the evaluation before training included; a best below "
            f"{rule.min_best:g} cannot fall), or a share of responses ending with EOS below {rule.eos_floor:g} over "
            f"windows of {rule.every} updates, from where it fell through {points}; or non-finite updates. Runs "
            f"without held-out evaluations during training are judged on their training reward over windows of "
            f"{rule.every} updates instead")


def detect_collapse(rewards: Sequence[float], skipped: Sequence[float] | None = None,
                    eos_rates: Sequence[float] | None = None, stopped_nonfinite: bool = False,
                    rule: CollapseRule = RULE, start: float | None = None) -> Collapse:
    """The rules on aligned evidence points (index i is point i + 1); ``start`` is the reward before
    the first point, counted in the best so far."""
    for name, seq in (("skipped", skipped), ("eos_rates", eos_rates)):
        if seq is not None and len(seq) != len(rewards):
            raise ValueError(f"{name} has {len(seq)} points but rewards has {len(rewards)}")
    bad = [i for i, (r, s) in enumerate(zip(rewards, skipped or [0.0] * len(rewards)))
           if not math.isfinite(r) or s > 0 or not math.isfinite(s)]
    found = []
    if bad or stopped_nonfinite:
        found.append(Collapse(True, "nonfinite", bad[0] + 1 if bad else len(rewards) + 1))
    best = np.fmax.accumulate(np.r_[start if start is not None and math.isfinite(start) else -np.inf, rewards])[1:]
    fallen = (best >= rule.min_best) & (np.asarray(rewards, dtype=float) < rule.fraction * best)
    found += [_through_end(fallen, "reward", rule),
              _through_end(np.asarray(eos_rates, dtype=float) < rule.eos_floor if eos_rates else None, "eos", rule)]
    found = [c for c in found if c.collapsed]
    return min(found, key=lambda c: c.step) if found else Collapse(False)


def _through_end(fallen: np.ndarray | None, reason: str, rule: CollapseRule) -> Collapse:
    """Collapsed at the first point of the run of fallen points that reaches the end, if long enough."""
    if fallen is None or not len(fallen) or not fallen[-1]:
        return Collapse(False)
    first = len(fallen) - int(np.argmin(fallen[::-1])) if not fallen.all() else 0
    return Collapse(True, reason, first + 1) if len(fallen) - first >= rule.patience else Collapse(False)


@dataclass(frozen=True)
class Evidence:
    source: str  # "held-out" or "train"
    updates: list[int]  # optimizer steps taken at each point
    rewards: list[float]  # held-out sampled accuracy, or the window's mean training reward
    skipped: list[float]  # updates skipped for non-finite values since the previous point
    eos: list[float] | None  # the window's mean EOS rate (None when the rows have none)
    start: float | None  # held-out accuracy before training (held-out evidence only)


def evidence_of_rows(rows: list[dict], n: int, before: float | None = None, rule: CollapseRule = RULE) -> Evidence:
    """The points a run is judged on. Row k (1-based) of a run at N holds the samples trained in
    updates (k - 1) x N .. k x N - 1; its evaluation (if any) comes after k x N updates."""
    for i, row in enumerate(rows):
        if "reward/mean" not in row:
            raise ValueError(f"metrics row {i} (step {row.get('step')}) has no 'reward/mean'")
    done = [int(r["step"]) * n for r in rows]  # updates done after each row
    evals = [(u, float(r["eval/reward_sampled"])) for u, r in zip(done, rows) if "eval/reward_sampled" in r]
    last = max(done, default=0)
    ends = [u for u, _ in evals] or sorted({min(math.ceil(u / rule.every) * rule.every, last) for u in done})
    windows = [[r for u, r in zip(done, rows) if lo < u <= hi] for lo, hi in zip([0] + ends[:-1], ends)]
    skipped = [sum(float(r.get("optim/n_skipped", 0.0)) for r in w) for w in windows]
    eos = [float(np.mean([r["rollout/eos_rate"] for r in w])) if w else math.nan for w in windows] \
        if all("rollout/eos_rate" in r for r in rows) else None
    if evals:
        return Evidence("held-out", ends, [v for _, v in evals], skipped, eos, before)
    rewards = [float(np.mean([r["reward/mean"] for r in w])) if w else math.nan for w in windows]
    return Evidence("train", ends, rewards, skipped, eos, None)


def collapse_of_rows(rows: list[dict], n: int = 1, before: float | None = None, stopped_nonfinite: bool = False,
                     rule: CollapseRule = RULE) -> Collapse:
    """detect_collapse on a run's evidence, naming the optimizer step where the collapse began."""
    ev = evidence_of_rows(rows, n, before, rule)
    c = detect_collapse(ev.rewards, ev.skipped, ev.eos, stopped_nonfinite, rule, ev.start)
    if not c.collapsed:
        return Collapse(False, evidence=ev.source)
    update = ev.updates[min(c.step, len(ev.updates)) - 1] if ev.updates else 0
    return Collapse(True, c.reason, c.step, update, ev.source)
