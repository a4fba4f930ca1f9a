"""No correction is a silent no-op: over every loss x correction x behaviour (mu recomputed, or mu = the
engine's log-probs, verl's bypass mode), the correction changes the gradient where its ratio is not 1 and a
metric shows that it acted, or the configuration is refused with one line saying why."""

from __future__ import annotations

import pytest
import torch

from vespo.losses import get_loss, loss_names

from .batches import call_loss, make_batch

CORRECTIONS = {  # each acts on the batch below: some ratios leave the band / pass the threshold
    "tis_token": {"rollout_correction": {"mode": "tis_token", "threshold": 1.5}},
    "tis_seq": {"rollout_correction": {"mode": "tis_seq", "threshold": 1.5}},
    "mis_token": {"rollout_correction": {"mode": "mis_token", "threshold": 1.5}},
    "mis_seq": {"rollout_correction": {"mode": "mis_seq", "threshold": 1.5}},
    "geo_mask": {"rollout_correction": {"mode": "geo_mask"}},
    "geo_mask_verl": {"rollout_correction": {"mode": "geo_mask", "geo_token_clamp": 20.0}},
    "icepop": {"rollout_correction": {"mode": "icepop"}},
    "tis_token_normalized": {"rollout_correction": {"mode": "tis_token", "threshold": 1.5, "batch_normalize": True}},
    "reject_token_k3": {"rollout_correction": {"mode": "reject", "reject_by": "token_k3", "reject_high": 0.05}},
    "reject_seq_sum_k2": {"rollout_correction": {"mode": "reject", "reject_by": "seq_sum_k2", "reject_high": 0.3}},
    "mis_token_reject_seq_mean_k3": {"rollout_correction": {"mode": "mis_token", "threshold": 1.5,
                                                            "reject_by": "seq_mean_k3", "reject_high": 0.05}},
    "tis_seq_reject_token_k2": {"rollout_correction": {"mode": "tis_seq", "threshold": 1.5, "reject_by": "token_k2",
                                                       "reject_high": 0.05}},
    "opsm": {"opsm_delta": 0.05},
}
SHOWS = ("rollout/masked_frac", "rollout/truncated_frac", "loss/opsm_mask_frac")  # what says a correction acted
# m2po's own mask (tau = 0.04) would already drop every token far enough off for a correction to touch
VARIANTS = [(name, {"m2_threshold": 2.0} if name == "m2po" else {}) for name in loss_names()]
VARIANTS += [("reinforce", {"is_level": "none"})]


def grad(name, cfg, batch, bypass):
    logp = batch["logp"].clone().requires_grad_(True)
    args = {k: v for k, v in batch.items() if k != "logp"}
    torch.manual_seed(0)  # clip_cov draws from torch's global generator: the same draw in every call
    out = call_loss(get_loss(name), logp, cfg=cfg, bypass=bypass, **args)
    (g,) = torch.autograd.grad(out.loss, logp)
    return out, g


@pytest.mark.parametrize("name,overrides", VARIANTS, ids=[f"{n}{'-' + str(o) if o else ''}" for n, o in VARIANTS])
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
@pytest.mark.parametrize("bypass", [False, True], ids=["recompute", "bypass"])
def test_every_correction_acts_or_is_refused(name, overrides, correction, bypass):
    # pi_theta / mu and pi_old / pi_rollout both far from 1 on some tokens (log-ratio scale 0.5)
    batch = make_batch(B=8, T=9, scale=0.5, seed=1, rollout=True, pad="zero")
    spec = get_loss(name)
    if name in ("gspo", "luspo") and correction == "opsm":  # GSPO's clip already stops every sequence OPSM would mask
        with pytest.raises(ValueError, match="cannot change GSPO's update"):
            spec.config_cls(**overrides, **CORRECTIONS[correction])
        return
    cfg = spec.config_cls(**overrides, **CORRECTIONS[correction])
    refusal = cfg.bypass_refusal()
    if bypass and refusal:
        assert "cannot act with mu = the engine's log-probs" in refusal and "\n" not in refusal
        with pytest.raises(ValueError, match="cannot act with mu = the engine's log-probs"):
            grad(name, cfg, batch, bypass)
        return
    # only truncations and IcePop (whose pi_old / pi_rollout bypass mode cannot form) are refused, and only here
    assert refusal is None or correction.startswith("tis") or correction == "icepop"
    out, g = grad(name, cfg, batch, bypass)
    _, plain = grad(name, spec.config_cls(**overrides), batch, bypass)
    assert (g - plain).abs().max() > 1e-6, "the correction did not change the update"
    assert max(float(out.metrics.get(k, 0.0)) for k in SHOWS) > 0, "no metric shows the correction acting"


@pytest.mark.parametrize("name,overrides", VARIANTS, ids=[f"{n}{'-' + str(o) if o else ''}" for n, o in VARIANTS])
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_at_ratio_one_every_correction_leaves_the_update(name, overrides, correction):
    """Where the correction's ratio is 1 (pi_rollout = mu = pi_theta) nothing is masked or truncated, and the
    update is the uncorrected one: acting is tied to the ratio, not to the option being set."""
    batch = make_batch(B=8, T=9, scale=0.5, seed=5, pad="zero")
    batch["old_logp"] = batch["logp"].clone()
    batch["rollout_logp"] = batch["logp"].clone()
    spec = get_loss(name)
    if name in ("gspo", "luspo") and correction == "opsm":
        return  # refused (above)
    for bypass in (False, True):
        cfg = spec.config_cls(**overrides, **CORRECTIONS[correction])
        if bypass and cfg.bypass_refusal():
            continue
        out, g = grad(name, cfg, batch, bypass)
        _, plain = grad(name, spec.config_cls(**overrides), batch, bypass)
        torch.testing.assert_close(g, plain, rtol=1e-12, atol=1e-14)
        assert all(float(out.metrics.get(k, 0.0)) == 0 for k in SHOWS)
