"""Statistics over seeds: the mean with a bootstrap confidence interval, and paired differences.

    mean_ci([0.41, 0.52, 0.47, 0.50, 0.39])                  Interval(mean=0.458, low=.., high=.., n=5)
    paired_difference({"0": .50, "1": .40}, {"0": .45, "1": .41})    mean of (a - b) seed by seed

The interval is scipy's percentile bootstrap of the mean (90% by default) with a fixed resampling
seed, so a report is reproducible. With the 3-5 seeds a lab cell has, any interval is rough: the
percentile bootstrap covers less than its nominal level at such n, which is why the lab reports the
collapse counts and the per-seed wins beside it. One value gives no interval (low = high = nan);
identical values give a zero-width one.

A paired difference compares two conditions run with the same seeds. In the lab, one seed means
the same initial and warm-started weights and the same prompt order in every condition, so the
seed-to-seed spread (the dominant noise) cancels in a - b.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.9
RESAMPLES = 9999
RESAMPLE_SEED = 0


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # nan when it cannot be estimated (fewer than 2 values)
    high: float
    n: int  # values it rests on

    @property
    def resolved(self) -> bool:
        return self.n >= 2 and math.isfinite(self.low) and math.isfinite(self.high)


@dataclass(frozen=True)
class Paired:
    diff: Interval  # the mean over seeds of a - b, with its interval
    wins: int  # seeds where a > b
    losses: int  # seeds where a < b
    seeds: tuple[str, ...]  # the seeds both sides have


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
            seed: int = RESAMPLE_SEED) -> Interval:
    """Mean of the finite values with a percentile-bootstrap interval (scipy.stats.bootstrap)."""
    from scipy.stats import bootstrap

    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)  # [n]
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = float(x.mean())
    if x.size == 1:
        return Interval(mean, math.nan, math.nan, 1)
    if np.all(x == x[0]):  # every resample has the same mean
        return Interval(mean, mean, mean, int(x.size))
    res = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=resamples, method="percentile",
                    vectorized=True, rng=np.random.default_rng(seed))
    return Interval(mean, float(res.confidence_interval.low), float(res.confidence_interval.high), int(x.size))


def paired_difference(a: Mapping[str, float], b: Mapping[str, float], confidence: float = CONFIDENCE,
                      resamples: int = RESAMPLES, seed: int = RESAMPLE_SEED) -> Paired:
    """a - b seed by seed over the seeds where both are finite; the mean difference with its interval."""
    seeds = tuple(s for s in a if s in b and _finite(a[s]) and _finite(b[s]))
    d = [a[s] - b[s] for s in seeds]
    return Paired(mean_ci(d, confidence, resamples, seed), sum(x > 0 for x in d), sum(x < 0 for x in d), seeds)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
