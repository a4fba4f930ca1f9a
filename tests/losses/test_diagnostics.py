"""The metrics every loss returns, checked against direct computations on the valid entries."""

from __future__ import annotations

import math

import pytest
import torch

from vespo.losses import get_loss, loss_names
from vespo.losses.diagnostics import masked_quantile

from .batches import make_batch

SHARED_KEYS = {"loss/pg_loss", "is/log_w_min", "is/log_w_p50", "is/log_w_p90", "is/log_w_max", "is/w_mean",
               "is/ess", "is/n_seq", "kl/k1", "kl/k3"}


def metrics_of(name, batch, **cfg):
    spec = get_loss(name)
    return spec.fn(cfg=spec.config_cls(**cfg), **batch).metrics


@pytest.mark.parametrize("name", loss_names())
def test_shared_metrics_are_detached_scalars_and_correct(name):
    batch = make_batch(B=7, T=6, seed=41, scale=0.4)
    batch["logp"] = batch["logp"].requires_grad_(True)
    m = metrics_of(name, batch)
    assert SHARED_KEYS <= set(m)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    mask = batch["mask"]
    d = torch.where(mask, batch["old_logp"] - batch["logp"].detach(), 0.0)
    valid = mask.any(-1)
    log_w = -d.sum(-1)[valid]  # log W of the non-empty rows
    W = log_w.exp()
    assert m["is/n_seq"].item() == valid.sum().item()
    for key, q in (("min", 0.0), ("p50", 0.5), ("p90", 0.9), ("max", 1.0)):
        assert m[f"is/log_w_{key}"].item() == pytest.approx(torch.quantile(log_w, q).item(), rel=1e-10)
    assert m["is/w_mean"].item() == pytest.approx(W.mean().item(), rel=1e-10)
    assert m["is/ess"].item() == pytest.approx((W.sum() ** 2 / (len(W) * (W**2).sum())).item(), rel=1e-10)
    assert m["kl/k1"].item() == pytest.approx(d[mask].mean().item(), rel=1e-10)
    assert m["kl/k3"].item() == pytest.approx((d[mask].exp() - 1 - d[mask]).mean().item(), rel=1e-10)


def test_vespo_phi_split_by_advantage_sign_and_small_fraction():
    batch = make_batch(B=8, T=5, seed=42, scale=1.5)
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.0, 2.0, -0.5, 1.0, -1.0, 3.0], dtype=torch.float64)
    m = metrics_of("vespo", batch)
    mask, adv = batch["mask"], batch["advantages"]
    log_w = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0).sum(-1).clamp(math.log(1e-8), 20)
    valid = mask.any(-1)
    pos = valid & (adv >= 0)  # A = 0 uses the positive kernel, so it is reported with the A >= 0 split
    phi = torch.where(adv >= 0, (3 + 2 * log_w - 3 * log_w.exp()).exp(), (2 + 3 * log_w - 2 * log_w.exp()).exp())
    assert m["vespo/n_pos"].item() == pos.sum().item() and m["vespo/n_neg"].item() == (valid & ~pos).sum().item()
    assert m["vespo/phi_pos_mean"].item() == pytest.approx(phi[pos].mean().item(), rel=1e-10)
    assert m["vespo/phi_neg_min"].item() == pytest.approx(phi[valid & ~pos].min().item(), rel=1e-10)
    assert m["vespo/phi_pos_max"].item() == pytest.approx(phi[pos].max().item(), rel=1e-10)
    small = (phi[valid] < 1e-3).double().mean().item()
    assert 0 < small < 1  # this batch has both kinds, so the check is not vacuous
    assert m["vespo/phi_small_frac"].item() == pytest.approx(small)


def test_clip_fractions_count_binding_tokens():
    # r = e^{+0.5} for row 0 (A > 0) and e^{-0.5} for row 1 (A < 0): both outside [0.8, 1.2]
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    old = logp - torch.tensor([[0.5, 0.0], [-0.5, 0.0]], dtype=torch.float64)
    batch = {"logp": logp, "old_logp": old, "advantages": torch.tensor([1.0, -1.0], dtype=torch.float64),
             "mask": torch.ones(2, 2, dtype=torch.bool)}
    m = metrics_of("grpo", batch)
    assert (m["loss/clip_frac_high"].item(), m["loss/clip_frac_low"].item()) == (0.25, 0.25)
    m = metrics_of("cispo", batch, eps_low=0.2, eps_high=0.2)
    assert (m["loss/clip_frac_high"].item(), m["loss/clip_frac_low"].item()) == (0.25, 0.25)


def test_rollout_kl_reported_when_rollout_logp_given():
    batch = make_batch(seed=43, rollout=True)
    m = metrics_of("grpo", batch)
    d = (batch["rollout_logp"] - batch["old_logp"])[batch["mask"]]
    assert m["rollout/k1"].item() == pytest.approx(d.mean().item(), rel=1e-10)
    assert m["rollout/k3"].item() == pytest.approx((d.exp() - 1 - d).mean().item(), rel=1e-10)
    assert "rollout/k1" not in metrics_of("grpo", make_batch(seed=43))


def test_masked_quantile_matches_torch_quantile_and_handles_empty():
    x = torch.tensor([5.0, -1.0, 3.0, 100.0, 2.0])
    valid = torch.tensor([True, True, True, False, True])
    for q in (0.0, 0.25, 0.5, 0.9, 1.0):
        assert masked_quantile(x, valid, q).item() == pytest.approx(torch.quantile(x[valid], q).item())
    assert masked_quantile(x, torch.zeros(5, dtype=torch.bool), 0.5).item() == 0.0
