"""prime-rl's default loss: DPPO's binary-TV trust-region mask on an un-detached ratio, plus a squared
log-ratio penalty (prime-rl `src/prime_rl/trainer/rl/loss.py`, `default_loss_fn`; DPPO arXiv 2602.04879
with Kimi-K2.5's penalty, arXiv 2602.02276).

    log r_t = logp_t - old_logp_t,   r_t = exp(log r_t)          (not detached: the gradient flows through r)
    dp_t    = pi(y_t) - mu(y_t)
    out_t   = dp_t > delta_high   if A_t > 0
              dp_t < -delta_low   if A_t <= 0                      (A = 0 takes the low branch, as prime-rl)
    keep_t  = m_t and not out_t
    l_t     = -keep_t A_t r_t + tau m_t (log r_t)^2               (the penalty also on masked tokens)
    L       = agg(l)                                              default token-mean: all loss tokens of the
                                                                  mini-batch, as prime-rl normalizes

d l_t / d logp_t = -keep_t A_t r_t + 2 tau log r_t, so the gradient weight (the factor on -A grad log pi)
is keep_t r_t - 2 tau log r_t / A_t (0 where A_t = 0, where the penalty's gradient has no such factor).
Defaults are prime-rl's (`DefaultLossConfig`): delta_low = delta_high = 0.2, tau = 1e-3 (its `kl_tau`);
its `adv_tau` (a factor on A, default 1) is left out.

prime-rl has no recompute: mu is always the inference engine's log-probs, i.e. staleness.behavior=rollout
here (with mu recomputed the same formula runs against pi_old). Where they differ: prime-rl takes exp of the
raw log-ratio, which overflows to inf in float32 past log r = 88.7; here r = exp(clamp(log r, +-20)) as in
every loss, and a token past the clamp has neither gradient nor value in the policy term (keep_t = 0 there),
while the penalty keeps the raw log r. verl's `dppo_tv` (vespo's `dppo`) has the same mask with
-A sg[min(r, C)] log pi against pi_old and no penalty.

Rows: as DPPO's, trust_mask_high / trust_mask_low count the A > 0 / A < 0 tokens outside the trust region
(loss/trust_mask_frac_high|low).
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
class PrimeRlConfig(BaseLossConfig):
    """The binary-TV trust region per side and the weight of the squared log-ratio penalty."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean (prime-rl: all loss tokens) | seq-mean-token-mean | seq-mean-token-sum |
    seq-mean-token-sum-norm."""
    delta_low: float = 0.2
    """Trust region for A <= 0 tokens: masked when pi - mu < -delta_low (prime-rl's dppo_mask_low); >= 0."""
    delta_high: float = 0.2
    """Trust region for A > 0 tokens: masked when pi - mu > delta_high (prime-rl's dppo_mask_high); >= 0."""
    kl_tau: float = 1e-3
    """tau: weight of the penalty tau (log r)^2 on every valid token (prime-rl's kl_tau); >= 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("delta_low", "delta_high", "kl_tau"):
            check_range(name, getattr(self, name), 0.0, None)


def prime_rl_loss(x: LossInputs, cfg: PrimeRlConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-keep * A * r + tau * (log r)^2 per token, aggregated by ``cfg.agg``."""
    log_r = x.log_ratio  # [B, T] carries the gradient, 0 on padding
    ratio = x.clamped_log_ratio.exp()  # [B, T] r_t, carries the gradient below the clamp
    with torch.no_grad():
        dp = x.logp.detach().exp() - x.old_logp.exp()  # [B, T] pi - mu
        outside = torch.where(x.adv > 0, dp > cfg.delta_high, dp < -cfg.delta_low)  # [B, T]
        live = log_r.detach().abs() <= TOKEN_LOG_RATIO_CLAMP
        keep = x.mask & ~outside & live  # [B, T]
    loss_mat = -torch.where(keep, ratio, 0.0) * x.adv + cfg.kl_tau * log_r.square() * x.mask_f
    with torch.no_grad():
        penalty = 2.0 * cfg.kl_tau * log_r.detach() / torch.where(x.adv != 0, x.adv, 1.0)  # [B, T]
        weight = torch.where(keep, ratio.detach(), 0.0) - torch.where(x.adv != 0, penalty, 0.0)
    rows = {"trust_mask_high": token_counts((x.adv > 0) & outside, x.mask_f),
            "trust_mask_low": token_counts((x.adv < 0) & outside, x.mask_f)}
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


register(LossSpec("prime_rl", prime_rl_loss, PrimeRlConfig))
