"""Simulated runs for the collapse rule: how often it flags a run that did not collapse, and how often
it misses one that did, on the lab's own evaluation schedules.

    rates(RULE)        [Rate(scenario, points, flagged, runs), ...] at 4 and at 8 evaluation points

A simulated run has a true held-out accuracy p(u) after u optimizer steps: a rise from START to an
end drawn in END_RANGE, plus a slow wobble (an AR(1) process on the logit scale with correlation
time WOBBLE_UPDATES). The rule sees the evaluation before training (1024 problems) and one every
EVERY updates (EVAL_PROBLEMS problems, binomial): 4 points in a 256-update run (the lr ranges), 8 in
a 512-update one (the other sweeps). The scenarios:

    stable      no collapse (wobble 0.3: calm; 0.6: large swings, about +-0.12 in accuracy at 0.7)
    dip         stable, but once the accuracy falls to a third for 16-128 updates and recovers
    collapse    after an update drawn uniformly from the first evaluation to the end, the accuracy
                falls to a share of what it was drawn in DEPTHS (a half to a third) and stays there

On the first three the share flagged is a false-positive rate; on collapsing runs one minus it is
the miss rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from vespo.lab.collapse import RULE, CollapseRule, detect_collapse

EVERY, EVAL_PROBLEMS, BEFORE_PROBLEMS = RULE.every, 256, 1024
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
