"""SAPO: a soft sigmoid gate on the token ratio instead of a hard clip.

The baseline as the VESPO paper (arXiv 2602.10693) compares it:

    r_t    = exp(clamp(logp - old_logp, +-20))
    f(r)   = sigmoid(tau (r - 1)) * 4 / tau,      tau = tau_pos if A > 0 else tau_neg
    l_t    = -f(r_t) * A
    L      = agg(l)                               default seq-mean-token-mean

d l_t / d logp_t = -A * 4 sigmoid(.)(1 - sigmoid(.)) * r_t, which is -A at r = 1 for any tau.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses._checks import prepare_inputs
from vespo.losses.base import LossConfig, check_range, clamp_pass, finish, rollout_corrected, token_ratio
from vespo.losses.registry import LossSpec, register
from vespo.types import LossOutput


@dataclass
class SapoConfig(LossConfig):
    """Soft adaptive gate temperatures, one for each advantage sign."""

    agg: str = "seq-mean-token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    tau_pos: float = 1.0
    """Gate temperature for A > 0; > 0 (larger = sharper gate)."""
    tau_neg: float = 1.05
    """Gate temperature for A <= 0; > 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("tau_pos", self.tau_pos, 0.0, None, lo_open=True)
        check_range("tau_neg", self.tau_neg, 0.0, None, lo_open=True)


def sapo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: SapoConfig,
    normalizer: float | Tensor | None = None,
    rollout_logp: Tensor | None = None,
) -> LossOutput:
    """-sigmoid(tau (r - 1)) * 4 / tau * A per token, aggregated by ``cfg.agg``."""
    inp = prepare_inputs(logp, old_logp, advantages, mask, rollout_logp)
    tau = torch.where(inp.adv > 0, inp.adv.new_tensor(cfg.tau_pos), inp.adv.new_tensor(cfg.tau_neg))  # [B, 1]|[B, T]
    ratio = token_ratio(inp.clamped_log_ratio)  # [B, T]
    sig = (ratio - 1.0).mul_(tau).sigmoid_()  # [B, T] sigmoid(tau (r - 1))
    loss_mat = (sig * (4.0 / tau)).mul_(-inp.adv)  # [B, T] -gate * A
    # d loss / d logp = -A (4 / tau) sig (1 - sig) tau r   (sigmoid' = sig (1 - sig); dr / dlogp = r)
    coef = ratio.mul_(sig)  # [B, T] r sig, in r's storage
    coef.mul_(sig.neg_().add_(1.0))  # r sig (1 - sig)
    coef.mul_(-inp.adv * (4.0 / tau) * tau).mul_(inp.mask_f)  # 0 on padding
    passes = clamp_pass(inp, inp.clamped_log_ratio)
    if passes is not None:
        coef.mul_(passes)  # the +-20 clamp of the log-ratio stops the gradient where it binds
    loss_mat, coef = rollout_corrected(loss_mat, coef, inp, cfg)
    return finish(loss_mat, coef, inp, cfg, normalizer, {})


register(LossSpec("sapo", sapo_loss, SapoConfig))
