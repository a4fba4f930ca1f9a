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

from vespo.losses.base import BaseLossConfig, LossOutput, check_range, finish
from vespo.losses.diagnostics import token_counts
from vespo.losses.inputs import LossInputs
from vespo.losses.registry import LossSpec, register


@dataclass
class CispoConfig(BaseLossConfig):
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


def cispo_loss(x: LossInputs, cfg: CispoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-sg[clip(r)] * A * logp per token, aggregated by ``cfg.agg``."""
    low = None if cfg.eps_low is None else 1.0 - cfg.eps_low
    high = 1.0 + cfg.eps_high
    ratio = x.clamped_log_ratio.detach().exp()  # [B, T]
    weight = ratio.clamp(min=low, max=high)  # [B, T] sg[clip(r)]
    loss_mat = -weight * x.adv * x.logp
    rows = {"clip_high": token_counts(ratio > high, x.mask_f),
            "clip_low": token_counts(ratio < low if low is not None else torch.zeros_like(x.mask), x.mask_f)}
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


register(LossSpec("cispo", cispo_loss, CispoConfig))
