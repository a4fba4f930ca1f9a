"""The t-interval and t-test over seeds worked by hand and against scipy, Holm against statsmodels,
the interval's simulated coverage at the lab's seed counts (normal, skewed, and runs that collapse),
the paired difference, and the exact interval and test for counts."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from vespo.lab import stats
from vespo.lab.stats import ci_text, exact_paired_p, holm, mean_ci, p_value, paired, rate_ci

from power_reference import detectable_reference, power_reference, seeds_reference


def test_three_values_by_hand():
    # x = 0.1, 0.3, 0.5: mean 0.3; sd = sqrt(((-0.2)^2 + 0 + 0.2^2) / 2) = 0.2; se = 0.2 / sqrt(3) = 0.115470;
    # t(0.95, 2 df) = 2.919986; half-width = 2.919986 x 0.115470 = 0.337171
    ci = mean_ci([0.1, 0.3, 0.5])
    assert ci.mean == pytest.approx(0.3, abs=1e-15) and ci.n == 3 and ci.resolved
    assert ci.low == pytest.approx(0.3 - 0.337171, abs=1e-6) and ci.high == pytest.approx(0.3 + 0.337171, abs=1e-6)
    # t = 0.3 / 0.115470 = 2.598; two-sided p with 2 df = 2 x (1 - F(2.598)) = 0.1217
    assert p_value([0.1, 0.3, 0.5], 0.0) == pytest.approx(0.1217, abs=1e-4)
    assert ci_text(ci) == "0.300 [-0.037, 0.637]" and ci_text(ci, signed=True) == "+0.300 [-0.037, +0.637]"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [2, 5, 10])
def test_interval_and_test_match_scipy(seed, n):
    x = np.random.default_rng(seed).uniform(0.2, 0.7, size=n)
    lo, hi = sps.t.interval(0.9, n - 1, loc=x.mean(), scale=sps.sem(x))
    ci = mean_ci(x)
    assert (ci.low, ci.high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert p_value(x, 0.4) == pytest.approx(sps.ttest_1samp(x, 0.4).pvalue, abs=1e-12)
    # the test and the interval agree: the 90% interval excludes a line <=> p < 0.10
    for line in (lo - 1e-9, hi + 1e-9, (lo + hi) / 2):
        assert (p_value(x, line) < 0.1) == (not lo <= line <= hi)


def test_one_value_has_no_interval_and_equal_values_a_zero_width_one():
    one = mean_ci([0.4])
    assert one.mean == 0.4 and math.isnan(one.low) and not one.resolved and ci_text(one) == "0.400"
    same = mean_ci([0.3, 0.3, 0.3])
    assert (same.low, same.high) == (pytest.approx(0.3), pytest.approx(0.3)) and same.resolved
    assert p_value([0.3, 0.3, 0.3], 0.3) == 1.0 and p_value([0.3, 0.3, 0.3], 0.0) == 0.0 and p_value([0.3], 0) == 1.0
    assert mean_ci([]).n == 0 and ci_text(mean_ci([])) == "–"


def test_non_finite_values_are_dropped():
    ci = mean_ci([0.2, math.nan, 0.4, None])
    assert ci.n == 2 and ci.mean == pytest.approx(0.3)


def test_holm_matches_statsmodels():
    multipletests = pytest.importorskip("statsmodels.stats.multitest").multipletests
    for seed in range(5):
        p = np.random.default_rng(seed).uniform(0, 0.2, size=12) ** 2
        assert holm(p) == pytest.approx(multipletests(p, method="holm")[1].tolist(), abs=1e-15)
    # by hand: p = 0.01, 0.04, 0.03 -> sorted 0.01 x 3, 0.03 x 2, 0.04 x 1 = 0.03, 0.06, 0.06 (monotone)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_exact_paired_test_is_mcnemars():
    # 0 of 4 discordant pairs on one side: p = 2 x 0.5^4 = 0.125; none discordant: nothing to say
    assert exact_paired_p(0, 4) == pytest.approx(0.125) and exact_paired_p(0, 0) == 1.0
    assert exact_paired_p(1, 9) == pytest.approx(sps.binomtest(1, 10).pvalue)


@pytest.mark.parametrize("case", ["normal", "skewed (gamma, skewness 1)"])
@pytest.mark.parametrize("n", stats.COVERAGE_SEEDS)
def test_the_90_percent_interval_covers_87_to_93_percent(case, n):
    c = stats.coverage(case, n, reps=50000, seed=7)
    assert 0.87 <= c.covered <= 0.93, c
    assert abs(c.covered - (1 - c.above - c.below)) < 1e-12


@pytest.mark.parametrize("n", stats.COVERAGE_SEEDS)
def test_a_false_one_sided_verdict_is_5_percent_on_symmetric_data(n):
    c = stats.coverage("normal", n, reps=50000, seed=8)
    assert 0.045 <= c.above <= 0.055 and 0.045 <= c.below <= 0.055


def test_the_coverage_table_says_what_skewed_and_collapsing_data_get():
    """Strongly skewed data are covered less; where a fifth of the runs collapse, 3 seeds cover about half the
    time and most misses lie wholly above the truth (no collapse in the sample): the table says so."""
    table = stats.coverage_table(seeds=(3, 10), reps=20000)
    assert [(c.case, c.seeds) for c in table] == [(case, n) for case in stats.COVERAGE_CASES for n in (3, 10)]
    strong = {c.seeds: c for c in table if c.case.startswith("strongly")}
    assert 0.80 < strong[3].covered < 0.84 and 0.84 < strong[10].covered < 0.87 and strong[3].above < 0.03
    mixture = {c.seeds: c for c in table if c.case.startswith("some runs collapse")}
    # P(no collapse among 3) = 0.8^3 = 0.512: the interval then sits near 0, far above the true mean -3
    assert 0.45 < mixture[3].covered < 0.6 and 0.4 < mixture[3].above < 0.52 and mixture[10].covered > 0.8
    assert table == stats.coverage_table(seeds=(3, 10), reps=20000)  # reproducible


def test_the_percentile_bootstrap_the_lab_used_before_was_too_narrow():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4000, 3))  # [experiments, seeds]
    boot = x[:, rng.integers(0, 3, size=(1000, 3))].mean(axis=-1)  # [experiments, resamples]
    low, high = np.quantile(boot, 0.05, axis=1), np.quantile(boot, 0.95, axis=1)
    assert 0.55 < np.mean((low <= 0) & (0 <= high)) < 0.68
    assert stats.coverage("normal", 3, reps=4000, seed=3).covered > 0.88


def test_paired_difference_pairs_by_seed_and_counts_wins():
    a = pd.Series({"0": 0.50, "1": 0.40, "2": 0.62, "3": 0.30})
    b = pd.Series({"0": 0.45, "1": 0.41, "2": 0.52, "4": 0.90})  # seeds 3 and 4 have no partner
    p = paired(a, b)
    d = [0.05, -0.01, 0.10]
    assert list(p.values.index) == ["0", "1", "2"] and p.wins == 2
    assert p.diff.mean == pytest.approx(np.mean(d)) and p.diff.n == 3


def test_pairing_cancels_the_seed_effect():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.2, 0.6, size=5)
    a = pd.Series({str(i): base[i] + 0.05 + rng.uniform(-0.01, 0.01) for i in range(5)})
    b = pd.Series({str(i): base[i] for i in range(5)})
    assert mean_ci(a).low < mean_ci(b).high  # unpaired, the two intervals overlap
    p = paired(a, b)
    assert p.diff.low > 0.03 and p.diff.high < 0.07 and p.wins == 5


def test_rate_interval_is_clopper_pearson():
    # 0 of 5: the upper end solves (1 - p)^5 = 0.05, p = 1 - 0.05^(1/5) = 0.450720
    r = rate_ci(0, 5)
    assert (r.mean, r.low, r.n) == (0.0, 0.0, 5) and r.high == pytest.approx(1 - 0.05 ** 0.2, abs=1e-9)
    r = rate_ci(3, 10)
    assert r.low == pytest.approx(sps.beta.ppf(0.05, 3, 8)) and r.high == pytest.approx(sps.beta.ppf(0.95, 4, 7))
    assert math.isnan(rate_ci(0, 0).mean)


# ---------------------------------------------------------------- seeds for a given power


# z_0.975 + z_0.8 = 1.959964 + 0.841621 = 2.801585; n = (2.801585 x SD / 0.05)^2 = 5.023 (SD 0.04), 11.302 (0.06),
# 20.093 (0.08), 31.396 (0.10), rounded up; the exact t-test needs 2 more at each
BY_HAND = {0.04: (6, 8), 0.06: (12, 14), 0.08: (21, 23), 0.10: (32, 34)}


@pytest.mark.parametrize("sd", sorted(BY_HAND))
def test_seeds_for_power_08_to_detect_005_by_hand_and_against_a_float64_reference(sd):
    need = stats.seeds_needed(sd, 0.05)
    assert (need.normal, need.exact) == BY_HAND[sd] == seeds_reference(sd, 0.05, 0.8, 0.05)
    # the exact count is the first whose power reaches 0.8, the power that of the reference
    below, at = (power_reference(n, 0.05 / sd, 0.05) for n in (need.exact - 1, need.exact))
    assert below < 0.8 <= at
    assert stats.t_power([need.exact - 1, need.exact], 0.05 / sd, 0.05) == pytest.approx([below, at], abs=1e-9)


@pytest.mark.parametrize("sd, delta, power, alpha", [(0.02, 0.05, 0.8, 0.05), (0.15, 0.05, 0.9, 0.01),
                                                      (0.3, 0.1, 0.5, 0.1), (1.0, 0.05, 0.8, 0.05)])
def test_seeds_at_other_settings_match_the_reference(sd, delta, power, alpha):
    assert tuple(stats.seeds_needed(sd, delta, power, alpha)) == seeds_reference(sd, delta, power, alpha)


@pytest.mark.parametrize("n, sd, power, alpha", [(4, 0.14, 0.8, 0.05), (8, 0.065, 0.8, 0.05), (3, 0.04, 0.8, 0.05),
                                                  (2, 0.1, 0.8, 0.05), (20, 0.3, 0.9, 0.01), (64, 0.14, 0.8, 0.05)])
def test_detectable_difference_against_the_reference(n, sd, power, alpha):
    """What n seeds resolve is seeds_needed read the other way: at that difference the power is ``power``."""
    d = stats.detectable(n, sd, power, alpha)
    assert d == pytest.approx(detectable_reference(n, sd, power, alpha), rel=1e-6)
    assert stats.t_power(n, d / sd, alpha) == pytest.approx(power, abs=1e-9)
    # and seeds_needed at that difference asks for n seeds (a hair above it, since the exact count rounds up)
    assert stats.seeds_needed(sd, d * (1 + 1e-9), power, alpha).exact == n


def test_detectable_by_hand():
    # many seeds: the normal approximation's (z_0.975 + z_0.8) x SD / sqrt(n) = 2.801585 x 0.1 / 20 = 0.014008
    assert stats.detectable(400, 0.1) == pytest.approx(0.014008, rel=0.005)
    assert stats.detectable(400, 0.1) > 2.801585 * 0.1 / 20  # the t-test needs a little more than the normal
    # 2 seeds: one degree of freedom (critical value 12.706 against the normal's 1.960): the t-test needs over
    # five times the normal approximation's 2.801585 / sqrt(2) SDs
    assert stats.detectable(2, 1.0) > 5 * 2.801585 / math.sqrt(2)
    assert stats.detectable(5, 0.0) == 0.0
    for bad in [(1, 0.1), (4, math.nan), (4, -0.1), (4, 0.1, 1.0), (4, 0.1, 0.8, 0.0)]:
        with pytest.raises(ValueError, match="detectable"):
            stats.detectable(*bad)


def test_seeds_needed_at_the_edges():
    assert stats.seeds_needed(0.0, 0.05) == (2, 2)  # no spread: the fewest seeds a paired SD comes from
    # the normal approximation says 1, a t-test needs 2; at 2 seeds the power to detect 50 SDs is the reference's
    # (scipy's nct.cdf is nan far in the lower tail there: the power takes both tails from nct.sf)
    assert stats.seeds_needed(0.001, 0.05) == (2, 2) == seeds_reference(0.001, 0.05, 0.8, 0.05)
    assert stats.t_power(2, 20.0, 0.05) == pytest.approx(power_reference(2, 20.0, 0.05), abs=1e-9)
    for bad in [(math.nan, 0.05), (-0.1, 0.05), (0.1, 0.0), (0.1, 0.05, 1.0), (0.1, 0.05, 0.8, 0.0)]:
        with pytest.raises(ValueError, match="seeds_needed"):
            stats.seeds_needed(*bad)
