"""The kernel view: coefficients measured through the losses match their closed forms; the CLI writes files."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from losses.reference import adaptive_shape  # tests/ is on sys.path (rootdir import mode)

from vespo.coefficients import kernel_curves, stale_batch
from vespo.coefficients_cli import main
from vespo.losses.vespo_adaptive import VespoAdaptiveConfig

T = 8


@pytest.fixture(scope="module")
def curves():
    return kernel_curves(T=T, w_min=1e-2, w_max=1e2, points=41)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_vespo_coefficient_is_phi(curves, sign):
    W, coef = curves[("vespo", sign)]
    k, lam = (2.0, 3.0) if sign > 0 else (3.0, 2.0)
    torch.testing.assert_close(coef, W**k * torch.exp(lam * (1 - W)), rtol=1e-10, atol=1e-14)


def test_token_level_coefficients(curves):
    W, coef = curves[("reinforce", 1.0)]
    r = W ** (1 / T)
    torch.testing.assert_close(coef, r, rtol=1e-10, atol=0)  # token IS: coefficient r
    _, grpo = curves[("grpo", 1.0)]
    torch.testing.assert_close(grpo, torch.where(r > 1.2, 0.0, r), rtol=1e-10, atol=0)  # A > 0: cut above 1 + eps
    _, grpo_neg = curves[("grpo", -1.0)]
    torch.testing.assert_close(grpo_neg, torch.where(r < 0.8, 0.0, r), rtol=1e-10, atol=0)
    _, sapo = curves[("sapo", 1.0)]
    sig = torch.sigmoid(r - 1)
    torch.testing.assert_close(sapo, 4 * sig * (1 - sig) * r, rtol=1e-10, atol=0)


def test_trust_region_coefficients(curves):
    W, dppo = curves[("dppo", 1.0)]
    r, q = W ** (1 / T), math.exp(-1.0)  # the kernel grid's mu(y_t) = e^-1 on every token
    torch.testing.assert_close(dppo, torch.where(q * r - q > 0.15, 0.0, r), rtol=1e-10, atol=0)  # p - q > delta
    _, dppo_neg = curves[("dppo", -1.0)]
    torch.testing.assert_close(dppo_neg, torch.where(q * r - q < -0.15, 0.0, r), rtol=1e-10, atol=0)
    _, m2po = curves[("m2po", 1.0)]  # each W alone: all tokens but one masked once (log r)^2 >= 0.04
    torch.testing.assert_close(m2po, torch.where(r.log().square() < 0.04, r, r / T), rtol=1e-10, atol=0)


def test_every_curve_is_one_at_w_equal_one():
    curves = kernel_curves(T=T, w_min=0.5, w_max=2.0, points=3)  # middle point is W = 1
    for key, (W, coef) in curves.items():
        assert W[1].item() == pytest.approx(1.0)
        assert coef[1].item() == pytest.approx(1.0, rel=1e-12), key


def test_cli_writes_png_and_csv(tmp_path):
    assert main(["--out", str(tmp_path / "k"), "--T", "4", "--points", "9"]) == 0
    png, table = tmp_path / "k" / "kernels.png", tmp_path / "k" / "kernels.csv"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(table.open()))
    # every curve at both signs and 9 points: at least the 8 built-in losses and 2 adaptive variants (a loss
    # another test registered in this process adds its own curve)
    per_loss = {}
    for r in rows:
        per_loss[r["loss"]] = per_loss.get(r["loss"], 0) + 1
    assert len(per_loss) >= 8 + 2 and set(per_loss.values()) == {2 * 9} and {r["adv_sign"] for r in rows} == {"+", "-"}
    assert {r["loss"] for r in rows} >= {"vespo", "vespo_adaptive:budget", "vespo_adaptive:ess"}
    vespo_at_1 = [r for r in rows if r["loss"] == "vespo" and math.isclose(float(r["W"]), 1.0)]
    assert all(float(r["coef"]) == pytest.approx(1.0) for r in vespo_at_1) and len(vespo_at_1) == 2
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--T", "0"])
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--stale-n", "1"])


@pytest.mark.parametrize("rule", ["budget", "ess"])
def test_adapted_kernel_is_phi_at_the_shape_the_reference_chooses_for_the_stale_batch(curves, rule):
    """The drawn vespo_adaptive curve is phi with the (k, lam) the float64 reference picks on the same stale
    batch, and it differs from the fixed kernel there."""
    batch = {k: v.tolist() for k, v in stale_batch(2.0, 16, T).items()}
    adv = [[a] * T for a in batch["advantages"]]
    shape = adaptive_shape(batch["logp"], batch["old_logp"], adv, batch["mask"], VespoAdaptiveConfig(rule=rule), None)
    moved = 0
    for sign, key in ((1.0, "pos"), (-1.0, "neg")):
        W, coef = curves[(f"vespo_adaptive:{rule}", sign)]
        k, lam = shape[key]
        torch.testing.assert_close(coef, W**k * torch.exp(lam * (1 - W)), rtol=1e-8, atol=1e-14)
        moved += not torch.allclose(coef, curves[("vespo", sign)][1], rtol=1e-3)
    assert moved >= 1


def test_the_plot_takes_more_curves_than_colours_and_dashes(tmp_path):
    """A registry holding extra losses (a user's, or another test's) still plots: each loss in its colour
    of every figure, dash patterns repeating."""
    import torch

    from vespo.coefficients import plot

    W = torch.logspace(-3, 1, 9, dtype=torch.float64)
    names = ["vespo", "vespo_adaptive:ess", "grpo", "gspo", "sapo", "cispo", "reinforce", "dppo", "m2po",
             "geo_mask", "my_loss", "my_other_loss", "vespo:k=4"]
    curves = {(name, sign): (W, W.clamp(max=2.0)) for name in names for sign in (1.0, -1.0)}
    plot(curves, 4, tmp_path / "kernels.png")
    assert (tmp_path / "kernels.png").stat().st_size > 10_000
