"""The paired t-test's power and the seeds it needs, in float64 from their definitions, for the tests of
vespo.lab.stats.seeds_needed and the report's sizing table (a module of its own, like markdown_table)."""

import math
from statistics import NormalDist

import numpy as np
from scipy import stats as sps
from scipy.integrate import quad


def power_reference(n: int, effect: float, alpha: float) -> float:
    """The paired t-test's power in float64 without scipy's noncentral t: T = (Z + nc) / S with Z ~ N(0, 1),
    S = sqrt(V / df), V ~ chi2(df) independent of Z, nc = effect x sqrt(n); P(|T| > c) = E_S[Phi(nc - c S) +
    Phi(-nc - c S)], the expectation over S's density 2 df s chi2_pdf(df s^2) by quadrature."""
    df, nc, phi = n - 1, effect * math.sqrt(n), NormalDist().cdf
    c = float(sps.t.ppf(1 - alpha / 2, df))  # the test's critical value

    def density(s):  # of S: 2 df s x chi2(df) density at df s^2, in logs
        x = df * s * s
        return math.exp(math.log(2 * df * s) + (df / 2 - 1) * math.log(x) - x / 2 - df / 2 * math.log(2)
                        - math.lgamma(df / 2)) if s > 0 else 0.0

    return quad(lambda s: (phi(nc - c * s) + phi(-nc - c * s)) * density(s), 0, np.inf, epsabs=1e-13)[0]


def seeds_reference(sd: float, delta: float, power: float, alpha: float) -> tuple[int, int]:
    """(normal approximation with the standard library's normal quantiles, at least 2; the smallest n >= 2 whose
    power_reference reaches ``power``)."""
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    exact = next(n for n in range(2, 10_000) if power_reference(n, delta / sd, alpha) >= power)
    return max(2, math.ceil((z * sd / delta) ** 2)), exact


def detectable_reference(n: int, sd: float, power: float, alpha: float) -> float:
    """The smallest mean difference n pairs detect with ``power``: bisection on power_reference, which rises with
    the effect (from alpha at 0), to 1e-10 paired SDs."""
    lo, hi = 0.0, 64.0
    while hi - lo > 1e-10:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power_reference(n, mid, alpha) < power else (lo, mid)
    return sd * hi
