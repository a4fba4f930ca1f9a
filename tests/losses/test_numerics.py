"""Numerics and bad input: extreme log-ratios, garbage in padding, empty rows, clear errors."""

from __future__ import annotations

import pytest
import torch

from vespo.losses import RolloutCorrection, aggregate, get_loss, loss_names, sequence_log_weight

from .batches import call_loss, make_batch


def call(name, batch, dtype=None, **cfg):
    if dtype is not None:
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    logp = batch["logp"].clone().requires_grad_(True)
    spec = get_loss(name)
    out = call_loss(spec, logp, cfg=spec.config_cls(**cfg), **{k: v for k, v in batch.items() if k != "logp"})
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


def assert_all_finite(out, grad):
    assert torch.isfinite(out.loss), out.loss
    assert torch.isfinite(grad).all()
    bad = [k for k, v in out.metrics.items() if not torch.isfinite(v).all()]
    assert not bad, f"non-finite metrics: {bad}"


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("log_ratio", [1e4, -1e4])
def test_huge_log_ratios_stay_finite(name, dtype, log_ratio):
    batch = make_batch(seed=1, rollout=True, pad="-inf")
    batch["old_logp"] = batch["logp"] - log_ratio
    batch["rollout_logp"] = batch["old_logp"] + log_ratio
    assert_all_finite(*call(name, batch, dtype=dtype))
    assert_all_finite(*call(name, batch, dtype=dtype, rollout_correction={"mode": "mis_seq"}))


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("pad", ["nan", "-inf"])
def test_garbage_in_padding_and_empty_rows_are_fine(name, pad):
    batch = make_batch(seed=2, pad=pad, token_adv=True)
    batch["advantages"] = batch["advantages"].masked_fill(~batch["mask"], float("nan"))
    out, grad = call(name, batch)
    assert_all_finite(out, grad)
    assert (grad[~batch["mask"]] == 0).all()


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (2, 4)])
def test_zero_length_and_all_masked_batches(name, shape):
    logp = torch.zeros(shape, requires_grad=True)
    spec = get_loss(name)
    out = call_loss(spec, logp, torch.zeros(shape), torch.zeros(shape[:1]), torch.zeros(shape, dtype=torch.bool),
                  spec.config_cls())
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert out.loss.item() == 0.0 and (grad == 0).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    assert out.metrics["is/n_seq"].item() == 0


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("tensor", ["logp", "old_logp", "advantages", "rollout_logp"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_unmasked_nan_or_inf_raises_naming_the_tensor(name, tensor, value):
    batch = make_batch(seed=3, rollout=True)
    batch[tensor] = batch[tensor].clone()
    batch[tensor][0] = value if batch[tensor].dim() == 1 else batch[tensor][0]  # advantages [B]: row 0
    if batch[tensor].dim() == 2:
        batch[tensor][0, 0] = value  # row 0 is fully valid, so (0, 0) is unmasked
    with pytest.raises(ValueError, match=rf"^{tensor} has 1 NaN/inf"):
        call(name, batch)


@pytest.mark.parametrize("name", loss_names())
def test_shape_mismatch_names_both_shapes(name):
    batch = make_batch(B=4, T=6, seed=4)
    batch["old_logp"] = batch["old_logp"][:, :5]
    with pytest.raises(ValueError, match=r"old_logp shape \(4, 5\) does not match logp shape \(4, 6\)"):
        call(name, batch)
    batch = make_batch(B=4, T=6, seed=4)
    batch["advantages"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"advantages shape \(3,\) must be \[B\] = \(4,\)"):
        call(name, batch)
    batch = make_batch(B=4, T=6, seed=4)
    batch["mask"] = batch["mask"].float() * 2
    with pytest.raises(ValueError, match="mask must hold only 0/1"):
        call(name, batch)


def test_rollout_correction_without_rollout_logp_is_an_error():
    with pytest.raises(ValueError, match="rollout_correction.mode='tis_seq' needs rollout_logp"):
        call("vespo", make_batch(seed=5), rollout_correction={"mode": "tis_seq"})


@pytest.mark.parametrize(
    "name,field,value,message",
    [
        ("vespo", "k_pos", -1.0, "k_pos must be a finite number >= 0.0"),
        ("vespo", "lambda_neg", float("nan"), "lambda_neg must be a finite number"),
        ("vespo", "length_norm", "log", "length_norm must be one of none, sqrt, linear"),
        ("vespo", "agg", "mean", "agg must be one of token-mean, seq-mean-token-mean, seq-mean-token-sum"),
        ("grpo", "eps_low", 1.0, "eps_low must be in"),
        ("grpo", "dual_clip_c", 1.0, "dual_clip_c must be a finite number > 1.0"),
        ("gspo", "eps_high", -1e-4, "eps_high must be a finite number >= 0.0"),
        ("sapo", "tau_pos", 0.0, "tau_pos must be a finite number > 0.0"),
        ("cispo", "eps_low", 1.5, "eps_low must be a finite number >= 0.0 and <= 1.0"),
        ("reinforce", "is_level", "seq", "is_level must be one of none, token, sequence"),
        ("grpo", "rollout_correction", {"mode": "tis"}, "rollout_correction.mode must be one of"),
        ("grpo", "rollout_correction", {"threshold": 0.0}, "rollout_correction.threshold must be"),
        ("grpo", "rollout_correction", {"mode": "geo_mask", "geo_low": 1.01}, "rollout_correction.geo_low must be"),
        ("grpo", "rollout_correction", {"geo_high": 0.99}, "rollout_correction.geo_high must be a finite number >= 1"),
        ("dppo", "divergence", "js", "divergence must be one of tv, kl"),
        ("dppo", "delta_high", -0.1, "delta_high must be a finite number >= 0.0"),
        ("dppo", "ratio_cap", 0.5, "ratio_cap must be a finite number >= 1.0"),
        ("m2po", "m2_threshold", 0.0, "m2_threshold must be a finite number > 0.0"),
    ],
)
def test_config_validation_names_the_field(name, field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        get_loss(name).config_cls(**{field: value})


def test_configs_have_spec_defaults():
    v, g, s, p, c = (get_loss(n).config_cls() for n in ("vespo", "gspo", "sapo", "grpo", "cispo"))
    assert (v.k_pos, v.lambda_pos, v.k_neg, v.lambda_neg, v.agg, v.length_norm) == (2, 3, 3, 2, "token-mean", "none")
    assert (g.eps_low, g.eps_high, g.agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert (s.tau_pos, s.tau_neg, s.agg) == (1.0, 1.05, "seq-mean-token-mean")
    assert (p.eps_low, p.eps_high, p.dual_clip_c, p.agg) == (0.2, 0.2, 3.0, "token-mean")
    assert (c.eps_low, 1 + c.eps_high) == (None, 5.0)
    assert v.rollout_correction == RolloutCorrection("none", 2.0, geo_low=0.99, geo_high=1.01)
    d, d_kl, m = get_loss("dppo").config_cls(), get_loss("dppo").config_cls(divergence="kl"), get_loss("m2po").config_cls()
    assert (d.divergence, d.delta_low, d.delta_high, d.ratio_cap, d.agg) == ("tv", 0.15, 0.15, None, "token-mean")
    assert (d_kl.delta_low, d_kl.delta_high) == (0.05, 0.05)
    assert (m.m2_threshold, m.agg) == (0.04, "token-mean")


def test_unknown_loss_lists_the_choices():
    with pytest.raises(ValueError, match="unknown loss 'vespoo'; choose one of: cispo, clip_cov, decoupled_ppo, dppo, "
                       "dro, gmpo, grpo, gspo, ipo, kl_cov, luspo, m2po, prime_rl, reinforce, sapo, topr, vespo, "
                       "vespo_adaptive$"):
        get_loss("vespoo")


def test_bad_normalizer_is_an_error():
    loss, mask = torch.ones(2, 3), torch.ones(2, 3)
    for bad in (0.0, -1.0, float("nan"), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="normalizer"):
            aggregate(loss, mask, "token-mean", normalizer=bad)
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate(loss, mask, "sum")


def test_sequence_log_weight_ignores_padding():
    logp = torch.tensor([[-1.0, -2.0, float("nan")]])
    old = torch.tensor([[-1.5, -1.0, -float("inf")]])
    # (-1 + 1.5) + (-2 + 1) = -0.5; the masked third token is ignored
    assert sequence_log_weight(logp, old, torch.tensor([[1, 1, 0]])).tolist() == [-0.5]
