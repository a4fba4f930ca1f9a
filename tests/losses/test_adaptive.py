"""Adaptive VESPO (vespo_adaptive): the shape each rule chooses, worked by hand and against the float64
reference; equal to `vespo` where it must be; its rules' conditions hold on the chosen shape; finite."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vespo.losses import AGG_MODES, get_loss
from vespo.losses.vespo_adaptive import VespoAdaptiveConfig, adapt_shape

from .batches import agg_kwargs, call_loss, make_batch, to_lists
from .reference import adaptive_shape, eq_w, ess

ADAPTIVE = get_loss("vespo_adaptive")
VESPO = get_loss("vespo")


def run(name, batch, cfg):
    logp = batch["logp"].clone().requires_grad_(True)
    out = call_loss(get_loss(name), logp, cfg=cfg, **{k: v for k, v in batch.items() if k != "logp"})
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


def chosen(metrics):
    return {sign: (metrics[f"vespo/k_{sign}"].item(), metrics[f"vespo/lambda_{sign}"].item())
            for sign in ("pos", "neg")}


def two_token_batch(log_ws, advantages):
    """One row per sequence, two tokens each carrying half of its log W; float64."""
    logp = torch.tensor([[-1.0, -2.0]] * len(log_ws), dtype=torch.float64)
    half = torch.tensor(log_ws, dtype=torch.float64)[:, None] / 2
    return {"logp": logp, "old_logp": logp - half, "advantages": torch.tensor(advantages, dtype=torch.float64),
            "mask": torch.ones(len(log_ws), 2, dtype=torch.bool)}


# ---- hand-worked examples --------------------------------------------------------------------------


def test_budget_rule_by_hand():
    # Two sequences per sign with W = 1/2 and W = 2, budget C = 1 on both signs.
    # E_Q[W]^ = p (1/2) + (1 - p) 2 = 1 needs p = phi(1/2) / (phi(1/2) + phi(2)) = 2/3, i.e. phi(1/2) / phi(2) = 2.
    # phi(1/2) / phi(2) = (1/4)^k exp(1.5 lam):
    #   A >= 0, k = 2: exp(1.5 lam) = 32  => lam = ln 32 / 1.5 = (10/3) ln 2 = 2.3104906018664843
    #   A <  0, k = 3: exp(1.5 lam) = 128 => lam = ln 128 / 1.5 = (14/3) ln 2 = 3.2346868426130780
    # phi(W) = W^k exp(lam (1 - W)):
    #   A >= 0: phi(1/2) = 2^-2 2^(5/3) = 2^(-1/3) = 0.7937005259840998, phi(2) = 2^2 2^(-10/3) = 2^(-4/3)
    #   A <  0: phi(1/2) = 2^-3 2^(7/3) = 2^(-2/3) = 0.6299605249474366, phi(2) = 2^3 2^(-14/3) = 2^(-5/3)
    # token-mean over 8 tokens: the gradient on each token is -phi A / 8.
    ln2 = math.log(2)
    batch = two_token_batch([-ln2, ln2, -ln2, ln2], [1.0, 1.0, -1.0, -1.0])
    cfg = VespoAdaptiveConfig(rule="budget", budget_pos=1.0, budget_neg=1.0)
    out, grad = run("vespo_adaptive", batch, cfg)
    assert chosen(out.metrics)["pos"] == pytest.approx((2.0, 10 / 3 * ln2), rel=1e-10)
    assert chosen(out.metrics)["neg"] == pytest.approx((3.0, 14 / 3 * ln2), rel=1e-10)
    phi = [2 ** (-1 / 3), 2 ** (-4 / 3), 2 ** (-2 / 3), 2 ** (-5 / 3)]
    expected = [[-p * a / 8] * 2 for p, a in zip(phi, [1, 1, -1, -1])]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=0)
    for sign in ("pos", "neg"):
        assert out.metrics[f"vespo/eq_w_{sign}"].item() == pytest.approx(1.0, rel=1e-10)  # the budget binds
        assert out.metrics[f"vespo/budget_{sign}"].item() == 1.0
        assert out.metrics[f"vespo/adapted_{sign}"].item() == 1.0
    assert out.metrics["vespo/phi_pos_sum"].item() == pytest.approx(2 ** (-1 / 3) + 2 ** (-4 / 3), rel=1e-12)


def test_budget_rule_keeps_lambda_min_where_the_budget_holds():
    # With C = 3 > max W = 2, E_Q[W]^ <= C at every lam: the constraint is inactive, lam = lambda_min = 0.5.
    ln2 = math.log(2)
    batch = two_token_batch([-ln2, ln2, -ln2, ln2], [1.0, 1.0, -1.0, -1.0])
    out, _ = run("vespo_adaptive", batch, VespoAdaptiveConfig(budget_pos=3.0, budget_neg=3.0))
    assert chosen(out.metrics) == {"pos": (2.0, 0.5), "neg": (3.0, 0.5)}
    # With C = 0.4 < min W = 1/2 it cannot be met: lam = lambda_max = 10.
    out, _ = run("vespo_adaptive", batch, VespoAdaptiveConfig(budget_pos=0.4, budget_neg=0.4))
    assert chosen(out.metrics) == {"pos": (2.0, 10.0), "neg": (3.0, 10.0)}


def test_ess_rule_by_hand():
    # A >= 0 sequences with W = 1 and W = 2 under the base kernel (2, 3):
    #   log phi(2) = 3 + 2 ln 2 - 6 = 2 ln 2 - 3 = -1.6137056388801094, phi(1) = 1.
    # phi^s gives r = phi_2 / phi_1 = exp(s (2 ln 2 - 3)) and ESS = (1 + r)^2 / (2 (1 + r^2)).
    #   s = 1: r = 0.19912, ESS = 1.43788 / 2.07929 = 0.6915 < 0.9, so the kernel is flattened.
    #   ESS = 0.9 <=> 0.8 r^2 - 2 r + 0.8 = 0 <=> r = 1/2 (or 2): s = ln 2 / (3 - 2 ln 2) = 0.42953...
    #   (k, lam) = s (2, 3) = (0.85906, 1.28859); phi = (1, 1/2).
    # A < 0 sequences with W = 1 and W = 2 under (3, 2): log phi(2) = 3 ln 2 - 2 = 0.0794415, r = 1.08268,
    #   ESS = 4.33756 / 4.34459 = 0.99838 >= 0.9: the base shape is kept (s = 1).
    ln2 = math.log(2)
    batch = two_token_batch([0.0, ln2, 0.0, ln2], [1.0, 1.0, -1.0, -1.0])
    out, grad = run("vespo_adaptive", batch, VespoAdaptiveConfig(rule="ess", ess_target=0.9))
    s = ln2 / (3 - 2 * ln2)
    assert chosen(out.metrics)["pos"] == pytest.approx((2 * s, 3 * s), rel=1e-10)
    assert chosen(out.metrics)["neg"] == (3.0, 2.0)
    assert out.metrics["vespo/scale_pos"].item() == pytest.approx(s, rel=1e-10)
    assert out.metrics["vespo/phi_pos_ess"].item() == pytest.approx(0.9, rel=1e-10)
    phi_neg_2 = math.exp(3 * ln2 - 2)
    assert out.metrics["vespo/phi_neg_ess"].item() == pytest.approx((1 + phi_neg_2) ** 2 / (2 * (1 + phi_neg_2**2)))
    expected = [[-1 / 8] * 2, [-0.5 / 8] * 2, [1 / 8] * 2, [phi_neg_2 / 8] * 2]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=0)


def test_a_sign_whose_weights_are_all_equal_keeps_the_base_shape():
    # A >= 0: W = 1 twice (lag 0); A < 0: W = e^0.2 twice. E_Q[W]^ = W and ESS = 1 whatever the shape.
    batch = two_token_batch([0.0, 0.0, 0.2, 0.2, 0.5], [1.0, 2.0, -1.0, -1.0, 1.0])
    batch = {k: v[:4] for k, v in batch.items()}
    out, _ = run("vespo_adaptive", batch, VespoAdaptiveConfig(budget_pos=0.5, budget_neg=0.5))
    assert chosen(out.metrics) == {"pos": (2.0, 3.0), "neg": (3.0, 2.0)}
    assert out.metrics["vespo/adapted_pos"].item() == 0.0 and out.metrics["vespo/adapted_neg"].item() == 0.0


def test_a_sign_with_fewer_than_two_sequences_keeps_the_base_shape():
    batch = two_token_batch([0.3, -0.4, 0.9, 0.1], [1.0, -1.0, -1.0, -2.0])  # one A >= 0 sequence
    for rule in ("budget", "ess"):
        out, _ = run("vespo_adaptive", batch, VespoAdaptiveConfig(rule=rule, ess_target=0.999))
        assert out.metrics["vespo/adapted_pos"].item() == 0.0 and out.metrics["vespo/adapted_neg"].item() == 1.0
        assert chosen(out.metrics)["pos"] == (2.0, 3.0)
        assert chosen(out.metrics)["neg"] != (3.0, 2.0)


# ---- against the float64 reference and against vespo -----------------------------------------------


@pytest.mark.parametrize("rule", ["budget", "ess"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_chosen_shape_matches_reference(rule, token_adv):
    changed = 0
    for seed in range(6):
        for scale in (0.05, 0.3, 1.5):
            batch = make_batch(B=10, T=6, seed=seed, scale=scale, token_adv=token_adv, rollout=True)
            cfg = VespoAdaptiveConfig(rule=rule, ess_target=0.9, rollout_correction={"mode": "tis_token"})
            out, _ = run("vespo_adaptive", batch, cfg)
            source = SimpleNamespace(base=batch["old_logp"].tolist(), rollout=batch["rollout_logp"].tolist(),
                                     rejection_only=False)
            ref = adaptive_shape(cfg=cfg, rollout=source,
                                 **{k: v for k, v in to_lists(batch).items() if k in ("logp", "mask")},
                                 old=batch["old_logp"].tolist(), adv=_token_adv(batch))
            ours = chosen(out.metrics)
            for sign in ("pos", "neg"):
                assert ours[sign] == pytest.approx(ref[sign], rel=1e-9), (seed, scale, sign)
                changed += ours[sign] != ((2.0, 3.0) if sign == "pos" else (3.0, 2.0))
    assert changed >= 6  # the rules really moved the shape on these batches


def _token_adv(batch):
    adv, (B, T) = batch["advantages"], batch["mask"].shape
    return (adv if adv.dim() == 2 else adv[:, None].expand(B, T)).tolist()


@pytest.mark.parametrize("rule", ["budget", "ess"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_loss_is_vespo_at_the_chosen_shape(rule, token_adv):
    """Each call is VESPO with the (k, lam) it reports (so micro-batches adapt separately, as documented)."""
    batch = make_batch(B=12, T=5, seed=17, scale=0.4, token_adv=token_adv)
    out, grad = run("vespo_adaptive", batch, VespoAdaptiveConfig(rule=rule, ess_target=0.95))
    shape = chosen(out.metrics)
    fixed = VESPO.config_cls(k_pos=shape["pos"][0], lambda_pos=shape["pos"][1],
                             k_neg=shape["neg"][0], lambda_neg=shape["neg"][1])
    ref, ref_grad = run("vespo", batch, fixed)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-13, atol=0)
    _, base_grad = run("vespo", batch, VESPO.config_cls())
    assert not torch.allclose(grad, base_grad)  # the shape moved, so the gradient did


@pytest.mark.parametrize("rule", ["budget", "ess"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_on_policy_equals_vespo_exactly(rule, agg, token_adv, dtype):
    """W = 1 everywhere (N = 1, no rollout correction): phi(1) = 1 for every shape, so the same loss and gradient."""
    batch = make_batch(B=9, T=6, seed=23, token_adv=token_adv)
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    batch["old_logp"] = batch["logp"].clone()
    cfg = {**agg_kwargs(agg), "length_norm": "sqrt"}
    out, grad = run("vespo_adaptive", batch, ADAPTIVE.config_cls(rule=rule, **cfg))
    ref, ref_grad = run("vespo", batch, VESPO.config_cls(**cfg))
    assert torch.equal(out.loss, ref.loss) and torch.equal(grad, ref_grad)
    assert all(torch.equal(out.metrics[k], value) for k, value in ref.metrics.items())  # vespo's keys: same values


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ess_rule_with_target_zero_is_vespo(agg):
    """ess_target = 0 always holds, so s = scale_max = 1: the base shape on any batch, bit for bit."""
    for seed, scale in ((1, 0.3), (2, 3.0)):
        batch = make_batch(B=8, T=7, seed=seed, scale=scale, rollout=True)
        rc = {"mode": "tis_seq", "threshold": 1.5}
        out, grad = run("vespo_adaptive", batch, ADAPTIVE.config_cls(rule="ess", ess_target=0.0, **agg_kwargs(agg),
                                                                      rollout_correction=rc))
        ref, ref_grad = run("vespo", batch, VESPO.config_cls(**agg_kwargs(agg), rollout_correction=rc))
        assert torch.equal(out.loss, ref.loss) and torch.equal(grad, ref_grad)


# ---- the rules' conditions hold on the chosen shape (hypothesis) -----------------------------------

log_weight = st.floats(min_value=-18.42, max_value=20.0, allow_nan=False)


@settings(max_examples=80, deadline=None)
@given(
    xs=st.lists(log_weight, min_size=2, max_size=12),
    spread=st.sampled_from([1e-3, 0.1, 1.0]),
    budget=st.floats(0.3, 3.0),
    k0=st.floats(0.0, 6.0),
    lam0=st.floats(0.01, 6.0),
    target=st.floats(0.0, 1.0),
)
def test_rules_hold_on_the_chosen_shape(xs, spread, budget, k0, lam0, target):
    x = torch.tensor(xs, dtype=torch.float64) * spread  # [B], log W of one sign's sequences
    groups = torch.stack([torch.ones_like(x, dtype=torch.bool), torch.zeros_like(x, dtype=torch.bool)])
    cfg = VespoAdaptiveConfig(k_pos=k0, lambda_pos=lam0, budget_pos=budget, ess_target=target)
    k, lam, _ = adapt_shape(x, groups, cfg)
    values, tol = x.tolist(), 1e-7
    if min(values) == max(values):  # no spread: nothing to adapt to, the base shape
        assert (k[0].item(), lam[0].item()) == (k0, lam0)
        return
    lam_pos = lam[0].item()
    assert k[0].item() == k0 and cfg.lambda_min <= lam_pos <= cfg.lambda_max
    e = eq_w(values, k0, lam_pos)
    if lam_pos < cfg.lambda_max:
        assert e <= budget * (1 + tol) + 1e-12  # the budget holds ...
    if lam_pos > cfg.lambda_min:
        assert e >= budget * (1 - tol) - 1e-12  # ... and binds whenever lam is above its lower bound
    cfg = VespoAdaptiveConfig(rule="ess", k_pos=k0, lambda_pos=lam0, ess_target=target)
    k, lam, metrics = adapt_shape(x, groups, cfg)
    s = metrics["vespo/scale_pos"].item()
    assert cfg.scale_min <= s <= cfg.scale_max
    assert k[0].item() == pytest.approx(s * k0, rel=1e-12) and lam[0].item() == pytest.approx(s * lam0, rel=1e-12)
    value = ess(values, s * k0, s * lam0)
    if s > cfg.scale_min:
        assert value >= target - tol  # the target holds ...
    if s < cfg.scale_max:
        assert value <= target + tol  # ... at the sharpest scale that keeps it


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=3, max_size=3), min_size=1, max_size=6),
    adv=st.lists(st.floats(-10, 10), min_size=6, max_size=6),
    rule=st.sampled_from(["budget", "ess"]),
    agg=st.sampled_from(AGG_MODES),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_extreme_log_ratios_stay_finite(rows, adv, rule, agg, dtype):
    ratio = torch.tensor(rows, dtype=torch.float64)  # [B, 3], log-ratios up to +-1e4 per token
    logp = torch.full_like(ratio, -1.0)
    batch = {"logp": logp.to(dtype), "old_logp": (logp - ratio).to(dtype),
             "advantages": torch.tensor(adv[: len(rows)], dtype=dtype),
             "mask": torch.ones_like(ratio, dtype=torch.bool)}
    out, grad = run("vespo_adaptive", batch, VespoAdaptiveConfig(rule=rule, **agg_kwargs(agg)))
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("rule", ["budget", "ess"])
@pytest.mark.parametrize("log_ratio", [1e4, -1e4])
def test_huge_log_ratios_stay_finite(rule, log_ratio):
    batch = make_batch(B=8, seed=1, rollout=True, pad="-inf")
    batch["old_logp"] = batch["logp"] - log_ratio
    batch["rollout_logp"] = batch["old_logp"] + log_ratio
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        out, grad = run("vespo_adaptive", cast, VespoAdaptiveConfig(rule=rule, rollout_correction={"mode": "mis_seq"}))
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())


# ---- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("rule", "variance", "rule must be one of budget, ess"),
        ("budget_pos", 0.0, "budget_pos must be a finite number > 0.0"),
        ("budget_neg", math.inf, "budget_neg must be a finite number"),
        ("lambda_min", -1.0, "lambda_min must be a finite number > 0.0"),
        ("lambda_max", 0.1, "lambda_max must be a finite number >= 0.5"),
        ("ess_target", 1.5, "ess_target must be a finite number >= 0.0 and <= 1.0"),
        ("scale_min", 0.0, "scale_min must be a finite number > 0.0"),
        ("scale_max", 0.05, "scale_max must be a finite number >= 0.1"),
    ],
)
def test_config_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        VespoAdaptiveConfig(**{field: value})


def test_config_takes_plain_yaml_values():
    import yaml

    options = yaml.safe_load("{rule: ess, ess_target: 0.6, budget_pos: 1, lambda_max: 12, "
                             "rollout_correction: {mode: tis_token, threshold: 2}}")
    cfg = ADAPTIVE.config_cls(**options)
    assert (cfg.rule, cfg.ess_target, cfg.budget_pos, cfg.lambda_max) == ("ess", 0.6, 1, 12)
    assert cfg.rollout_correction.mode == "tis_token"
    defaults = ADAPTIVE.config_cls()
    assert (defaults.rule, defaults.budget_pos, defaults.budget_neg, defaults.lambda_min, defaults.lambda_max,
            defaults.ess_target, defaults.scale_min, defaults.scale_max) == ("budget", 0.9985, 1.032, 0.5, 10.0,
                                                                             0.5, 0.1, 1.0)
    assert (defaults.k_pos, defaults.lambda_pos, defaults.k_neg, defaults.lambda_neg) == (2.0, 3.0, 3.0, 2.0)
