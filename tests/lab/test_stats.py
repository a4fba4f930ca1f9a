"""The bootstrap interval of a mean over seeds and the paired difference, checked against the exact
bootstrap distribution (every one of the n^n resamples enumerated) and a direct numpy bootstrap."""

import itertools
import math

import numpy as np
import pytest

from vespo.lab.stats import mean_ci, paired_difference


def exact_percentile_ci(x, confidence=0.9):
    """The percentile interval of the exact bootstrap distribution of the mean: all n^n resamples."""
    x = np.asarray(x, dtype=np.float64)
    means = np.array([x[list(idx)].mean() for idx in itertools.product(range(len(x)), repeat=len(x))])
    alpha = (1 - confidence) / 2
    return np.quantile(means, alpha), np.quantile(means, 1 - alpha)


def numpy_bootstrap_ci(x, confidence=0.9, resamples=40000, seed=1):
    x = np.asarray(x, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)  # [resamples]
    alpha = (1 - confidence) / 2
    return np.quantile(means, alpha), np.quantile(means, 1 - alpha)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interval_matches_the_exact_bootstrap_and_a_numpy_bootstrap(seed):
    x = np.random.default_rng(seed).uniform(0.2, 0.7, size=5)  # five seeds' final rewards
    ci = mean_ci(x)
    lo, hi = exact_percentile_ci(x)  # 3125 resamples, enumerated
    # the mean's bootstrap sd is ~0.06 here; 9999 resamples put the 5% / 95% quantiles within ~0.002
    assert ci.mean == pytest.approx(x.mean(), abs=1e-15)
    assert ci.low == pytest.approx(lo, abs=0.006) and ci.high == pytest.approx(hi, abs=0.006)
    nlo, nhi = numpy_bootstrap_ci(x)
    assert ci.low == pytest.approx(nlo, abs=0.006) and ci.high == pytest.approx(nhi, abs=0.006)
    assert ci.n == 5 and ci.resolved


def test_two_values_by_hand():
    # resamples of (0, 1): (0,0) mean 0, (0,1) and (1,0) mean 0.5, (1,1) mean 1, each with prob 1/4, 1/2, 1/4.
    # The 5% quantile of that distribution is 0 (P(mean = 0) = 0.25 > 0.05), the 95% quantile is 1.
    ci = mean_ci([0.0, 1.0])
    assert (ci.mean, ci.low, ci.high, ci.n) == (0.5, 0.0, 1.0, 2)


def test_one_value_has_no_interval_and_equal_values_a_zero_width_one():
    one = mean_ci([0.4])
    assert one.mean == 0.4 and math.isnan(one.low) and math.isnan(one.high) and not one.resolved
    same = mean_ci([0.3, 0.3, 0.3])
    assert (same.low, same.high) == (0.3, 0.3) and same.resolved
    empty = mean_ci([])
    assert empty.n == 0 and math.isnan(empty.mean)


def test_non_finite_values_are_dropped():
    ci = mean_ci([0.2, math.nan, 0.4, None])
    assert ci.n == 2 and ci.mean == pytest.approx(0.3)


def test_the_interval_is_reproducible():
    x = [0.31, 0.52, 0.47, 0.18, 0.44]
    assert mean_ci(x) == mean_ci(x)


def test_paired_difference_pairs_by_seed_and_counts_wins():
    a = {"0": 0.50, "1": 0.40, "2": 0.62, "3": 0.30}
    b = {"0": 0.45, "1": 0.41, "2": 0.52, "4": 0.90}  # seed 3 and 4 have no partner
    p = paired_difference(a, b)
    d = [a[s] - b[s] for s in ("0", "1", "2")]  # 0.05, -0.01, 0.10
    assert p.seeds == ("0", "1", "2") and (p.wins, p.losses) == (2, 1)
    assert p.diff == mean_ci(d)
    assert p.diff.mean == pytest.approx(np.mean(d))


def test_pairing_cancels_the_seed_effect():
    # seed effects of +-0.2 dominate; a is b + 0.05 (+- 0.01) on every seed
    rng = np.random.default_rng(0)
    base = rng.uniform(0.2, 0.6, size=5)
    a = {str(i): base[i] + 0.05 + rng.uniform(-0.01, 0.01) for i in range(5)}
    b = {str(i): base[i] for i in range(5)}
    ca, cb = mean_ci(list(a.values())), mean_ci(list(b.values()))
    assert ca.low < cb.high  # unpaired, the two intervals overlap
    p = paired_difference(a, b)
    assert p.diff.low > 0.03 and p.diff.high < 0.07 and p.wins == 5
