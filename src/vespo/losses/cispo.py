"""CISPO: REINFORCE with a clipped, detached token importance weight.

The baseline as the VESPO paper (arXiv 2602.10693) compares it:

    r_t = exp(clamp(logp - old_logp, +-20))
    l_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A * logp_t    (eps_low=None: no lower bound)
    L   = agg(l)                                                     default token-mean

Every token keeps a gradient (the clip only bounds its weight). loss/clip_frac_high|low count
valid tokens whose weight was truncated at the upper / lower bound, whatever the sign of A.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses._checks import prepare_inputs
from vespo.losses.base import LossConfig, check_range, finish, indicator, rollout_corrected, token_ratio
from vespo.losses.diagnostics import clip_metrics
from vespo.losses.registry import LossSpec, register
from vespo.types import LossOutput


@dataclass
class CispoConfig(LossConfig):
    """Clipped importance-sampling weights on a REINFORCE loss (upper bound 1 + eps_high = 5 by default)."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    eps_low: float | None = None
    """Lower bound 1 - eps_low on the weight, eps_low in [0, 1]; None leaves it unbounded below."""
    eps_high: float = 4.0
    """Upper bound 1 + eps_high on the weight; >= 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps_low is not None:
            check_range("eps_low", self.eps_low, 0.0, 1.0)
        check_range("eps_high", self.eps_high, 0.0, None)


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: CispoConfig,
    normalizer: float | Tensor | None = None,
    rollout_logp: Tensor | None = None,
) -> LossOutput:
    """-sg[clip(r)] * A * logp per token, aggregated by ``cfg.agg``."""
    inp = prepare_inputs(logp, old_logp, advantages, mask, rollout_logp)
    ratio = token_ratio(inp.clamped_log_ratio)  # [B, T], 1 on padding
    low = None if cfg.eps_low is None else 1.0 - cfg.eps_low
    high = 1.0 + cfg.eps_high
    buffer = torch.empty_like(ratio)  # [B, T] the clip flags, then the loss
    metrics = _clip_fractions(ratio, low, high, inp.tokens, buffer)
    coef = ratio.clamp_(min=low, max=high).mul_(-inp.adv).mul_(inp.mask_f)  # [B, T] -clip(r) A, 0 on padding
    loss_mat, coef = rollout_corrected(torch.mul(coef, inp.logp, out=buffer), coef, inp, cfg)  # [B, T]
    return finish(loss_mat, coef, inp, cfg, normalizer, metrics, loss_masked=True)


def _clip_fractions(ratio: Tensor, low: float | None, high: float, tokens: Tensor, out: Tensor) -> dict[str, Tensor]:
    """Valid tokens whose weight was cut at the lower / upper bound (padding has r = 1, inside both)."""
    n_low = torch.zeros((), dtype=torch.int64, device=ratio.device)
    if low is not None:
        n_low = indicator(torch.lt, ratio, low, out).sum(dim=-1).to(torch.int64).sum()
    n_high = indicator(torch.gt, ratio, high, out).sum(dim=-1).to(torch.int64).sum()
    return clip_metrics(n_low, n_high, tokens)


register(LossSpec("cispo", cispo_loss, CispoConfig))
