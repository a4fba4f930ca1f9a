"""Every loss against its independent float64 reference (tests/losses/reference.py): values and
gradients within 1e-9 relative, on fresh random inputs at several log-ratio scales, for every
aggregation mode, sequence and token advantages, an external normalizer and rollout correction."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from vespo.losses import AGG_MODES, get_loss, loss_names

from .batches import agg_kwargs, call_loss, make_batch, to_lists
from .reference import geo_kept, m2po_kept, reference_loss, reject_kept

RNG_SEED = 1234
SCALES = (1e-3, 0.1, 1.0, 8.0)  # 8.0 drives log W past +-20 and GSPO past its clamp
VARIANTS = {  # name -> config overrides worth covering beyond the defaults
    "reinforce": [{"is_level": "none"}, {"is_level": "token"}, {"is_level": "sequence"}],
    "grpo": [{}, {"eps_high": 0.28, "dual_clip_c": None}],
    "gspo": [{}, {"eps_low": 0.2, "eps_high": 0.3}],
    "sapo": [{}, {"tau_pos": 2.0, "tau_neg": 0.5}],
    "cispo": [{}, {"eps_low": 0.2, "eps_high": 0.5}],
    "dppo": [{}, {"divergence": "kl"}, {"delta_low": 0.05, "delta_high": 0.3, "ratio_cap": 2.0},
             {"divergence": "kl", "delta_low": 0.01, "delta_high": 0.2, "ratio_cap": 1.5}],
    "m2po": [{}, {"m2_threshold": 0.5}, {"m2_threshold": 5.0}],
    "prime_rl": [{}, {"delta_low": 0.05, "delta_high": 0.3, "kl_tau": 0.1}],
    "vespo": [{}, {"length_norm": "sqrt"}, {"length_norm": "linear"}, {"k_pos": 0.0, "lambda_neg": 0.0},
              {"nomu_group": 2}, {"nomu_group": 3, "length_norm": "sqrt"}],
    "luspo": [{}, {"eps_low": 0.2, "eps_high": 0.3}],
    "gmpo": [{}, {"eps_low": 0.1, "eps_high": 0.3}],
    "dro": [{}, {"beta": 2.0}],
    "ipo": [{}, {"delta": 0.02, "kl_tau": 0.1}],
    "topr": [{}, {"positive_weight": 0.5, "negative_weight": 2.0}],
    "kl_cov": [{}, {"kl_cov_ratio": 0.2, "coef": 0.5}],
    "clip_cov": [{}, {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.05, "clip_cov_ub": 2.0, "eps_high": 0.28}],
    "vespo_adaptive": [{}, {"budget_pos": 1.3, "budget_neg": 0.8, "lambda_min": 1e-3, "lambda_max": 50.0},
                       {"rule": "ess"}, {"rule": "ess", "ess_target": 0.97, "scale_min": 0.01, "scale_max": 2.0},
                       {"rule": "ess", "length_norm": "sqrt", "k_neg": 5.0}],
}


def run_both(name, batch, cfg, normalizer=None, bypass=False):
    logp = batch["logp"].clone().requires_grad_(True)
    args = {k: v for k, v in batch.items() if k != "logp"}
    torch.manual_seed(RNG_SEED)  # clip_cov draws from torch's global generator, as verl's: the same draw in both
    out = call_loss(get_loss(name), logp, cfg=cfg, normalizer=normalizer, bypass=bypass, **args)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.manual_seed(RNG_SEED)
    ref_loss, ref_grad = reference_loss(name, cfg=cfg, normalizer=normalizer, bypass=bypass, **to_lists(batch))
    return out.loss, grad, torch.tensor(ref_loss, dtype=torch.float64), torch.tensor(ref_grad, dtype=torch.float64)


def assert_matches(name, batch, cfg, normalizer=None, bypass=False):
    loss, grad, ref_loss, ref_grad = run_both(name, batch, cfg, normalizer, bypass)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0 or ref_grad.abs().sum() == 0


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("scale", SCALES)
def test_every_loss_matches_reference(name, scale):
    for v, overrides in enumerate(VARIANTS[name]):
        for seed, token_adv in itertools.product(range(2), (False, True)):
            batch = make_batch(scale=scale, seed=100 * v + seed, token_adv=token_adv)
            assert_matches(name, batch, get_loss(name).config_cls(**overrides))


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("agg", AGG_MODES)
def test_every_aggregation_and_normalizer_matches_reference(name, agg):
    batch = make_batch(scale=0.3, seed=7)
    cfg = get_loss(name).config_cls(**agg_kwargs(agg))
    assert_matches(name, batch, cfg)
    assert_matches(name, batch, cfg, normalizer=13.0)


CORRECTIONS = {"tis_token": {"threshold": 1.5}, "tis_seq": {"threshold": 1.5}, "mis_token": {"threshold": 1.5},
               "mis_seq": {"threshold": 1.5}, "geo_mask": {"geo_low": 0.85, "geo_high": 1.15},
               "geo_mask_verl": {"mode": "geo_mask", "geo_low": 0.85, "geo_high": 1.15, "geo_token_clamp": 0.3},
               "icepop": {"icepop_low": 0.8, "icepop_high": 1.4},
               "tis_token_normalized": {"mode": "tis_token", "threshold": 1.5, "batch_normalize": True},
               "tis_seq_normalized": {"mode": "tis_seq", "threshold": 1.5, "batch_normalize": True},
               "icepop_normalized": {"mode": "icepop", "icepop_low": 0.8, "icepop_high": 1.4, "batch_normalize": True},
               "reject_token_k3": {"mode": "reject", "reject_by": "token_k3", "reject_high": 0.05},
               "reject_seq_mean_k1": {"mode": "reject", "reject_by": "seq_mean_k1", "reject_low": 0.9, "reject_high": 1.2},
               "reject_seq_max_k2": {"mode": "reject", "reject_by": "seq_max_k2", "reject_high": 0.1},
               # a rejection on top of an importance weight (verl's rollout_is with rollout_rs)
               "tis_token_rs_seq_mean_k3": {"mode": "tis_token", "threshold": 1.5, "reject_by": "seq_mean_k3",
                                            "reject_high": 0.02},
               "tis_seq_rs_seq_mean_k1": {"mode": "tis_seq", "threshold": 1.5, "reject_by": "seq_mean_k1",
                                          "reject_low": 0.9, "reject_high": 1.2},
               "tis_seq_normalized_rs_token_k1": {"mode": "tis_seq", "threshold": 1.5, "batch_normalize": True,
                                                  "reject_by": "token_k1", "reject_low": 0.8, "reject_high": 1.1},
               "mis_token_rs_token_k2": {"mode": "mis_token", "threshold": 1.5, "reject_by": "token_k2",
                                         "reject_high": 0.02},
               "mis_seq_rs_seq_sum_k1": {"mode": "mis_seq", "threshold": 1.5, "reject_by": "seq_sum_k1",
                                         "reject_low": 0.7, "reject_high": 1.3},
               "icepop_rs_seq_max_k2": {"mode": "icepop", "icepop_low": 0.8, "icepop_high": 1.4,
                                        "reject_by": "seq_max_k2", "reject_high": 0.1}}


def correction_config(name, mode, **options):
    return get_loss(name).config_cls(rollout_correction={"mode": mode, **CORRECTIONS[mode]}, **options)


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("mode", sorted(CORRECTIONS))
def test_rollout_correction_matches_reference(name, mode):
    for seed in range(3):
        batch = make_batch(scale=0.2, seed=seed, rollout=True)
        assert_matches(name, batch, correction_config(name, mode))


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("mode", sorted(CORRECTIONS))
def test_bypass_mode_correction_matches_reference(name, mode):
    """mu = the engine's log-probs (verl's bypass mode): the correction's ratio is pi_theta / pi_rollout and, for a
    loss with a ratio of its own, only its rejection part applies; a truncation or IcePop there is refused."""
    for seed in range(3):
        batch = make_batch(scale=0.2, seed=seed)
        for overrides in ([{}, {"is_level": "none"}] if name == "reinforce" else [{}]):
            cfg = correction_config(name, mode, **overrides)
            if cfg.bypass_refusal():
                with pytest.raises(ValueError, match="cannot act with mu = the engine's log-probs"):
                    run_both(name, batch, cfg, bypass=True)
                continue
            assert_matches(name, batch, cfg, bypass=True)


@pytest.mark.parametrize("name", loss_names())
@pytest.mark.parametrize("delta", [0.0, 0.1, 1e3])
def test_opsm_matches_reference(name, delta):
    """OPSM on every loss, with mu recomputed and in bypass mode, sequence and token advantages."""
    options = {"eps_low": 0.2, "eps_high": 0.3} if name in ("gspo", "luspo") else {}  # GSPO's own 3e-4 leaves OPSM no room
    if name in ("gspo", "luspo") and math.exp(-delta) <= 1 - options["eps_low"]:
        with pytest.raises(ValueError, match="cannot change GSPO's update"):
            get_loss(name).config_cls(opsm_delta=delta, **options)
        return
    for seed, token_adv, bypass in itertools.product(range(2), (False, True), (False, True)):
        batch = make_batch(scale=0.3, seed=seed, token_adv=token_adv)
        assert_matches(name, batch, get_loss(name).config_cls(opsm_delta=delta, **options), bypass=bypass)


def test_geo_mask_band_splits_the_reference_batches():
    """The geo_mask comparison above is not vacuous: its band keeps some sequences and masks others."""
    kept = []
    for seed in range(3):
        batch = to_lists(make_batch(scale=0.2, seed=seed, rollout=True))
        rc = get_loss("grpo").config_cls(rollout_correction={"mode": "geo_mask", **CORRECTIONS["geo_mask"]})
        source = SimpleNamespace(base=batch["old_logp"], rollout=batch["rollout_logp"])
        kept += [geo_kept(source, batch["mask"], rc.rollout_correction, i)
                 for i in range(len(batch["mask"]) - 1)]  # the last row is empty
    assert 0 < sum(kept) < len(kept)


FILTERED = sorted(mode for mode in CORRECTIONS if "_rs_" in mode)  # a rejection on top of an importance weight


@pytest.mark.parametrize("mode", FILTERED)
def test_each_rejection_on_an_importance_weight_splits_the_reference_batches(mode):
    """The comparisons of the combined modes above are not vacuous: on their batches the rejection keeps some valid
    tokens and rejects others, and it changes the update of the importance weight alone."""
    kept = []
    for seed in range(3):
        batch = make_batch(scale=0.2, seed=seed, rollout=True)
        rc = correction_config("grpo", mode).rollout_correction
        lists = to_lists(batch)
        source = SimpleNamespace(base=lists["old_logp"], rollout=lists["rollout_logp"])
        kept += [k for i, row in enumerate(lists["mask"])
                 for k, m in zip(reject_kept(source, lists["mask"], rc, i), row) if m]
        alone = {key: value for key, value in CORRECTIONS[mode].items() if not key.startswith("reject")}
        _, filtered, _, _ = run_both("grpo", batch, correction_config("grpo", mode))
        _, plain, _, _ = run_both("grpo", batch, get_loss("grpo").config_cls(rollout_correction=alone))
        assert not torch.allclose(filtered, plain, rtol=1e-6)
    assert 0 < sum(kept) < len(kept)


@pytest.mark.parametrize("name", ["grpo", "vespo"])
def test_reference_catches_a_k1_band_read_the_other_way(name):
    """Mutation test: the k1 band [reject_low, reject_high] is on pi_rollout / pi_old (verl's k1 = -log r); the loss
    run with the band read on pi_old / pi_rollout (low and high swapped and inverted) is caught by the reference."""
    rc = {"mode": "tis_seq", "threshold": 1.5, "reject_by": "seq_mean_k1", "reject_low": 0.95, "reject_high": 1.3}
    swapped = {**rc, "reject_low": 1 / 1.3, "reject_high": 1 / 0.95}
    caught = 0
    for seed in range(3):
        batch = make_batch(scale=0.2, seed=seed, rollout=True)
        _, grad, _, _ = run_both(name, batch, get_loss(name).config_cls(rollout_correction=swapped))
        _, _, _, ref_grad = run_both(name, batch, get_loss(name).config_cls(rollout_correction=rc))
        caught += not torch.allclose(grad, ref_grad, rtol=1e-6)
    assert caught == 3


@pytest.mark.parametrize("name,overrides,metric", [
    ("dppo", {}, "loss/trust_mask_frac_high"), ("dppo", {}, "loss/trust_mask_frac_low"),
    ("dppo", {"divergence": "kl"}, "loss/trust_mask_frac_high"), ("dppo", {"divergence": "kl"}, "loss/trust_mask_frac_low"),
    ("m2po", {}, "loss/m2_mask_frac"), ("m2po", {"m2_threshold": 0.5}, "loss/m2_mask_frac"),
])
def test_trust_regions_bind_in_the_reference_batches(name, overrides, metric):
    """At log-ratio scale 1 the DPPO and M2PO masks drop some tokens and keep others, so the reference
    comparison covers both branches."""
    fractions = []
    for seed, token_adv in itertools.product(range(2), (False, True)):
        batch = make_batch(scale=1.0, seed=seed, token_adv=token_adv)
        out = call_loss(get_loss(name), cfg=get_loss(name).config_cls(**overrides), **batch)
        fractions.append(out.metrics[metric].item())
    assert 0 < max(fractions) and min(fractions) < 1


def test_reference_disagrees_with_a_wrong_loss():
    """The comparison can fail: a VESPO with the wrong (k, lam) pair for A >= 0 is caught."""
    batch = make_batch(scale=0.3, seed=3)
    right = get_loss("vespo").config_cls()
    wrong = get_loss("vespo").config_cls(k_pos=right.k_neg, lambda_pos=right.lambda_neg)
    loss, grad, _, _ = run_both("vespo", batch, wrong)
    _, _, ref_loss, ref_grad = run_both("vespo", batch, right)
    assert not torch.allclose(grad, ref_grad, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("pad", ["zero", "garbage"])
def test_finite_padding_takes_the_fast_path_and_still_matches(name, pad):
    """Clean (finite) padding skips the NaN-cleaning path; values must not depend on it."""
    for scale, rollout in ((0.1, False), (8.0, False), (0.3, True)):
        batch = make_batch(scale=scale, seed=11, pad=pad, rollout=rollout)
        mode = "tis_token" if rollout else "none"
        cfg = get_loss(name).config_cls(rollout_correction={"mode": mode, "threshold": 1.5})
        assert_matches(name, batch, cfg)
        nan_batch = make_batch(scale=scale, seed=11, pad="nan", rollout=rollout)
        a, ga, _, _ = run_both(name, batch, cfg)
        b, gb, _, _ = run_both(name, nan_batch, cfg)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("tau", [1e-3, 0.04, 0.5, 1e3])
def test_m2po_mask_is_areals_rule(tau):
    """The mask itself against AReaL's rule (areal/trainer/ppo/actor.py `_get_m2po_loss_mask`, written again
    in reference.m2po_kept): sort the valid tokens' (log r)^2 descending, mask the first k, k the first index
    whose suffix mean is < tau, or all but one if none is. Over scales from on-policy-like to far off, tau from
    "mask almost all" (the all-but-one path) to "mask none"."""
    from vespo.losses.m2po import second_moment_mask

    masked_counts = set()
    for seed, scale in itertools.product(range(6), (0.01, 0.3, 3.0)):
        batch = make_batch(B=5, T=6, scale=scale, seed=seed)
        lists = to_lists(batch)
        m2 = torch.where(batch["mask"], batch["logp"] - batch["old_logp"], 0.0).square()
        keep = second_moment_mask(m2, batch["mask"], tau)
        expected = m2po_kept(lists["logp"], lists["old_logp"], lists["mask"], tau)
        assert {tuple(ij) for ij in keep.nonzero().tolist()} == expected
        masked_counts.add(int(batch["mask"].sum() - keep.sum()))
    if tau > 100:  # (log r)^2 averages far below it: nothing masked
        assert masked_counts == {0}
    else:  # the rule masked different numbers of tokens across these batches
        assert len(masked_counts) > 1


MUTATIONS = {  # name -> (the options the loss runs with, the options the reference is told: one change each)
    "luspo": ({"agg": "seq-mean-token-sum"}, {"agg": "seq-mean-token-mean"}),  # the length weighting dropped
    "gmpo": ({}, {"eps_high": 0.1}),
    "dro": ({}, {"beta": 0.2}),
    "ipo": ({}, {"delta": 0.05}),
    "topr": ({}, {"negative_weight": 0.5}),
    "kl_cov": ({"kl_cov_ratio": 0.2}, {"kl_cov_ratio": 0.1}),
    "clip_cov": ({"clip_cov_ratio": 0.3, "clip_cov_lb": 0.05, "clip_cov_ub": 2.0},
                 {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.05, "clip_cov_ub": 2.0}),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_reference_catches_a_changed_loss(name):
    """Mutation test: each peer loss, run with one option changed from what the reference is told, is caught, so
    the comparisons above can fail (the changes: LUSPO without its length weighting, a tighter GMPO clip, DRO's
    beta doubled, IPO's trust region halved, TOPR's negative weight halved, fewer KL-Cov / Clip-Cov tokens)."""
    batch = make_batch(scale=1.0, seed=3)
    ran, told = (get_loss(name).config_cls(**options) for options in MUTATIONS[name])
    loss, grad, _, _ = run_both(name, batch, ran)
    _, _, ref_loss, ref_grad = run_both(name, batch, told)
    assert not torch.allclose(grad, ref_grad, rtol=1e-6)
    _, _, same_loss, same_grad = run_both(name, batch, ran)
    torch.testing.assert_close(grad, same_grad, rtol=1e-9, atol=1e-12)


def test_nomu_ignores_the_behaviour_policy_and_is_caught_when_changed():
    """NoMu's W depends on pi alone: any old_logp gives the same update (and the reference agrees); a different
    group size is caught by the reference (mutation); a call without whole groups is refused."""
    batch = make_batch(scale=0.5, seed=4)
    cfg = get_loss("vespo").config_cls(nomu_group=2)
    loss, grad, ref_loss, ref_grad = run_both("vespo", batch, cfg)
    other = {**batch, "old_logp": batch["old_logp"] - 3.0}
    loss2, grad2, _, _ = run_both("vespo", other, cfg)
    torch.testing.assert_close(grad2, grad, rtol=1e-12, atol=1e-15)
    _, _, _, ref_grad3 = run_both("vespo", batch, get_loss("vespo").config_cls(nomu_group=3))
    assert not torch.allclose(grad, ref_grad3, rtol=1e-6)
    _, plain, _, _ = run_both("vespo", batch, get_loss("vespo").config_cls())
    assert not torch.allclose(grad, plain, rtol=1e-6)  # it acts
    with pytest.raises(ValueError, match="nomu_group=4 needs whole groups"):
        run_both("vespo", batch, get_loss("vespo").config_cls(nomu_group=4))  # 6 rows
    with pytest.raises(ValueError, match="nomu_group must be None or an integer >= 2"):
        get_loss("vespo").config_cls(nomu_group=1)
