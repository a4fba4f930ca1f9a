"""prime-rl's IPO loss: a symmetric probability trust region, the un-detached ratio, a squared log-ratio penalty.

prime-rl (src/prime_rl/trainer/rl/loss.py `ipo_loss_fn`, config `IPOLossConfig`, loss `type="ipo"`; commit
559b44772e471d1538537b8805cc77f3824a5e64):

    log r_t = logp_t - old_logp_t,   r_t = exp(log r_t)          (not detached)
    out_t   = |pi(y_t) - mu(y_t)| > delta                          (either direction, whatever the sign of A)
    l_t     = -keep_t A_t r_t + tau m_t (log r_t)^2,   keep_t = m_t and not out_t
    L       = agg(l)                                               default token-mean (prime-rl: all loss tokens)

Gradient weight keep_t r_t - 2 tau log r_t / A_t (0 where A_t = 0). Defaults prime-rl's: delta = 0.1 (its
ipo_threshold), tau = 1e-3 (kl_tau); its adv_tau (a factor on A, default 1) is left out. As in `prime_rl`
(its DPPO+KL default): r = exp(clamp(log r, +-20)) here, and a token past the clamp keeps only the penalty.
Rows: trust_mask_high / trust_mask_low count the tokens masked with pi > mu / pi < mu.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, check_range, finish
from vespo.losses.diagnostics import token_counts
from vespo.losses.inputs import TOKEN_LOG_RATIO_CLAMP, LossInputs
from vespo.losses.registry import LossSpec, register


@dataclass
class IpoConfig(BaseLossConfig):
    """The symmetric trust region on |pi - mu| and the weight of the squared log-ratio penalty."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean (prime-rl: all loss tokens) | seq-mean-token-mean | seq-mean-token-sum |
    seq-mean-token-sum-norm."""
    delta: float = 0.1
    """A token is masked when |pi - mu| > delta (prime-rl's ipo_threshold); >= 0."""
    kl_tau: float = 1e-3
    """tau: weight of the penalty tau (log r)^2 on every valid token (prime-rl's kl_tau); >= 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("delta", self.delta, 0.0, None)
        check_range("kl_tau", self.kl_tau, 0.0, None)


def ipo_loss(x: LossInputs, cfg: IpoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-keep * A * r + tau * (log r)^2 per token, aggregated by ``cfg.agg``."""
    log_r = x.log_ratio  # [B, T] carries the gradient, 0 on padding
    ratio = x.clamped_log_ratio.exp()  # [B, T]
    with torch.no_grad():
        dp = x.logp.detach().exp() - x.old_logp.exp()  # [B, T] pi - mu
        outside = dp.abs() > cfg.delta
        keep = x.mask & ~outside & (log_r.detach().abs() <= TOKEN_LOG_RATIO_CLAMP)  # [B, T]
    loss_mat = -torch.where(keep, ratio, 0.0) * x.adv + cfg.kl_tau * log_r.square() * x.mask_f
    with torch.no_grad():
        adv = x.adv.expand_as(log_r)
        penalty = 2.0 * cfg.kl_tau * log_r.detach() / torch.where(adv != 0, adv, 1.0)
        weight = torch.where(keep, ratio.detach(), 0.0) - torch.where(adv != 0, penalty, 0.0)
    rows = {"trust_mask_high": token_counts(outside & (dp > 0), x.mask_f),
            "trust_mask_low": token_counts(outside & (dp < 0), x.mask_f)}
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


register(LossSpec("ipo", ipo_loss, IpoConfig))
