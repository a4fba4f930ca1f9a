"""A peer oracle: TRL's VESPO weights (GRPOTrainer.get_gamma_weights), its SAPO and CISPO losses, its OPSM
(GRPOTrainer.get_off_policy_mask, and inside its GRPO loss) and its Dr.GRPO aggregation.

SAPO and CISPO live inside GRPOTrainer._compute_loss, so the test runs that method on a trainer
object built without __init__: only the model forward (which returns our log-probs) and the
single-process accelerator are stand-ins; TRL's loss arithmetic runs as shipped.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from vespo.losses import get_loss

from .batches import call_loss, make_batch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed (pip install vespo[trl])")
GRPOTrainer = trl_grpo.GRPOTrainer


def our_grad(name, batch, **cfg):
    logp = batch["logp"].clone().requires_grad_(True)
    spec = get_loss(name)
    out = call_loss(spec, logp, batch["old_logp"], batch["advantages"], batch["mask"], spec.config_cls(**cfg))
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


@pytest.mark.parametrize("scale", [0.05, 0.5, 3.0])
def test_vespo_phi_matches_trl_get_gamma_weights(scale):
    batch = make_batch(B=8, T=9, seed=31, scale=scale, pad="zero")
    mask, adv = batch["mask"], batch["advantages"]
    log_ratio = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0)
    trl_phi = GRPOTrainer.get_gamma_weights(adv[:, None], log_ratio, mask.double(), None)  # [B, 1]
    _, grad = our_grad("vespo", batch, agg="seq-mean-token-sum")  # grad = -phi A / n_seq per token
    n_seq = (mask.sum(-1) > 0).sum()
    our_phi = -grad[:, :1] * n_seq / adv[:, None]
    valid = mask[:, 0]
    assert trl_phi[valid].min() < 0.9 or trl_phi[valid].max() > 1.1  # the weights are not all ~1
    torch.testing.assert_close(our_phi[valid], trl_phi[valid], rtol=1e-9, atol=1e-12)


def trl_loss(loss_type, batch, **args):
    """TRL's own _compute_loss for ``loss_type`` on our inputs; returns (loss, grad wrt logp)."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    logp = batch["logp"].clone().requires_grad_(True)
    mask = batch["mask"].double()
    trainer.__dict__.update(
        loss_type=loss_type, top_entropy_quantile=1.0, off_policy_mask_threshold=args.get("opsm"), beta=0.0,
        max_completion_length=args.get("max_completion_length"),
        importance_sampling_level=args.get("is_level", "token"), epsilon_low=args.get("epsilon_low", 0.2),
        epsilon_high=args.get("epsilon_high", 0.2), use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1, _metrics=defaultdict(lambda: defaultdict(list)),
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t, gather=lambda t: t),
        args=SimpleNamespace(sapo_temperature_pos=args.get("tau_pos", 1.0), sapo_temperature_neg=args.get("tau_neg", 1.05),
                             delta=None, steps_per_generation=1),
    )
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    B, T = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": batch["advantages"], "old_per_token_logps": batch["old_logp"],
        "num_items_in_batch": mask.sum(),
    }
    loss = trainer._compute_loss(None, inputs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad


@pytest.mark.parametrize("scale", [0.05, 0.5])
# TRL builds tau with torch.where on python floats, i.e. in float32, so 1.05 would differ at ~1e-7;
# temperatures exact in float32 (1.0625 stands in for the default 1.05) compare at 1e-9.
@pytest.mark.parametrize("taus", [(1.0, 1.0625), (2.0, 0.5)])
def test_sapo_matches_trl(scale, taus):
    batch = make_batch(B=6, T=8, seed=32, scale=scale, pad="zero")
    batch = {k: v[:-1] for k, v in batch.items()}  # TRL's seq mean counts empty rows; drop ours
    ref_loss, ref_grad = trl_loss("sapo", batch, tau_pos=taus[0], tau_neg=taus[1])
    out, grad = our_grad("sapo", batch, tau_pos=taus[0], tau_neg=taus[1])
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0])
def test_cispo_matches_trl(scale):
    # TRL's epsilon_high for CISPO is the upper bound itself (5.0 = 1 + our eps_high) and has no lower bound
    batch = make_batch(B=6, T=8, seed=33, scale=scale, pad="zero")
    ref_loss, ref_grad = trl_loss("cispo", batch, epsilon_high=5.0)
    out, grad = our_grad("cispo", batch)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["tis_token", "mis_token"])
def test_vespo_phi_with_rollout_correction_matches_trl_get_gamma_weights(mode):
    """TRL folds its token-level vLLM ratio (truncated, or zeroed above C) into log W; so does our correction."""
    batch = make_batch(B=8, T=9, seed=34, scale=0.4, pad="zero", rollout=True)
    mask, adv = batch["mask"], batch["advantages"]
    log_ratio = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0)
    rho = torch.where(mask, (batch["old_logp"] - batch["rollout_logp"]).exp(), 1.0)  # [B, T], TRL's ratio before C
    trl_ratio = rho.clamp(max=1.5) if mode == "tis_token" else rho.masked_fill(rho > 1.5, 0.0)
    assert (rho > 1.5).any()
    trl_phi = GRPOTrainer.get_gamma_weights(adv[:, None], log_ratio, mask.double(), trl_ratio)  # [B, 1]
    spec = get_loss("vespo")
    cfg = spec.config_cls(agg="seq-mean-token-sum", rollout_correction={"mode": mode, "threshold": 1.5})
    logp = batch["logp"].clone().requires_grad_(True)
    out = call_loss(spec, logp, batch["old_logp"], adv, mask, cfg, rollout_logp=batch["rollout_logp"])
    (grad,) = torch.autograd.grad(out.loss, logp)
    our_phi = -grad[:, :1] * (mask.sum(-1) > 0).sum() / adv[:, None]
    valid = mask[:, 0]
    torch.testing.assert_close(our_phi[valid], trl_phi[valid], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("delta", [0.0, 0.05, 0.5])
@pytest.mark.parametrize("token_adv", [False, True])
def test_opsm_mask_matches_trl_get_off_policy_mask(delta, token_adv):
    """The mask itself: TRL's static method on (A, log pi_theta, log mu, mask) against vespo.losses.opsm."""
    from vespo.losses.opsm import opsm_keep

    masked = 0
    for seed in range(4):
        batch = make_batch(B=8, T=9, seed=40 + seed, scale=0.4, pad="zero", token_adv=token_adv)
        mask, adv = batch["mask"], batch["advantages"]
        adv2 = adv if token_adv else adv[:, None]
        trl_keep = GRPOTrainer.get_off_policy_mask(adv2, batch["logp"], batch["old_logp"], mask.double(), delta)
        log_ratio = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0)
        ours = opsm_keep(log_ratio, adv2, mask.double().sum(-1), delta)
        assert torch.equal(ours.double().expand_as(mask)[mask], trl_keep.expand_as(mask)[mask])
        masked += int((~ours.expand_as(mask))[mask].sum())
    assert masked > 0 or delta == 0.5  # the comparison covers masked sequences


@pytest.mark.parametrize("delta,scale", [(0.0, 0.1), (0.02, 0.1), (0.05, 0.5), (0.2, 0.5)])
def test_grpo_with_opsm_matches_trl(delta, scale):
    """TRL's GRPO loss (no dual clip, seq-mean-token-mean) with off_policy_mask_threshold = ours with opsm_delta."""
    batch = make_batch(B=8, T=9, seed=44, scale=scale, pad="zero")
    batch = {k: v[:-1] for k, v in batch.items()}  # TRL's seq mean counts empty rows; drop ours
    ref_loss, ref_grad = trl_loss("grpo", batch, opsm=delta)
    out, grad = our_grad("grpo", batch, agg="seq-mean-token-mean", dual_clip_c=None, opsm_delta=delta)
    assert out.metrics["loss/opsm_mask_frac"] > 0
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale", [0.1, 0.5])
def test_dr_grpo_aggregation_matches_trl(scale):
    """seq-mean-token-sum-norm with C = TRL's max_completion_length equals TRL's dr_grpo."""
    batch = make_batch(B=8, T=9, seed=45, scale=scale, pad="zero")
    batch = {k: v[:-1] for k, v in batch.items()}  # TRL divides by all rows, empty ones too; drop ours
    ref_loss, ref_grad = trl_loss("dr_grpo", batch, max_completion_length=12)
    out, grad = our_grad("grpo", batch, agg="seq-mean-token-sum-norm", norm_length=12, dual_clip_c=None)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0])
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.3)])
def test_luspo_matches_trl(scale, eps):
    """vespo's luspo against TRL's loss_type="luspo" with importance_sampling_level="sequence" (its documented
    setup), loss and gradient. TRL's mean counts every row, the all-masked last row too; vespo counts rows with a
    valid token unless given the count, so it is given TRL's (B) as the normalizer."""
    batch = make_batch(B=8, T=9, seed=41, scale=scale, pad="zero")
    loss, grad = trl_loss("luspo", batch, is_level="sequence", epsilon_low=eps[0], epsilon_high=eps[1])
    logp = batch["logp"].clone().requires_grad_(True)
    spec = get_loss("luspo")
    out = call_loss(spec, logp, batch["old_logp"], batch["advantages"], batch["mask"],
                    spec.config_cls(eps_low=eps[0], eps_high=eps[1]), normalizer=float(len(logp)))
    (ours,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(out.loss, loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours, grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().max() > 0
    gspo = call_loss(get_loss("gspo"), batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"],
                     get_loss("gspo").config_cls(eps_low=eps[0], eps_high=eps[1]), normalizer=float(len(logp)))
    assert abs(float(gspo.loss.detach() - loss.detach())) > 1e-6  # the length weighting is what TRL's luspo adds to GSPO
