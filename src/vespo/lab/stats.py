"""Statistics over seeds: a Student t-interval for a mean and for paired differences, its coverage
measured by simulation, and an exact interval for a collapse rate.

    mean_ci([0.41, 0.52, 0.47, 0.50, 0.39])                  Interval(mean=0.458, low=.., high=.., n=5)
    paired_difference({"0": .50, "1": .40}, {"0": .45, "1": .41})    mean of (a - b) seed by seed
    rate_ci(3, 10)                                            collapse rate 0.3 with its exact interval
    coverage_table()                                          simulated coverage of mean_ci at 3, 5, 10 seeds

Why a t-interval: a lab cell has 3-10 seeds. At such n the percentile bootstrap is far too narrow
(a nominal 90% interval covers about 62% of the time at 3 seeds and 79% at 5 on normal data), BCa
and the studentised bootstrap need more values than that to be stable, and an exact sign-flip test
cannot reach a two-sided 10% level below 5 seeds (its smallest p at 3 seeds is 2/8). The
t-interval mean +- t(n-1) x sd / sqrt(n) is exact for normal data at every n >= 2; on skewed data it
covers less, and `coverage_table` measures how much (the results page prints that table, computed
by this code, not copied).

One value gives no interval (low = high = nan): fewer than MIN_SEEDS seeds cannot decide a claim
at any effect size. Identical values give a zero-width interval.

A paired difference compares two conditions run with the same seeds. In the lab, one seed means
the same initial and warm-started weights and the same prompt order in every condition, so the
seed-to-seed spread (the dominant noise) cancels in a - b.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

CONFIDENCE = 0.9
METHOD = "Student t-interval of the mean over seeds"
MIN_SEEDS = 2  # the fewest values a t-interval can be formed from
COVERAGE_SEEDS = (3, 5, 10)  # the seed counts the lab uses
COVERAGE_REPS = 20000  # simulated experiments per (distribution, seeds): Monte-Carlo error ~0.2%
COVERAGE_SEED = 0


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # nan when it cannot be estimated (fewer than MIN_SEEDS values)
    high: float
    n: int  # values it rests on

    @property
    def resolved(self) -> bool:
        return self.n >= MIN_SEEDS and math.isfinite(self.low) and math.isfinite(self.high)


@dataclass(frozen=True)
class Paired:
    diff: Interval  # the mean over seeds of a - b, with its interval
    wins: int  # seeds where a > b
    losses: int  # seeds where a < b
    seeds: tuple[str, ...]  # the seeds both sides have
    values: tuple[float, ...] = ()  # a - b on each of them


# ---------------------------------------------------------------- the interval


def t_interval(x: np.ndarray, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) over the last axis of x [..., n], n >= 2: mean +- t(n-1) x sd / sqrt(n)."""
    from scipy.stats import t

    n = x.shape[-1]
    mean = x.mean(axis=-1)  # [...]
    half = t.ppf(0.5 + confidence / 2, n - 1) * x.std(axis=-1, ddof=1) / math.sqrt(n)  # [...]
    return mean, mean - half, mean + half


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean of the finite values with its t-interval."""
    x = np.asarray([v for v in values if _finite(v)], dtype=np.float64)  # [n]
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    if x.size < MIN_SEEDS:
        return Interval(float(x.mean()), math.nan, math.nan, int(x.size))
    mean, low, high = t_interval(x, confidence)
    return Interval(float(mean), float(low), float(high), int(x.size))


def paired_difference(a: Mapping[str, float], b: Mapping[str, float], confidence: float = CONFIDENCE) -> Paired:
    """a - b seed by seed over the seeds where both are finite; the mean difference with its interval."""
    seeds = tuple(s for s in a if s in b and _finite(a[s]) and _finite(b[s]))
    d = [a[s] - b[s] for s in seeds]
    return Paired(mean_ci(d, confidence), sum(x > 0 for x in d), sum(x < 0 for x in d), seeds, tuple(d))


def rate_ci(k: int, n: int, confidence: float = CONFIDENCE) -> Interval:
    """A rate k / n (e.g. runs collapsed) with its Clopper-Pearson interval (exact: covers at least
    ``confidence``); n = 0 gives nan."""
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
    return Interval(k / n, float(ci.low), float(ci.high), n)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


# ---------------------------------------------------------------- measured coverage


Draw = Callable[[np.random.Generator, tuple[int, int]], np.ndarray]

# name -> (draw, true mean): the shapes a paired difference over seeds can take
COVERAGE_CASES: dict[str, tuple[Draw, float]] = {
    "normal": (lambda rng, shape: rng.standard_normal(shape), 0.0),
    "skewed (gamma, skewness 1)": (lambda rng, shape: rng.gamma(4.0, size=shape), 4.0),
    "strongly skewed (exponential, skewness 2)": (lambda rng, shape: rng.exponential(size=shape), 1.0),
}


@dataclass(frozen=True)
class Coverage:
    case: str
    seeds: int
    covered: float  # share of simulated intervals that hold the true mean
    above: float  # share that lie wholly above it (a false "greater")
    below: float  # share that lie wholly below it (a false "less")


def coverage(case: str, seeds: int, reps: int = COVERAGE_REPS, seed: int = COVERAGE_SEED,
             confidence: float = CONFIDENCE) -> Coverage:
    """Simulate ``reps`` experiments of ``seeds`` values from COVERAGE_CASES[case] and count how
    often mean_ci's interval (the same t_interval) holds the true mean."""
    draw, truth = COVERAGE_CASES[case]
    x = draw(np.random.default_rng(seed), (reps, seeds))  # [reps, seeds]
    _, low, high = t_interval(x, confidence)  # [reps] each
    above, below = float(np.mean(low > truth)), float(np.mean(high < truth))
    return Coverage(case, seeds, 1.0 - above - below, above, below)


@lru_cache(maxsize=8)  # a pure function of its arguments: a page and its tests ask again
def coverage_table(seeds: tuple[int, ...] = COVERAGE_SEEDS, reps: int = COVERAGE_REPS) -> tuple[Coverage, ...]:
    """Coverage of every case at every seed count, in COVERAGE_CASES order."""
    return tuple(coverage(case, n, reps) for case in COVERAGE_CASES for n in seeds)
