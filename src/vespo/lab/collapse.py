"""Collapse detection (docs/lab.md, Collapse): did a run die, and when? Judged on points taken after the same
optimizer steps in every run: the held-out evaluations during training (the one before training the starting
best), else the training reward over windows of ``rule.every`` updates; skipped updates over the same windows.
The EOS rate is no evidence: a real model that stops ending its answers can still answer right (it is a column
of the run table instead). ``rates`` measures the rule on simulated runs of the lab's own schedules: a rising true
accuracy with a slow AR(1) wobble on the logit scale, evaluations drawn binomially (SCENARIOS).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Annotated, NamedTuple

import numpy as np
import pydantic
from pydantic import Field, PositiveInt
from scipy.signal import lfilter
from scipy.special import expit, logit


REASONS = {"reward": "fell", "nonfinite": "non-finite"}  # how tables name a collapse's reason: its evidence fell
                                                         # below the rule's line, or an update was not finite


class Collapse(NamedTuple):
    collapsed: bool
    reason: str | None = None  # "nonfinite" or "reward" (the evidence, held-out or training reward, fell)
    step: int | None = None  # 1-based evidence point where the collapse began
    update: int | None = None  # optimizer steps taken at that point
    evidence: str | None = None  # "held-out" or "train"


@pydantic.dataclasses.dataclass(frozen=True)
class CollapseRule:
    fraction: Annotated[float, Field(gt=0, lt=1)] = 0.6  # evidence below fraction x its best so far counts as fallen
    patience: PositiveInt = 1  # fallen for at least this many points through the last
    min_best: float = 0.05  # a best below this is too small to fall from
    every: PositiveInt = 64  # updates per window of training rows (the lab's run.eval_every_updates)


RULE = CollapseRule()
PREVIOUS = CollapseRule(fraction=0.5, patience=2)  # the rule before RULE (for the page's comparison)


def describe(rule: CollapseRule = RULE) -> str:
    points = "the last evaluation" if rule.patience == 1 else f"at least the last {rule.patience} evaluations"
    return (f"Collapsed = held-out accuracy (evaluated after the same optimizer steps in every run) below "
            f"{rule.fraction:g} x its best so far (the evaluation before training included; a best below "
            f"{rule.min_best:g} cannot fall), from where it fell through {points}; or non-finite updates. Runs "
            f"without held-out evaluations during training are judged on their training reward over windows of "
            f"{rule.every} updates instead")


def detect_collapse(rewards: Sequence[float], skipped: Sequence[float] | None = None, stopped_nonfinite: bool = False,
                    rule: CollapseRule = RULE, start: float | None = None) -> Collapse:
    """The rules on aligned evidence points (index i is point i + 1); ``start`` is the reward before
    the first point, counted in the best so far."""
    if skipped is not None and len(skipped) != len(rewards):
        raise ValueError(f"skipped has {len(skipped)} points but rewards has {len(rewards)}")
    bad = [i for i, (r, s) in enumerate(zip(rewards, skipped or [0.0] * len(rewards)))
           if not math.isfinite(r) or s > 0 or not math.isfinite(s)]
    found = [Collapse(True, "nonfinite", bad[0] + 1 if bad else len(rewards) + 1)] if bad or stopped_nonfinite else []
    best = np.fmax.accumulate(np.r_[start if start is not None and math.isfinite(start) else -np.inf, rewards])[1:]
    fallen = (best >= rule.min_best) & (np.asarray(rewards, dtype=float) < rule.fraction * best)
    tail = int(np.argmin(fallen[::-1])) if not fallen.all() else len(fallen)  # points fallen through the last
    if tail >= rule.patience:
        found.append(Collapse(True, "reward", len(fallen) - tail + 1))
    return min(found, key=lambda c: c.step) if found else Collapse(False)


class Evidence(NamedTuple):
    source: str  # "held-out" or "train"
    updates: list[int]  # optimizer steps taken at each point
    rewards: list[float]  # held-out sampled accuracy, or the window's mean training reward
    skipped: list[float]  # updates skipped for non-finite values since the previous point
    start: float | None  # held-out accuracy before training (held-out evidence only)


def evidence_of_rows(rows: list[dict], n: int, before: float | None = None, rule: CollapseRule = RULE) -> Evidence:
    """The points a run is judged on. Row k (1-based) of a run at N holds the samples trained in
    updates (k - 1) x N .. k x N - 1; its evaluation (if any) comes after k x N updates."""
    if (bad := next((i for i, row in enumerate(rows) if "reward/mean" not in row), None)) is not None:
        raise ValueError(f"metrics row {bad} (step {rows[bad].get('step')}) has no 'reward/mean'")
    done = [int(r["step"]) * n for r in rows]  # updates done after each row
    evals = [float(r["eval/reward_sampled"]) for r in rows if "eval/reward_sampled" in r]
    ends = [u for u, r in zip(done, rows) if "eval/reward_sampled" in r] or sorted(
        {min(math.ceil(u / rule.every) * rule.every, max(done)) for u in done})
    windows = [[r for u, r in zip(done, rows) if lo < u <= hi] for lo, hi in zip([0] + ends[:-1], ends)]
    skipped = [sum(float(r.get("optim/n_skipped", 0.0)) for r in w) for w in windows]
    if evals:
        return Evidence("held-out", ends, evals, skipped, before)
    train = [float(np.mean([r["reward/mean"] for r in w])) if w else math.nan for w in windows]
    return Evidence("train", ends, train, skipped, None)


def collapse_of_rows(rows: list[dict], n: int = 1, before: float | None = None, stopped_nonfinite: bool = False,
                     rule: CollapseRule = RULE) -> Collapse:
    """detect_collapse on a run's evidence, naming the optimizer step where the collapse began."""
    ev = evidence_of_rows(rows, n, before, rule)
    c = detect_collapse(ev.rewards, ev.skipped, stopped_nonfinite, rule, ev.start)
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


class Rate(NamedTuple):
    scenario: str
    points: int  # evaluations during the run
    flagged: float  # share of runs the rule called collapsed
    runs: int


def true_accuracy(rng: np.random.Generator, runs: int, wobble: float, fall: str, updates: int) -> np.ndarray:
    """p(u) for u = 0 .. updates: [runs, updates + 1]; fall is "none", "dip" or "collapse"."""
    u = np.arange(updates + 1)  # [U + 1]
    end = rng.uniform(*END_RANGE, size=(runs, 1))  # [runs, 1]
    rise = (1 - np.exp(-3 * u / updates)) / (1 - math.exp(-3))  # [U + 1], 0 -> 1
    rho = math.exp(-1 / WOBBLE_UPDATES)
    noise = rng.standard_normal((runs, updates + 1)) * wobble * math.sqrt(1 - rho ** 2)
    noise[:, 0] = 0.0  # the wobble starts at 0: w[i] = rho w[i - 1] + noise[i]
    p = expit(logit(START) + (logit(end) - logit(START)) * rise + lfilter([1.0], [1.0, -rho], noise, axis=1))
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
            flagged = [detect_collapse(list(x), rule=rule, start=float(b)).collapsed for x, b in zip(points, before)]
            out.append(Rate(scenario, points.shape[1], float(np.mean(flagged)), runs))
    return tuple(out)
