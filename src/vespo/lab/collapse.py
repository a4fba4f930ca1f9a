"""Collapse detection: did a run die, and when? Judged on the same evidence at every N, and the rule's
error rates on simulated runs of the lab's own schedules.

The evidence is a series of points taken after the same optimizer steps in every run: the held-out
evaluations the trainer makes every run.eval_every_updates updates (the lab: every 64 on 256 problems),
the evaluation before training the starting best; for a run without them, the training reward over
windows of ``rule.every`` updates (the same samples at every N). The EOS rate and skipped updates are
read over the same windows. A run has collapsed when the first of these happens: **nonfinite** (an update
skipped for a non-finite loss or gradient, or the trainer stopped the run for it), **reward** (below
``fraction`` x its best so far through the last ``patience`` points or more), **eos** (the share of
responses ending with EOS below ``eos_floor`` as long).

RULE catches 19 in 20 falls to a half down to a third at 4 and at 8 evaluations (`rates`); PREVIOUS (half
the best for two evaluations) missed 4 to 6 in 10. A simulated run: a rising true accuracy with a slow
AR(1) wobble on the logit scale, evaluations drawn binomially; scenarios SCENARIOS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

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


# ---------------------------------------------------------------- the rule on simulated runs


EVERY, EVAL_PROBLEMS, BEFORE_PROBLEMS = RULE.every, 256, 1024  # the lab's evaluations
SCHEDULES = (256, 512)  # run lengths in updates: 4 and 8 evaluation points
START, END_RANGE, WOBBLE_UPDATES = 0.3, (0.6, 0.85), 32
DEPTHS = (1 / 3, 1 / 2)
SCENARIOS = {"stable, calm (wobble 0.3)": (0.3, "none"), "stable, large swings (wobble 0.6)": (0.6, "none"),
             "a dip to a third that recovers": (0.3, "dip"),
             "collapse to a half down to a third": (0.3, "collapse")}


@dataclass(frozen=True)
class Rate:
    scenario: str
    points: int  # evaluations during the run
    flagged: float  # share of runs the rule called collapsed
    runs: int


def true_accuracy(rng: np.random.Generator, runs: int, wobble: float, fall: str, updates: int) -> np.ndarray:
    """p(u) for u = 0 .. updates: [runs, updates + 1]; fall is "none", "dip" or "collapse"."""
    u = np.arange(updates + 1)  # [U + 1]
    end = rng.uniform(*END_RANGE, size=(runs, 1))  # [runs, 1]
    rise = (1 - np.exp(-3 * u / updates)) / (1 - math.exp(-3))  # [U + 1], 0 -> 1
    logit = _logit(START) + (_logit(end) - _logit(START)) * rise  # [runs, U + 1]
    rho = math.exp(-1 / WOBBLE_UPDATES)
    noise = rng.standard_normal((runs, updates + 1)) * wobble * math.sqrt(1 - rho ** 2)
    w = np.zeros((runs, updates + 1))
    for i in range(1, updates + 1):
        w[:, i] = rho * w[:, i - 1] + noise[:, i]
    p = 1 / (1 + np.exp(-(logit + w)))
    if fall == "collapse":
        at = rng.integers(EVERY, updates, size=runs)  # [runs]
        depth = rng.uniform(*DEPTHS, size=runs)  # [runs]
        p = np.where(u[None, :] >= at[:, None], (p[np.arange(runs), at] * depth)[:, None], p)
    elif fall == "dip":
        length = rng.integers(16, 129, size=runs)  # [runs]
        at = (rng.uniform(size=runs) * (updates - length)).astype(int)  # recovers before the end
        p = np.where((u[None, :] >= at[:, None]) & (u[None, :] < (at + length)[:, None]), p / 3, p)
    return p


@lru_cache(maxsize=8)
def rates(rule: CollapseRule = RULE, runs: int = 1000, seed: int = 0) -> tuple[Rate, ...]:
    """The share of simulated runs the rule flags, per scenario and schedule."""
    rng = np.random.default_rng(seed)
    out = []
    for updates in SCHEDULES:
        for scenario, (wobble, fall) in SCENARIOS.items():
            p = true_accuracy(rng, runs, wobble, fall, updates)
            before = rng.binomial(BEFORE_PROBLEMS, p[:, 0]) / BEFORE_PROBLEMS  # [runs]
            points = rng.binomial(EVAL_PROBLEMS, p[:, EVERY::EVERY]) / EVAL_PROBLEMS  # [runs, updates / EVERY]
            flagged = [detect_collapse(list(points[i]), rule=rule, start=float(before[i])).collapsed for i in range(runs)]
            out.append(Rate(scenario, points.shape[1], float(np.mean(flagged)), runs))
    return tuple(out)


def _logit(p):
    return np.log(p / (1 - p))
