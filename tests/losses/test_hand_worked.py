"""Small examples worked out by hand, with the arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from vespo.losses import aggregate, ess_step_scale, get_loss

from .batches import call_loss

LOGP = [[-1.0, -2.0, -0.5]]  # one sequence, three tokens; sum = -3.5
MASK = torch.ones(1, 3, dtype=torch.bool)


def three_tokens(log_ratio=0.1):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    old = logp.detach() - log_ratio  # every token has logp - old = 0.1, so log W = 0.3
    return logp, old


def run(name, adv, **cfg):
    logp, old = three_tokens()
    spec = get_loss(name)
    out = call_loss(spec, logp, old, torch.tensor([adv], dtype=torch.float64), MASK, spec.config_cls(**cfg))
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


def test_vespo_positive_advantage_three_tokens():
    # W = e^0.3 = 1.3498588075760032; A = +1 uses (k, lam) = (2, 3):
    # log phi = lam + k log W - lam W = 3 + 2(0.3) - 3(1.3498588075760032) = -0.449576422728009
    # phi = e^-0.449576422728009 = 0.637898293623749
    # token-mean loss = -phi * A * (-1 - 2 - 0.5) / 3 = 0.637898293623749 * 3.5 / 3 = 0.7442146758943737
    # gradient per token = -phi * A / 3 = -0.21263276454124967
    out, grad = run("vespo", 1.0)
    assert out.loss.item() == pytest.approx(0.7442146758943737, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([-0.637898293623749 / 3] * 3, rel=1e-12)
    assert out.metrics["vespo/phi_pos_mean"].item() == pytest.approx(0.637898293623749, rel=1e-12)
    assert out.metrics["vespo/n_neg"].item() == 0  # empty split reported as 0 with its count
    assert out.metrics["vespo/phi_neg_mean"].item() == 0


def test_vespo_negative_advantage_three_tokens():
    # A = -1 uses (k, lam) = (3, 2): log phi = 2 + 3(0.3) - 2(1.3498588075760032) = 0.20028238484799354
    # phi = e^0.20028238484799354 = 1.2217477124950182 (the A<0 kernel peaks at W = 3/2, so W = 1.35 gets > 1)
    # loss = -phi * (-1) * (-3.5) / 3 = -1.425372331244188; gradient per token = +phi / 3
    out, grad = run("vespo", -1.0)
    assert out.loss.item() == pytest.approx(-1.425372331244188, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([1.2217477124950182 / 3] * 3, rel=1e-12)
    assert out.metrics["vespo/phi_neg_max"].item() == pytest.approx(1.2217477124950182, rel=1e-12)


def test_grpo_clips_high_ratio_for_positive_advantage():
    # r = e^0.1 = 1.1051709 < 1 + 0.2: inside the clip range, so l = -A r per token.
    # token-mean loss = -(1.1051709180756477); gradient = -A r / 3 per token.
    out, grad = run("grpo", 1.0)
    assert out.loss.item() == pytest.approx(-1.1051709180756477, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([-1.1051709180756477 / 3] * 3, rel=1e-12)
    # with eps_high = 0.05 the bound 1.05 < r binds: loss = -1.05, gradient 0, clip_frac_high = 1
    out, grad = run("grpo", 1.0, eps_high=0.05)
    assert out.loss.item() == pytest.approx(-1.05, rel=1e-12)
    assert grad.abs().max().item() == 0.0
    assert out.metrics["loss/clip_frac_high"].item() == 1.0


def test_sapo_gate_three_tokens():
    # r = 1.1051709180756477, tau_pos = 1: sig = sigmoid(0.1051709) = 0.5262685211427047
    # gate = 4 sig / tau = 2.105074084570819 = per-token loss magnitude; loss = -A gate (seq-mean-token-mean)
    # d/dlogp = -A 4 sig (1 - sig) r = -1.1021204907203224, divided by the 3 tokens of the one sequence
    out, grad = run("sapo", 1.0)
    assert out.loss.item() == pytest.approx(-2.105074084570819, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([-1.1021204907203224 / 3] * 3, rel=1e-12)


def test_cispo_truncates_weight_but_keeps_gradient():
    # eps_high = 0.05: weight = min(1.10517, 1.05) = 1.05; loss = -1.05 * A * (-3.5) / 3 = 1.225
    # gradient = -1.05 * A / 3 = -0.35 on every token (CISPO never zeroes a token's gradient)
    out, grad = run("cispo", 1.0, eps_high=0.05)
    assert out.loss.item() == pytest.approx(1.225, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([-0.35] * 3, rel=1e-12)


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])  # [3, 3]
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # 4 valid tokens, 2 non-empty rows
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: ((1+2+3)/3 + 4/1) / 2 = (2 + 4) / 2 = 3
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum: (6 + 4) / 2 = 5; with normalizer 10 sequences: 10 / 10 = 1
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate(loss, mask, "seq-mean-token-sum", normalizer=10).item() == pytest.approx(1.0)


def test_tis_token_truncates_rollout_weight_by_hand():
    # pi_old / pi_rollout per token = e^1 = 2.718 (> C = 2, truncated to 2), e^-1 = 0.3679, 1.
    # reinforce without IS (on-policy logp == old): token-mean loss = -A * sum_t w_t logp_t / 3
    # = -(2 * -1 + 0.36787944117144233 * -2 + 1 * -0.5) / 3 = 1.0785862941143141
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    rollout = logp.detach() - torch.tensor([[1.0, -1.0, 0.0]], dtype=torch.float64)
    spec = get_loss("reinforce")
    cfg = spec.config_cls(is_level="none", rollout_correction={"mode": "tis_token", "threshold": 2.0})
    out = call_loss(spec, logp, logp.detach(), torch.ones(1, dtype=torch.float64), MASK, cfg, rollout_logp=rollout)
    assert out.loss.item() == pytest.approx((2 + 2 * math.exp(-1) + 0.5) / 3, rel=1e-12)
    # mis_token drops the e^1 token instead: -(0 + e^-1 * -2 + -0.5) / 3
    cfg = spec.config_cls(is_level="none", rollout_correction={"mode": "mis_token", "threshold": 2.0})
    out = call_loss(spec, logp, logp.detach(), torch.ones(1, dtype=torch.float64), MASK, cfg, rollout_logp=rollout)
    assert out.loss.item() == pytest.approx((2 * math.exp(-1) + 0.5) / 3, rel=1e-12)


def test_a_rejection_on_top_of_token_tis_by_hand():
    # verl's decoupled_k3_rs_token_tis: token TIS (C = 2) times the seq_mean_k3 rejection (bound 0.01), two rows.
    # Row 1: log(pi_old / pi_rollout) = 1, -1, 0: k3 = e^x - 1 - x = 0.718, 0.368, 0, mean 0.362 > 0.01: rejected.
    # Row 2: 0.1, -0.1, 0: k3 mean 0.00334 <= 0.01: kept, w = e^0.1, e^-0.1, 1 (none truncated).
    # reinforce without IS, A = +1, token-mean over all 6 tokens (vespo keeps the rejected ones in the count; verl
    # drops them from its response mask, which would divide by 3): loss = (e^0.1 + 2 e^-0.1 + 0.5) / 6
    logp = torch.tensor(LOGP * 2, dtype=torch.float64, requires_grad=True)
    rollout = logp.detach() - torch.tensor([[1.0, -1.0, 0.0], [0.1, -0.1, 0.0]], dtype=torch.float64)
    spec, mask = get_loss("reinforce"), torch.ones(2, 3, dtype=torch.bool)
    rc = {"mode": "tis_token", "threshold": 2.0, "reject_by": "seq_mean_k3", "reject_high": 0.01}
    out = call_loss(spec, logp, logp.detach(), torch.ones(2, dtype=torch.float64), mask,
                    spec.config_cls(is_level="none", rollout_correction=rc), rollout_logp=rollout)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert out.loss.item() == pytest.approx(0.5691409590245945, rel=1e-12)
    assert sum(grad.tolist(), []) == pytest.approx([0.0] * 3 + [-0.18419515301260794, -0.15080623633932658, -1 / 6],
                                                    rel=1e-12)
    assert out.metrics["rollout/masked_frac"].item() == 0.5
    assert out.metrics["rollout/truncated_frac"].item() == pytest.approx(1 / 6)  # row 1's e^1 > 2, rejected anyway


def test_a_k1_rejection_bands_pi_rollout_over_pi_old_by_hand():
    # verl's k1 = -log r = log(pi_rollout / pi_old) is kept in [log reject_low, log reject_high]: an asymmetric band
    # [0.5, 1.2] on pi_rollout / pi_old. Sequence TIS (C = 2) with seq_sum_k1: row 1 sums log(pi_old / pi_rollout)
    # = 0.5 (pi_rollout / pi_old = e^-0.5 = 0.61, kept, w = e^0.5 = 1.6487), row 2 sums -0.3 (e^0.3 = 1.35 > 1.2,
    # rejected). The band read the other way (on pi_old / pi_rollout, low and high swapped and inverted) would reject
    # row 1 (e^0.5 > 1.2) and keep row 2. reinforce without IS, A = +1, token-mean over 6:
    # loss = e^0.5 * 3.5 / 6, gradient -e^0.5 / 6 on row 1's tokens, 0 on row 2's
    logp = torch.tensor(LOGP * 2, dtype=torch.float64, requires_grad=True)
    rollout = logp.detach() - torch.tensor([[0.2, 0.2, 0.1], [-0.1, -0.1, -0.1]], dtype=torch.float64)
    spec, mask = get_loss("reinforce"), torch.ones(2, 3, dtype=torch.bool)
    rc = {"mode": "tis_seq", "threshold": 2.0, "reject_by": "seq_sum_k1", "reject_low": 0.5, "reject_high": 1.2}
    out = call_loss(spec, logp, logp.detach(), torch.ones(2, dtype=torch.float64), mask,
                    spec.config_cls(is_level="none", rollout_correction=rc), rollout_logp=rollout)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert out.loss.item() == pytest.approx(0.9617540745750747, rel=1e-12)
    assert sum(grad.tolist(), []) == pytest.approx([-0.27478687845002137] * 3 + [0.0] * 3, rel=1e-12)


def test_a_rejection_bound_that_cannot_act_is_refused_in_one_line():
    # reject_low / reject_high bound reject_by's statistic: without it (or on a mode it cannot filter) they are refused
    from vespo.losses.rollout_correction import RolloutCorrection
    cases = [({"mode": "tis_token", "reject_low": 0.5}, "rollout_correction.reject_low cannot act without "
              "rollout_correction.reject_by"),
             ({"mode": "mis_seq", "reject_high": 2.0}, "rollout_correction.reject_high cannot act without"),
             ({"mode": "geo_mask", "reject_by": "seq_mean_k3", "reject_high": 0.01}, "rollout_correction.reject_by "
              "applies to mode reject, tis_token"),
             ({"mode": "none", "reject_high": 0.01}, "rollout_correction.reject_high applies to mode"),
             ({"mode": "tis_token", "reject_by": "seq_mean_k3"}, "rollout_correction.reject_high .* is required"),
             ({"mode": "icepop", "reject_by": "token_k2", "reject_high": 0.1, "reject_low": 0.01},
              "rollout_correction.reject_low applies to a k1 option only"),
             ({"mode": "tis_seq", "reject_by": "seq_mean_k1", "reject_low": 2.0, "reject_high": 1.5},
              r"rollout_correction.reject_low must be a finite number in \(0, reject_high\]")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            RolloutCorrection(**options)
        assert "\n" not in str(error.value)


# ---- the newer methods: DPPO, M2PO, geometric sequence masking, VCPO's step size

DPPO_LOGP, DPPO_OLD = [[-0.2, -2.0, -0.5]], [[-1.0, -2.3, -0.6]]


def dppo_run(adv, **cfg):
    logp = torch.tensor(DPPO_LOGP, dtype=torch.float64, requires_grad=True)
    spec = get_loss("dppo")
    out = call_loss(spec, logp, torch.tensor(DPPO_OLD, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64), MASK,
                  spec.config_cls(**cfg))
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_masks_the_token_whose_probability_rose_too_far(divergence):
    # p = e^logp = 0.81873, 0.13534, 0.60653;  q = e^old = 0.36788, 0.10026, 0.54881
    # tv: p - q = 0.45085 (> 0.15: outside), 0.03508, 0.05772 (inside)
    # kl: q log(q/p) + (1-q) log((1-q)/(1-p)) = 0.49528 (> 0.05 and p > q: outside), 0.00570, 0.00688 (inside)
    # A = +1, ratios r = e^0.8, e^0.3 = 1.3498588, e^0.1 = 1.1051709; token-mean over 3 tokens:
    # loss = (1/3)(0 - 1.3498588 * (-2.0) - 1.1051709 * (-0.5)) = 1.0841010247299434
    # gradient = -A r / 3 on the kept tokens: 0, -0.44995293585866775, -0.3683903060252159
    out, grad = dppo_run(1.0, divergence=divergence)
    assert out.loss.item() == pytest.approx(1.0841010247299434, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, -0.44995293585866775, -0.3683903060252159], rel=1e-12)
    assert out.metrics["loss/trust_mask_frac_high"].item() == pytest.approx(1 / 3)
    assert out.metrics["loss/trust_mask_frac_low"].item() == 0.0


def test_dppo_judges_each_side_by_the_advantage():
    # the same tokens with A = -1: every probability rose, so none left the region on the side A < 0 pushes
    # loss = (1/3) sum_t r_t logp_t = (2.2255409 * -0.2 + 1.3498588 * -2.0 + 1.1051709 * -0.5) / 3 = -1.23247042
    # gradient = +r / 3 = 0.741846976164156, 0.44995293585866775, 0.3683903060252159
    out, grad = dppo_run(-1.0)
    assert out.loss.item() == pytest.approx(-1.2324704199627747, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.741846976164156, 0.44995293585866775, 0.3683903060252159], rel=1e-12)
    assert out.metrics["loss/trust_mask_frac_low"].item() == 0.0
    # a ratio cap of 2 truncates the first token's weight e^0.8 = 2.2255 to 2: its gradient becomes 2 / 3
    out, grad = dppo_run(-1.0, ratio_cap=2.0)
    assert grad[0, 0].item() == pytest.approx(2 / 3, rel=1e-12)
    assert out.metrics["loss/ratio_cap_frac"].item() == pytest.approx(1 / 3)


def test_m2po_masks_the_largest_log_ratio_until_the_second_moment_fits():
    # log r = 0.5, 0.1, -0.1, 0.05: (log r)^2 = 0.25, 0.01, 0.01, 0.0025, mean 0.068125 >= tau = 0.04;
    # masking the largest leaves mean (0.01 + 0.01 + 0.0025) / 3 = 0.0075 < 0.04, so exactly one is masked.
    # A = +1, token-mean over all 4 tokens (the masked one stays in the count):
    # loss = -(e^0.1 + e^-0.1 + e^0.05) / 4 = -0.7653198581219078; gradient -r / 4 on the kept tokens
    log_r = torch.tensor([[0.5, 0.1, -0.1, 0.05]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0, -0.5, -0.3]], dtype=torch.float64, requires_grad=True)
    spec = get_loss("m2po")
    out = call_loss(spec, logp, logp.detach() - log_r, torch.ones(1, dtype=torch.float64), torch.ones(1, 4, dtype=torch.bool),
                  spec.config_cls())
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert out.loss.item() == pytest.approx(-0.7653198581219078, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, -0.27629272951891193, -0.22620935450898988, -0.26281777409400603],
                                             rel=1e-12)
    assert out.metrics["m2po/m2"].item() == pytest.approx(0.068125, rel=1e-12)
    assert out.metrics["m2po/m2_kept"].item() == pytest.approx(0.0075, rel=1e-12)
    assert out.metrics["loss/m2_mask_frac"].item() == 0.25


def test_geo_mask_drops_a_sequence_outside_the_band():
    # log(pi_old / pi_rollout) per token = 0.03, -0.01, 0.01: mean 0.01 > log 1.01 = 0.00995, so the geometric
    # mean 1.01005 leaves the default band [0.99, 1.01] and the sequence is masked (loss 0); [0.98, 1.02] keeps it
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    rollout = logp.detach() - torch.tensor([[0.03, -0.01, 0.01]], dtype=torch.float64)
    spec, adv = get_loss("reinforce"), torch.ones(1, dtype=torch.float64)
    masked = call_loss(spec, logp, logp.detach(), adv, MASK, spec.config_cls(is_level="none", rollout_correction={
        "mode": "geo_mask"}), rollout_logp=rollout)
    assert masked.loss.item() == 0.0 and masked.metrics["rollout/masked_frac"].item() == 1.0
    kept = call_loss(spec, logp, logp.detach(), adv, MASK, spec.config_cls(is_level="none", rollout_correction={
        "mode": "geo_mask", "geo_low": 0.98, "geo_high": 1.02}), rollout_logp=rollout)
    assert kept.loss.item() == pytest.approx(3.5 / 3, rel=1e-12)  # -A * sum(logp) / 3, unweighted
    assert kept.metrics["rollout/masked_frac"].item() == 0.0
    # VESPO adds log 1e-8 to the masked sequence's log W = 0.3: log W = -18.120680743952366 and, A = +1,
    # phi = exp(3 + 2 log W - 3 W) = 3.6598232961604505e-15
    logp, old = three_tokens()
    vespo = get_loss("vespo")
    out = call_loss(vespo, logp, old, adv, MASK, vespo.config_cls(rollout_correction={"mode": "geo_mask"}),
                   rollout_logp=old - torch.tensor([[0.03, -0.01, 0.01]], dtype=torch.float64))
    assert out.metrics["vespo/phi_pos_max"].item() == pytest.approx(3.6598232961604505e-15, rel=1e-9)


def test_ess_step_scale_by_hand():
    # W = 1 and 3 (the third row has no token and does not count): ESS / B = (1 + 3)^2 / (2 (1 + 9)) = 0.8,
    # scale = sqrt(0.8) = 0.8944271909999159; all W equal: ESS / B = 1, scale 1
    rows = {"log_w": torch.tensor([0.0, math.log(3.0), 5.0], dtype=torch.float64),
            "tokens": torch.tensor([2.0, 3.0, 0.0], dtype=torch.float64)}
    assert ess_step_scale(rows).item() == pytest.approx(0.8944271909999159, rel=1e-12)
    rows["log_w"] = torch.full((3,), -2.5, dtype=torch.float64)
    assert ess_step_scale(rows).item() == pytest.approx(1.0, rel=1e-12)


# ---- the field's 2026 methods: OPSM, IcePop, prime-rl's loss, Dr.GRPO's aggregation; bypass mode; edges


def reinforce_none(logp, old, adv, **cfg):
    """reinforce with is_level=none (-A * logp per token, token-mean over LOGP's 3 tokens) and its gradient."""
    spec = get_loss("reinforce")
    out = call_loss(spec, logp, old, torch.tensor([adv], dtype=torch.float64), MASK,
                    spec.config_cls(is_level="none", **cfg.pop("options", {})), **cfg)
    return out, torch.autograd.grad(out.loss, logp)[0]


def test_opsm_masks_a_negative_sequence_whose_policy_moved_away_by_hand():
    # log(mu / pi_theta) per token = 0.3, 0.1, -0.1: mean d = 0.1. A = -1 and delta = 0.05 < 0.1: masked (loss 0,
    # no gradient, the tokens still count); delta = 0.2 >= 0.1: kept, reinforce's loss -A sum(logp) / 3 = -3.5 / 3;
    # A = +1 is never masked: loss 3.5 / 3
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    old = logp.detach() + torch.tensor([[0.3, 0.1, -0.1]], dtype=torch.float64)
    out, grad = reinforce_none(logp, old, -1.0, options={"opsm_delta": 0.05})
    assert out.loss.item() == 0.0 and grad.abs().sum() == 0 and out.metrics["loss/opsm_mask_frac"].item() == 1.0
    out, _ = reinforce_none(logp, old, -1.0, options={"opsm_delta": 0.2})
    assert out.loss.item() == pytest.approx(-3.5 / 3, rel=1e-12) and out.metrics["loss/opsm_mask_frac"].item() == 0
    out, _ = reinforce_none(logp, old, 1.0, options={"opsm_delta": 0.05})
    assert out.loss.item() == pytest.approx(3.5 / 3, rel=1e-12)


def test_icepop_zeroes_a_token_outside_the_band_by_hand():
    # log(pi_old / pi_rollout) = 0.8, 0, -0.8: rho = 2.225540928492468, 1, 0.44932896411722156; band [0.5, 5]
    # keeps the first two at their ratio and zeroes the third. reinforce without IS, A = +1:
    # loss = -(2.225540928492468 * -1 + 1 * -2 + 0 * -0.5) / 3 = 1.4085136428308227; gradient -w / 3
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    rollout = logp.detach() - torch.tensor([[0.8, 0.0, -0.8]], dtype=torch.float64)
    out, grad = reinforce_none(logp, logp.detach(), 1.0, options={"rollout_correction": {"mode": "icepop"}},
                               rollout_logp=rollout)
    assert out.loss.item() == pytest.approx(1.4085136428308227, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([-2.225540928492468 / 3, -1 / 3, 0.0], rel=1e-12)
    assert out.metrics["rollout/masked_frac"].item() == pytest.approx(1 / 3)


def test_bypass_mode_weighs_by_pi_theta_over_pi_rollout_by_hand():
    # mu = the engine's log-probs = logp - (0.5, 0.2, -0.9): rho = pi_theta / pi_rollout = e^0.5 = 1.6487212707001282,
    # e^0.2 = 1.2214027581601699, e^-0.9 = 0.4065696597405991; tis_token (C = 2) truncates none of them.
    # reinforce with is_level=none has no ratio of its own, so it takes the whole weight (verl's bypass REINFORCE):
    # gradient -A w / 3 = -w / 3. With is_level=token the loss's own ratio is that weight: tis_token is refused
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    engine = logp.detach() - torch.tensor([[0.5, 0.2, -0.9]], dtype=torch.float64)
    tis = {"rollout_correction": {"mode": "tis_token", "threshold": 2.0}}
    out, grad = reinforce_none(logp, engine, 1.0, options=tis, bypass=True)
    w = [math.exp(0.5), math.exp(0.2), math.exp(-0.9)]
    assert grad.tolist()[0] == pytest.approx([-x / 3 for x in w], rel=1e-12)
    spec = get_loss("reinforce")
    with pytest.raises(ValueError, match="cannot act with mu = the engine's log-probs"):
        call_loss(spec, logp, engine, torch.ones(1, dtype=torch.float64), MASK, spec.config_cls(**tis), bypass=True)


def test_icepop_masks_on_pi_old_over_pi_rollout_not_on_pi_theta_by_hand():
    # The paper's IcePop: the band is on the two engines' ratio at theta_old, pi_old / pi_rollout, never on
    # pi_theta. log(pi_old / pi_rollout) = 0.8, 0, -0.8 (rho = 2.225540928492468, 1, 0.44932896411722156) while
    # pi_theta has moved so that pi_theta / pi_rollout = e^2, e^0, e^0 (the first token outside [0.5, 5], the
    # third inside): the mask still keeps tokens 1-2 and zeroes token 3. grpo (eps 0.2, dual clip 3), A = +1,
    # token-mean over 3: r = pi_theta / pi_old = e^1.2, 1, e^0.8; tokens 1 and 3 are clipped at 1.2 (no
    # gradient), token 2 is r = 1: loss = -(2.225540928492468 * 1.2 + 1 * 1 + 0 * 1.2) / 3, gradient (0, -1/3, 0)
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    rollout = logp.detach() - torch.tensor([[2.0, 0.0, 0.0]], dtype=torch.float64)
    old = rollout + torch.tensor([[0.8, 0.0, -0.8]], dtype=torch.float64)
    spec = get_loss("grpo")
    out = call_loss(spec, logp, old, torch.ones(1, dtype=torch.float64), MASK,
                    spec.config_cls(rollout_correction={"mode": "icepop"}), rollout_logp=rollout)
    grad = torch.autograd.grad(out.loss, logp)[0]
    assert out.loss.item() == pytest.approx(-(2.225540928492468 * 1.2 + 1.0) / 3, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.0, -1 / 3, 0.0], abs=1e-15)
    assert out.metrics["rollout/masked_frac"].item() == pytest.approx(1 / 3)


def test_icepop_with_mu_from_the_engine_is_refused_on_a_loss_with_its_own_ratio():
    # mu = pi_rollout (bypass mode) leaves no pi_old: IcePop's ratio pi_old / pi_rollout cannot be formed. verl's
    # bypass PPO-clip then drops IcePop (plain PPO); vespo refuses it with one line naming the fields. reinforce
    # with is_level=none has no ratio of its own and takes IcePop's whole weight of pi_theta / pi_rollout (verl's
    # bypass REINFORCE): e^0.5, e^0.2 kept, e^-0.9 = 0.4065696597405991 < 0.5 zeroed
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    engine = logp.detach() - torch.tensor([[0.5, 0.2, -0.9]], dtype=torch.float64)
    icepop = {"rollout_correction": {"mode": "icepop"}}
    for name in ("grpo", "vespo", "reinforce"):
        spec = get_loss(name)
        refusal = spec.config_cls(**icepop).bypass_refusal()
        assert refusal is not None and "\n" not in refusal
        for words in ("rollout_correction.mode=icepop", "staleness.behavior=rollout", "pi_old / pi_rollout",
                      "staleness.behavior=recompute", "is_level=none"):
            assert words in refusal, (name, words)
        with pytest.raises(ValueError, match="cannot act with mu = the engine's log-probs"):
            call_loss(spec, logp, engine, torch.ones(1, dtype=torch.float64), MASK, spec.config_cls(**icepop),
                      bypass=True)
    out, grad = reinforce_none(logp, engine, 1.0, options=icepop, bypass=True)
    assert grad.tolist()[0] == pytest.approx([-math.exp(0.5) / 3, -math.exp(0.2) / 3, 0.0], rel=1e-12)
    assert out.metrics["rollout/masked_frac"].item() == pytest.approx(1 / 3)


def test_prime_rl_loss_by_hand():
    # token 1: pi = 0.5, mu = 0.2: dp = 0.3 > 0.2 with A = +1, outside: only the penalty
    #          l = 1e-3 (log 2.5)^2 = 8.395887053765e-4, d l / d logp = 2e-3 log 2.5 = 1.8325814637483e-3
    # token 2: pi = 0.3, mu = 0.25: dp = 0.05, kept; r = 1.2: l = -1.2 + 1e-3 (log 1.2)^2 = -1.1999667583...,
    #          d l / d logp = -1.2 + 2e-3 log 1.2 = -1.1996353568...
    # token-mean over the 2 tokens: loss = (l1 + l2) / 2, gradient (d1, d2) / 2
    logp = torch.tensor([[math.log(0.5), math.log(0.3)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.2), math.log(0.25)]], dtype=torch.float64)
    spec = get_loss("prime_rl")
    out = call_loss(spec, logp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool),
                    spec.config_cls())
    (grad,) = torch.autograd.grad(out.loss, logp)
    l1, l2 = 1e-3 * math.log(2.5) ** 2, -1.2 + 1e-3 * math.log(1.2) ** 2
    assert out.loss.item() == pytest.approx((l1 + l2) / 2, rel=1e-12)
    assert grad.tolist()[0] == pytest.approx([1e-3 * math.log(2.5), (-1.2 + 2e-3 * math.log(1.2)) / 2], rel=1e-12)
    assert out.metrics["loss/trust_mask_frac_high"].item() == 0.5


def test_dr_grpo_aggregation_by_hand():
    # token sums 1 + 2 + 3 = 6 and 4; two sequences and C = 4: (6 + 4) / (2 * 4) = 1.25, whatever the lengths
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=4.0).item() == pytest.approx(1.25)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", normalizer=5, norm_length=4.0).item() == pytest.approx(0.5)


def test_geo_mask_token_clamp_follows_skyrl_or_verl_by_hand():
    # log(pi_old / pi_rollout) = +50, -49: SkyRL's mean 0.5 leaves [0.99, 1.01] (masked); verl clamps each to +-20
    # first: mean 0, kept
    from vespo.losses.rollout_correction import RolloutCorrection, geo_keep

    d = -torch.tensor([[50.0, -49.0]], dtype=torch.float64)  # rollout_logp - old_logp
    ones = torch.ones(1, 2, dtype=torch.float64)
    assert not geo_keep(d, ones, RolloutCorrection(mode="geo_mask")).item()
    assert geo_keep(d, ones, RolloutCorrection(mode="geo_mask", geo_token_clamp=20.0)).item()


def test_m2po_value_past_the_clamp_is_zero_like_its_gradient():
    # one token at log r = +50 is all M2PO has, so it keeps it (never an empty loss); its ratio is clamped at e^20,
    # so it has no gradient, and now no value either (it was -A e^20 = -4.85e8)
    logp = torch.tensor([[-0.1]], dtype=torch.float64, requires_grad=True)
    spec = get_loss("m2po")
    out = call_loss(spec, logp, logp.detach() - 50.0, torch.ones(1, dtype=torch.float64),
                    torch.ones(1, 1, dtype=torch.bool), spec.config_cls())
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert out.loss.item() == 0.0 and grad.item() == 0.0
