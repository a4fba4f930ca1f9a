"""Identities the losses must satisfy whatever their implementation details."""

from __future__ import annotations

import pytest
import torch

from vespo.losses import AGG_MODES, gamma_phi, get_loss, loss_names

from .batches import agg_kwargs, call_loss, make_batch, to_lists
from .reference import reference_loss


def grad_of(name, batch, normalizer=None, **cfg):
    logp = batch["logp"].clone().requires_grad_(True)
    args = {k: v for k, v in batch.items() if k != "logp"}
    spec = get_loss(name)
    out = call_loss(spec, logp, cfg=spec.config_cls(**cfg), normalizer=normalizer, **args)
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


@pytest.mark.parametrize("name", ["vespo", "vespo_adaptive", "grpo", "sapo", "cispo", "gspo", "dppo", "m2po"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_on_policy_gradient_equals_reinforce(name, agg):
    batch = make_batch(seed=11, token_adv=False)
    batch["old_logp"] = batch["logp"].clone()  # on-policy: logp == old_logp, so r = W = phi = 1
    _, grad = grad_of(name, batch, **agg_kwargs(agg))
    _, ref = grad_of("reinforce", batch, **agg_kwargs(agg), is_level="none")
    assert ref.abs().max() > 0
    torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-15)


def test_vespo_gradient_is_minus_phi_times_advantage_over_normalizer():
    batch = make_batch(seed=5, scale=0.2)
    out, grad = grad_of("vespo", batch, normalizer=17.0)
    mask, adv = batch["mask"], batch["advantages"]
    log_ratio = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0)
    log_w = log_ratio.sum(-1, keepdim=True)  # [B, 1]; all |log W| << 20 at this scale, no clamp
    W = log_w.exp()
    k = torch.where(adv[:, None] >= 0, 2.0, 3.0).double()
    lam = torch.where(adv[:, None] >= 0, 3.0, 2.0).double()
    phi = W**k * torch.exp(lam * (1 - W))  # the paper's kernel as written, not in log space
    expected = torch.where(mask, -phi * adv[:, None] / 17.0, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("k_pos,lambda_pos,k_neg,lambda_neg", [(2, 3, 3, 2), (0.5, 7, 9, 0.1), (0, 0, 5, 5)])
def test_phi_of_one_is_one(k_pos, lambda_pos, k_neg, lambda_neg):
    cfg = get_loss("vespo").config_cls(k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)
    phi = gamma_phi(torch.zeros(2, 1, dtype=torch.float64), torch.tensor([[1.0], [-1.0]], dtype=torch.float64), cfg)
    assert phi.tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("agg", AGG_MODES)
def test_extra_masked_padding_changes_nothing(name, agg):
    batch = make_batch(seed=9, scale=0.5, rollout=True)
    out, grad = grad_of(name, batch, **agg_kwargs(agg), rollout_correction={"mode": "tis_token"})
    padded = {k: torch.cat([v, torch.full((v.shape[0], 5), float("nan"), dtype=v.dtype)], dim=1)
              for k, v in batch.items() if k not in ("mask", "advantages")}
    padded["mask"] = torch.cat([batch["mask"], torch.zeros(batch["mask"].shape[0], 5, dtype=torch.bool)], 1)
    padded["advantages"] = batch["advantages"]
    padded_out, padded_grad = grad_of(name, padded, **agg_kwargs(agg), rollout_correction={"mode": "tis_token"})
    torch.testing.assert_close(padded_out.loss, out.loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(padded_grad[:, :-5], grad, rtol=1e-13, atol=0)
    assert padded_grad[:, -5:].abs().max() == 0
    for key, value in out.metrics.items():
        torch.testing.assert_close(padded_out.metrics[key], value, rtol=1e-12, atol=1e-15, msg=key)


# vespo_adaptive chooses its kernel and m2po its mask from the batch it is given, so their micro-batches
# adapt separately (documented; tests/losses/test_adaptive.py checks each call is VESPO at the shape it
# chose, test_m2po_micro_batches_mask_on_their_own_tokens below what m2po does).
PER_ROW_LOSSES = [name for name in loss_names() if get_loss(name).per_row]


@pytest.mark.parametrize("name", PER_ROW_LOSSES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_sum_to_the_mini_batch_gradient(name, agg):
    batch = make_batch(B=8, seed=21, scale=0.3)
    mask = batch["mask"]
    count = mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum()  # the whole mini-batch's count
    _, full = grad_of(name, batch, normalizer=float(count), **agg_kwargs(agg))
    _, unnormalized = grad_of(name, batch, **agg_kwargs(agg))  # the default normalizer is this batch's own count
    torch.testing.assert_close(unnormalized, full, rtol=1e-12, atol=1e-15)
    parts = [grad_of(name, {k: v[rows] for k, v in batch.items()}, normalizer=float(count), **agg_kwargs(agg))[1]
             for rows in (slice(0, 3), slice(3, 4), slice(4, 8))]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-12, atol=1e-15)


def test_m2po_micro_batches_mask_on_their_own_tokens():
    """m2po's mask is a statistic of the call's tokens: each micro-batch, with the mini-batch's normalizer,
    is the float64 reference on its own rows (its own second moment under tau), and the split changes the
    gradient of the whole call (which is why m2po is not per_row)."""
    batch = make_batch(B=8, seed=21, scale=0.3)
    count = float(batch["mask"].sum())
    cfg = get_loss("m2po").config_cls()
    _, full = grad_of("m2po", batch, normalizer=count)
    parts = []
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        part = {k: v[rows] for k, v in batch.items()}
        out, grad = grad_of("m2po", part, normalizer=count)
        _, ref_grad = reference_loss("m2po", cfg=cfg, normalizer=count, **to_lists(part))
        torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=grad.dtype), rtol=1e-9, atol=1e-12)
        kept = out.rows["tokens"].sum() - out.rows["m2_masked"].sum()
        assert out.metrics["m2po/m2_kept"] < cfg.m2_threshold or kept == 1  # one token is always kept
        parts.append(grad)
    assert not torch.allclose(torch.cat(parts), full, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(loss_names()))
def test_seq_weight_is_the_rows_gradient_relative_to_reinforce(name):
    """sum_t dL/dlogp_it = seq_weight_i * (-A_i) * T_i / (token count) under token-mean, for every loss;
    VESPO's is phi(W); a row with A = 0 has no weight (NaN)."""
    batch = make_batch(seed=23, scale=0.3, token_adv=False)
    batch["advantages"][2] = 0.0
    out, grad = grad_of(name, batch, agg="token-mean")
    mask, adv = batch["mask"], batch["advantages"]
    tokens = mask.sum(-1).double()
    expected = out.seq_weight * (-adv) * tokens / tokens.sum()
    rows = (adv != 0) & (tokens > 0)
    torch.testing.assert_close(grad.sum(-1)[rows], expected[rows], rtol=1e-10, atol=1e-14)
    assert torch.isnan(out.seq_weight[2])
    if name == "vespo":
        log_w = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0).sum(-1, keepdim=True)
        phi = gamma_phi(log_w, adv[:, None], get_loss("vespo").config_cls())[:, 0]
        torch.testing.assert_close(out.seq_weight[rows], phi[rows], rtol=1e-12, atol=0)
