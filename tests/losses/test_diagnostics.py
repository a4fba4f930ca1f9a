"""The metrics every loss returns, checked against direct computations on the valid entries."""

from __future__ import annotations

import math

import pytest
import torch

from vespo.losses import get_loss, loss_names
from vespo.losses import concat_rows, summarize

from .batches import call_loss, make_batch

SHARED_KEYS = {"loss/pg_loss", "is/log_w_min", "is/log_w_p50", "is/log_w_p90", "is/log_w_max", "is/w_mean",
               "is/ess", "is/n_seq", "kl/k1", "kl/k3"}


def metrics_of(name, batch, **cfg):
    spec = get_loss(name)
    return call_loss(spec, cfg=spec.config_cls(**cfg), **batch).metrics


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


def test_quantiles_are_exact_and_an_empty_batch_reports_zero():
    batch = make_batch(B=5, T=4, seed=47, scale=1.0)
    m = metrics_of("grpo", batch)
    log_w = torch.where(batch["mask"], batch["logp"] - batch["old_logp"], 0.0).sum(-1)[batch["mask"].any(-1)]
    for key, q in (("min", 0.0), ("p50", 0.5), ("p90", 0.9), ("max", 1.0)):
        assert m[f"is/log_w_{key}"].item() == pytest.approx(torch.quantile(log_w, q).item(), rel=1e-12)
    empty = {k: v[-1:] for k, v in batch.items()}  # the all-masked row alone
    assert all(v.item() == 0.0 for v in metrics_of("grpo", empty).values())


KERNEL_KEYS = {"vespo/log_w_min", "vespo/log_w_p50", "vespo/log_w_p90", "vespo/log_w_max", "vespo/w_ess",
               "vespo/eq_w_pos", "vespo/eq_w_neg", "vespo/phi_pos_sum", "vespo/phi_neg_sum",
               "vespo/phi_pos_ess", "vespo/phi_neg_ess"}


@pytest.mark.parametrize("name", ["vespo", "vespo_adaptive"])
@pytest.mark.parametrize("length_norm", ["none", "sqrt"])
def test_kernel_weight_metrics_describe_what_phi_saw(name, length_norm):
    """is/* stays the raw log W; vespo/log_w_* is the log W after the token clamp, the rollout correction,
    the length normalization and the final clamp, and the bound's terms use it with each sign's kernel."""
    batch = make_batch(B=9, T=6, seed=44, scale=0.6, rollout=True)
    shift = batch["logp"][2, 0] - 25.0 - batch["old_logp"][2, 0]
    batch["old_logp"][2, 0] += shift  # one token past the +-20 clamp (row 2 is valid there) ...
    batch["rollout_logp"][2, 0] += shift  # ... with its rollout correction unchanged
    rc = {"mode": "tis_token", "threshold": 1.5}
    m = metrics_of(name, batch, rollout_correction=rc, length_norm=length_norm)
    assert KERNEL_KEYS <= set(m)
    mask, adv = batch["mask"], batch["advantages"]
    valid = mask.any(-1)
    raw = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0)  # [B, T]
    log_rho = torch.where(mask, batch["old_logp"] - batch["rollout_logp"], 0.0).clamp(max=math.log(1.5))
    used = raw.clamp(-20, 20).sum(-1) + log_rho.sum(-1)  # [B]
    if length_norm == "sqrt":
        used = used / mask.sum(-1).clamp(min=1).double().sqrt()
    used = used.clamp(math.log(1e-8), 20.0)
    # is/* is the raw log W (the +25 token in it); vespo/log_w_* what the kernel used
    assert m["is/log_w_min"].item() == pytest.approx(raw.sum(-1)[valid].min().item(), rel=1e-12)
    assert m["vespo/log_w_min"].item() == pytest.approx(used[valid].min().item(), rel=1e-12)
    assert m["vespo/log_w_min"].item() != pytest.approx(m["is/log_w_min"].item(), rel=1e-3)
    for key, q in (("p50", 0.5), ("p90", 0.9), ("max", 1.0)):
        assert m[f"vespo/log_w_{key}"].item() == pytest.approx(torch.quantile(used[valid], q).item(), rel=1e-12)
    W = used[valid].exp()
    assert m["vespo/w_ess"].item() == pytest.approx((W.sum() ** 2 / (len(W) * (W**2).sum())).item(), rel=1e-10)
    shape = {s: (m[f"vespo/k_{s}"].item(), m[f"vespo/lambda_{s}"].item()) for s in ("pos", "neg")} \
        if name == "vespo_adaptive" else {"pos": (2.0, 3.0), "neg": (3.0, 2.0)}
    for sign, rows in (("pos", valid & (adv >= 0)), ("neg", valid & (adv < 0))):
        k, lam = shape[sign]
        w = used[rows].exp()
        phi = w**k * torch.exp(lam * (1 - w))  # the kernel as the paper writes it
        assert m[f"vespo/phi_{sign}_sum"].item() == pytest.approx(phi.sum().item(), rel=1e-10)
        assert m[f"vespo/eq_w_{sign}"].item() == pytest.approx(((phi * w).sum() / phi.sum()).item(), rel=1e-10)
        ess = phi.sum() ** 2 / (len(phi) * (phi**2).sum())
        assert m[f"vespo/phi_{sign}_ess"].item() == pytest.approx(ess.item(), rel=1e-10)
        assert m[f"vespo/phi_{sign}_max"].item() == pytest.approx(phi.max().item(), rel=1e-10)


def test_kernel_metrics_of_an_empty_sign_are_zero():
    batch = make_batch(B=5, T=4, seed=45)
    batch["advantages"] = batch["advantages"].abs()  # no A < 0 sequence
    m = metrics_of("vespo", batch)
    assert m["vespo/n_neg"].item() == 0
    assert [m[f"vespo/{k}"].item() for k in ("eq_w_neg", "phi_neg_sum", "phi_neg_ess")] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("token_adv", [False, True])
def test_rows_of_micro_batches_give_the_whole_batch_metrics(name, token_adv):
    """Every metric is formed from the rows of the whole batch: summarizing the concatenated rows of the
    micro-batches (uneven, one of them with no A < 0 row) gives the whole batch's value of every metric.
    A loss that is not per-row (vespo_adaptive picks its kernel per call, m2po its mask) uses other
    kernels or masks in its split calls: only the keys that do not depend on them are compared there."""
    batch = make_batch(B=12, T=5, seed=46, scale=0.5, token_adv=token_adv, rollout=True)
    batch["advantages"][[3, 7]] = -batch["advantages"][[3, 7]].abs() - 0.2
    batch["advantages"][:3] = batch["advantages"][:3].abs()  # the first micro-batch has no A < 0 entry
    spec = get_loss(name)
    cfg = spec.config_cls()

    def call(rows):
        return call_loss(spec, cfg=cfg, normalizer=7.0, **{k: v[rows] for k, v in batch.items()})

    full = call(slice(None))
    parts = [call(rows) for rows in (slice(0, 3), slice(3, 4), slice(4, 12))]
    merged = summarize(concat_rows([p.rows for p in parts]))
    assert set(merged) == set(full.metrics)
    if spec.per_row:
        torch.testing.assert_close(sum(p.loss for p in parts), full.loss, rtol=1e-12, atol=1e-14)
    keys = [k for k in full.metrics if spec.per_row or k.startswith(("is/", "kl/", "rollout/")) or k == "m2po/m2"]
    assert "is/ess" in keys and "is/log_w_p90" in keys
    for key in keys:
        torch.testing.assert_close(merged[key], full.metrics[key], rtol=1e-12, atol=1e-14, msg=key)
