"""Statistics over seeds (docs/lab.md, Statistics): the t-interval and t-test of a mean and of paired
differences, Holm's correction, exact tests and intervals for counts, the seeds a paired t-test needs for a
given power, and the interval's coverage measured by simulation. A verdict is the t-test at the interval's
level (p < 1 - CONFIDENCE <=> the interval excludes the line); a lab cell has 3-10 seeds, where the
t-interval is exact for normal data and bootstraps are not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import stats as sps
from scipy.optimize import brentq
from statsmodels.stats.multitest import multipletests

CONFIDENCE = 0.9  # the intervals shown
LEVEL = f"{CONFIDENCE:.0%}"
FAMILY_ERROR = 1 - CONFIDENCE  # Holm: family-wise error of the verdicts
METHOD = "Student t-interval of the mean over seeds"
MIN_SEEDS = 2  # the fewest values a t-interval can be formed from


class Interval(NamedTuple):
    mean: float
    low: float  # nan below MIN_SEEDS values
    high: float
    n: int

    @property
    def resolved(self) -> bool:
        return self.n >= MIN_SEEDS and math.isfinite(self.low) and math.isfinite(self.high)


@dataclass(frozen=True)
class Paired:
    values: pd.Series  # a - b on each seed both have (index: seed)
    diff = property(lambda self: mean_ci(self.values))  # its mean with the interval
    wins = property(lambda self: int((self.values > 0).sum()))  # seeds where a is higher


def ci_text(ci: Interval | None, signed: bool = False, digits: int = 3) -> str:
    """The one interval formatter: "0.512 [0.470, 0.551]"; signed "+0.031 [-0.010, +0.070]"; "–" for none."""
    if ci is None or ci.n == 0 or not math.isfinite(ci.mean):
        return "–"
    f = ("{:+." if signed else "{:.") + f"{digits}f}}"
    return f.format(ci.mean) + (f" [{f.format(ci.low)}, {f.format(ci.high)}]" if ci.resolved else "")


def t_interval(x: np.ndarray, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) over the last axis of x [..., n], n >= 2: mean +- t(n-1) x sd / sqrt(n)."""
    n = x.shape[-1]
    mean = x.mean(axis=-1)  # [...]
    half = sps.t.ppf(0.5 + confidence / 2, n - 1) * x.std(axis=-1, ddof=1) / math.sqrt(n)  # [...]
    return mean, mean - half, mean + half


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)  # [n]
    if x.size < MIN_SEEDS:
        return Interval(float(x.mean()) if x.size else math.nan, math.nan, math.nan, int(x.size))
    return Interval(*map(float, t_interval(x, confidence)), int(x.size))


def paired(a: pd.Series, b: pd.Series) -> Paired:  # a - b on the seeds where both are finite
    d = a - b
    return Paired(d[np.isfinite(d)])


def p_value(values: Sequence[float], line: float) -> float:
    """Two-sided one-sample t-test of the mean against ``line`` (1 when nothing can be said; a zero-
    width interval off the line gives 0)."""
    x = np.asarray(values, dtype=np.float64)  # [n]
    if x.size < MIN_SEEDS:
        return 1.0
    if np.ptp(x) <= 1e-12:  # the same value on every seed (up to float rounding): a zero-width interval
        return 0.0 if abs(x.mean() - line) > 1e-12 else 1.0
    return float(sps.ttest_1samp(x, line).pvalue)


def holm(p: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control under any dependence)."""
    return multipletests(p, method="holm")[1].tolist() if len(p) else []


def rate_ci(k: int, n: int, confidence: float = CONFIDENCE) -> Interval:  # k / n, its exact (Clopper-Pearson) interval
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    ci = sps.binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
    return Interval(k / n, float(ci.low), float(ci.high), n)


def exact_paired_p(only_a: int, only_b: int) -> float:  # McNemar's exact test on the discordant pairs
    return 1.0 if only_a + only_b == 0 else float(sps.binomtest(only_a, only_a + only_b).pvalue)


# ---------------------------------------------------------------- sizing: seeds for a given power


def t_power(n: int | np.ndarray, effect: float, alpha: float) -> np.ndarray:
    """Power of the two-sided paired t-test at ``alpha`` with n pairs (n >= 2) when the mean difference is
    ``effect`` paired SDs: P(|T| > t_{1-alpha/2, n-1}), T noncentral t with n - 1 degrees of freedom and
    noncentrality effect x sqrt(n)."""
    n = np.asarray(n, dtype=np.float64)
    crit, nc = sps.t.ppf(1 - alpha / 2, n - 1), effect * np.sqrt(n)
    # P(T < -crit) as P(T > crit) at -nc: scipy 1.17's nct.cdf(-crit) is nan far in that tail (df 1, nc 28)
    return sps.nct.sf(crit, n - 1, nc) + sps.nct.sf(crit, n - 1, -nc)


class SeedsNeeded(NamedTuple):
    normal: int  # ceil(((z_{1-alpha/2} + z_power) x sd / delta)^2), at least MIN_SEEDS
    exact: int  # the smallest n >= MIN_SEEDS whose t_power reaches ``power``


def seeds_needed(sd: float, delta: float, power: float = 0.8, alpha: float = 0.05) -> SeedsNeeded:
    """Seeds (pairs) for a two-sided paired t-test at ``alpha`` to detect a mean difference of ``delta`` with
    ``power``, the differences having SD ``sd``: by the normal approximation and exactly (noncentral t)."""
    if not (math.isfinite(sd) and sd >= 0 and delta > 0 and 0 < power < 1 and 0 < alpha < 1):
        raise ValueError(f"seeds_needed: sd {sd}, delta {delta}, power {power}, alpha {alpha}")
    if sd == 0:  # no spread: any difference resolves on the fewest seeds a paired SD comes from
        return SeedsNeeded(MIN_SEEDS, MIN_SEEDS)
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)
    normal = max(MIN_SEEDS, math.ceil((z * sd / delta) ** 2))
    hi = 2 * normal + 16  # the t-test needs a few more than the normal approximation; widened until reached
    while not (reached := np.flatnonzero(t_power(np.arange(MIN_SEEDS, hi + 1), delta / sd, alpha) >= power)).size:
        hi *= 2
    return SeedsNeeded(normal, MIN_SEEDS + int(reached[0]))


def detectable(n: int, sd: float, power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest mean difference a two-sided paired t-test at ``alpha`` on n pairs (n >= 2) whose differences
    have SD ``sd`` detects with ``power``: what n seeds can resolve (seeds_needed read the other way)."""
    if not (n >= MIN_SEEDS and math.isfinite(sd) and sd >= 0 and 0 < power < 1 and 0 < alpha < 1):
        raise ValueError(f"detectable: n {n}, sd {sd}, power {power}, alpha {alpha}")
    if sd == 0:
        return 0.0
    hi = 1.0  # in paired SDs; t_power rises with the effect, from alpha at 0
    while t_power(n, hi, alpha) < power:
        hi *= 2
    return sd * float(brentq(lambda e: t_power(n, e, alpha) - power, 0.0, hi, xtol=1e-12))


# ---------------------------------------------------------------- measured coverage


Draw = Callable[[np.random.Generator, tuple[int, int]], np.ndarray]
COLLAPSE_SHARE, COLLAPSE_DROP = 0.2, 15.0  # the mixture case: this share of runs falls this many SDs

COVERAGE_CASES: dict[str, tuple[Draw, float]] = {  # name -> (draw, true mean)
    "normal": (lambda rng, shape: rng.standard_normal(shape), 0.0),
    "skewed (gamma, skewness 1)": (lambda rng, shape: rng.gamma(4.0, size=shape), 4.0),
    "strongly skewed (exponential, skewness 2)": (lambda rng, shape: rng.exponential(size=shape), 1.0),
    f"some runs collapse ({COLLAPSE_SHARE:.0%} of them fall {COLLAPSE_DROP:g} SDs)": (
        lambda rng, shape: rng.standard_normal(shape) - COLLAPSE_DROP * (rng.uniform(size=shape) < COLLAPSE_SHARE),
        -COLLAPSE_SHARE * COLLAPSE_DROP),
}
COVERAGE_SEEDS = (3, 5, 10)
COVERAGE_REPS = 20000  # Monte-Carlo error ~0.2%


class Coverage(NamedTuple):
    case: str
    seeds: int
    covered: float  # share of simulated intervals that hold the true mean
    above: float  # share wholly above it (a false "greater")
    below: float


def coverage(case: str, seeds: int, reps: int = COVERAGE_REPS, seed: int = 0) -> Coverage:
    """How often mean_ci's interval (the same t_interval) holds the true mean of COVERAGE_CASES[case]."""
    draw, truth = COVERAGE_CASES[case]
    _, low, high = t_interval(draw(np.random.default_rng(seed), (reps, seeds)))  # [reps] each
    above, below = float(np.mean(low > truth)), float(np.mean(high < truth))
    return Coverage(case, seeds, 1.0 - above - below, above, below)


@lru_cache(maxsize=8)
def coverage_table(seeds: tuple[int, ...] = COVERAGE_SEEDS, reps: int = COVERAGE_REPS) -> tuple[Coverage, ...]:
    return tuple(coverage(case, n, reps) for case in COVERAGE_CASES for n in seeds)
