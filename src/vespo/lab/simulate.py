"""Simulated runs for the collapse rule: how often it flags a stable run, and how often it catches a
real collapse, on the evidence the lab gives it.

    rates = collapse_rates(runs=1000)      [RuleRate(scenario, evidence, n, flagged), ...]

A simulated run has a true held-out accuracy p(u) after u optimizer steps: a rise from START to an
end drawn in END_RANGE, plus a slow wobble (an AR(1) process on the logit scale with correlation
time WOBBLE_UPDATES and standard deviation ``wobble``), over UPDATES updates. The scenarios:

    stable      no collapse (wobble 0.3: calm; 0.6: large swings, about +-0.12 in accuracy at 0.7)
    dip         stable, but once the accuracy falls to a third for 16-128 updates and recovers
                before the end (the rule should not call this collapsed)
    collapse    at an update drawn uniformly in the middle of the run the accuracy falls to a
                third of what it was and stays there

What the rule sees is drawn from p: held-out evaluations every EVERY updates on EVAL_PROBLEMS
problems (binomial), the evaluation before training on 1024, or, for the fallback evidence,
training rows of a run at N (N x 8 prompts x 8 responses, each prompt's success rate drawn
around p) averaged over windows of EVERY updates. A "flagged" share over stable runs is the rule's
false-positive rate; over collapsing runs, its power.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from vespo.lab.collapse import RULE, CollapseRule, detect_collapse

UPDATES = 512
EVERY = RULE.every
EVAL_PROBLEMS = 256
BEFORE_PROBLEMS = 1024
START = 0.3
END_RANGE = (0.6, 0.85)
WOBBLE_UPDATES = 32
PROMPTS, RESPONSES = 8, 8  # the lab's mini-batch
PROMPT_SPREAD = 2.0  # a prompt's success rate ~ Beta(2p, 2(1 - p))
SCENARIOS = {"stable, calm (wobble 0.3)": (0.3, "none"), "stable, large swings (wobble 0.6)": (0.6, "none"),
             "a dip to a third that recovers": (0.3, "dip"), "collapse to a third": (0.3, "collapse")}
COLLAPSING = ("collapse",)  # scenarios where flagging is right
SIM_SEED = 0


@dataclass(frozen=True)
class RuleRate:
    scenario: str
    evidence: str  # "held-out" or "train, N = n"
    n: int  # staleness N of the simulated run (held-out evidence does not depend on it)
    flagged: float  # share of runs the rule called collapsed
    runs: int


def true_accuracy(rng: np.random.Generator, runs: int, wobble: float, fall: str = "none",
                  updates: int = UPDATES) -> np.ndarray:
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
    p = _sigmoid(logit + w)
    if fall == "collapse":
        at = rng.integers(updates // 4, 3 * updates // 4, size=runs)  # [runs]
        down = u[None, :] >= at[:, None]  # [runs, U + 1]
        p = np.where(down, p[np.arange(runs), at][:, None] / 3, p)
    elif fall == "dip":
        length = rng.integers(16, 129, size=runs)  # [runs]
        at = (rng.uniform(size=runs) * (updates - length)).astype(int)  # recovers at at + length <= updates - 1
        down = (u[None, :] >= at[:, None]) & (u[None, :] < (at + length)[:, None])
        p = np.where(down, p / 3, p)
    return p


def held_out_points(rng: np.random.Generator, p: np.ndarray, every: int = EVERY) -> tuple[np.ndarray, np.ndarray]:
    """(before [runs], points [runs, updates / every]): sampled held-out accuracy."""
    before = rng.binomial(BEFORE_PROBLEMS, p[:, 0]) / BEFORE_PROBLEMS
    at = p[:, every::every]
    return before, rng.binomial(EVAL_PROBLEMS, at) / EVAL_PROBLEMS


def training_windows(rng: np.random.Generator, p: np.ndarray, n: int, every: int = EVERY) -> np.ndarray:
    """Mean training reward per window of ``every`` updates of a run at N = n: [runs, updates / every].
    Row k's samples come from the policy after (k - 1) x n updates, N x PROMPTS prompts of RESPONSES."""
    updates = p.shape[1] - 1
    rows = p[:, 0:updates:n]  # [runs, updates / n]
    q = rng.beta(PROMPT_SPREAD * rows[..., None], PROMPT_SPREAD * (1 - rows[..., None]),
                 size=rows.shape + (n * PROMPTS,))  # [runs, rows, prompts]
    reward = rng.binomial(RESPONSES, q).mean(axis=-1) / RESPONSES  # [runs, rows]
    per_window = max(1, every // n)
    return reward.reshape(reward.shape[0], -1, per_window).mean(axis=-1)


@lru_cache(maxsize=8)  # a pure function of its arguments: a page and its tests ask again
def collapse_rates(runs: int = 1000, ns: tuple[int, ...] = (1, 8, 64), rule: CollapseRule = RULE,
                   seed: int = SIM_SEED) -> tuple[RuleRate, ...]:
    """The share of simulated runs the rule flags, per scenario, on held-out and on training evidence."""
    rng = np.random.default_rng(seed)
    out = []
    for scenario, (wobble, fall) in SCENARIOS.items():
        p = true_accuracy(rng, runs, wobble, fall)
        before, points = held_out_points(rng, p)
        flagged = [detect_collapse(list(points[i]), rule=rule, start=float(before[i])).collapsed for i in range(runs)]
        out.append(RuleRate(scenario, "held-out", 0, float(np.mean(flagged)), runs))
        for n in ns:
            windows = training_windows(rng, p, n)
            flagged = [detect_collapse(list(windows[i]), rule=rule).collapsed for i in range(runs)]
            out.append(RuleRate(scenario, f"train, N = {n}", n, float(np.mean(flagged)), runs))
    return tuple(out)


def _logit(p):
    return np.log(p / (1 - p))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))
