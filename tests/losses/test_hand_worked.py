"""Small examples worked out by hand, with the arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from vespo.losses import aggregate, get_loss

LOGP = [[-1.0, -2.0, -0.5]]  # one sequence, three tokens; sum = -3.5
MASK = torch.ones(1, 3, dtype=torch.bool)


def three_tokens(log_ratio=0.1):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    old = logp.detach() - log_ratio  # every token has logp - old = 0.1, so log W = 0.3
    return logp, old


def run(name, adv, **cfg):
    logp, old = three_tokens()
    spec = get_loss(name)
    out = spec.fn(logp, old, torch.tensor([adv], dtype=torch.float64), MASK, spec.config_cls(**cfg))
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
    out = spec.fn(logp, logp.detach(), torch.ones(1, dtype=torch.float64), MASK, cfg, rollout_logp=rollout)
    assert out.loss.item() == pytest.approx((2 + 2 * math.exp(-1) + 0.5) / 3, rel=1e-12)
    # mis_token drops the e^1 token instead: -(0 + e^-1 * -2 + -0.5) / 3
    cfg = spec.config_cls(is_level="none", rollout_correction={"mode": "mis_token", "threshold": 2.0})
    out = spec.fn(logp, logp.detach(), torch.ones(1, dtype=torch.float64), MASK, cfg, rollout_logp=rollout)
    assert out.loss.item() == pytest.approx((2 * math.exp(-1) + 0.5) / 3, rel=1e-12)
