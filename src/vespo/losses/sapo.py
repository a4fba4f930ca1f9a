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

from vespo.losses.base import BaseLossConfig, LossOutput, check_range, finish
from vespo.losses.inputs import TOKEN_LOG_RATIO_CLAMP, LossInputs
from vespo.losses.registry import LossSpec, register


@dataclass
class SapoConfig(BaseLossConfig):
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


def sapo_loss(x: LossInputs, cfg: SapoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-sigmoid(tau (r - 1)) * 4 / tau * A per token, aggregated by ``cfg.agg``."""
    tau = torch.where(x.adv > 0, x.adv.new_tensor(cfg.tau_pos), x.adv.new_tensor(cfg.tau_neg))  # [B, 1] or [B, T]
    ratio = x.clamped_log_ratio.exp()  # [B, T]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau  # [B, T] f_tau(r)
    loss_mat = -gate * x.adv
    with torch.no_grad():  # d f / d log r = 4 sigmoid (1 - sigmoid) r: 1 at r = 1
        sig = torch.sigmoid(tau * (ratio.detach() - 1.0))
        live = x.log_ratio.detach().abs() <= TOKEN_LOG_RATIO_CLAMP
        weight = torch.where(live, 4.0 * sig * (1.0 - sig) * ratio.detach(), 0.0)  # [B, T]
    return finish(loss_mat, weight, x, cfg, normalizer)


register(LossSpec("sapo", sapo_loss, SapoConfig))
