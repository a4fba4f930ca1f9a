"""GRPO: token-level PPO clipping with asymmetric bounds and a dual clip for A < 0.

The baseline as the VESPO paper (arXiv 2602.10693) compares it:

    r_t = exp(clamp(logp - old_logp, +-20))
    l_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))
    l_t = min(l_t, -A c)          for A < 0 (dual clip; disabled with dual_clip_c=None)
    L   = agg(l)                  default token-mean

loss/clip_frac_high counts tokens with A > 0 and r > 1 + eps_high (the clipped branch wins,
gradient 0); loss/clip_frac_low counts A < 0 and r < 1 - eps_low. loss/dual_clip_frac counts
A < 0 tokens where -A c wins.
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
class GrpoConfig(BaseLossConfig):
    """PPO-clip surrogate per token (DAPO's clip-higher is eps_high = 0.28)."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    eps_low: float = 0.2
    """Lower clip: r is clipped at 1 - eps_low; in [0, 1)."""
    eps_high: float = 0.2
    """Upper clip: r is clipped at 1 + eps_high; >= 0."""
    dual_clip_c: float | None = 3.0
    """Dual clip for A < 0: the loss is capped at -A * c; > 1, or None to disable."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_clip_range(self.eps_low, self.eps_high)
        if self.dual_clip_c is not None:
            check_range("dual_clip_c", self.dual_clip_c, 1.0, None, lo_open=True)


def check_clip_range(eps_low: float, eps_high: float) -> None:
    """The clip range [1 - eps_low, 1 + eps_high]: eps_low in [0, 1), eps_high >= 0; shared with GSPO."""
    check_range("eps_low", eps_low, 0.0, None)
    if eps_low >= 1.0:
        raise ValueError(f"eps_low must be in [0, 1); got {eps_low!r}")
    check_range("eps_high", eps_high, 0.0, None)


def grpo_loss(x: LossInputs, cfg: GrpoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """The clipped surrogate max(-A r, -A clip(r)) per token (dual-clipped for A < 0), aggregated."""
    ratio = x.clamped_log_ratio.exp()  # [B, T] r_t
    live = x.log_ratio.abs() <= TOKEN_LOG_RATIO_CLAMP  # [B, T] where the +-20 clamp lets the gradient through
    loss_mat, weight, rows = clipped_surrogate(ratio, live, x.adv, x.mask_f, cfg.eps_low, cfg.eps_high,
                                               cfg.dual_clip_c)
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


def clipped_surrogate(
    ratio: Tensor, live: Tensor, adv: Tensor, mask_f: Tensor, eps_low: float, eps_high: float,
    dual_clip_c: float | None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """PPO's clipped loss per token, its gradient weight and its clip-count rows; shared with GSPO.

    ``ratio`` [B, T] (or GSPO's [B, 1] sequence ratio) carries the gradient, ``live`` (same shape, bool)
    says where ratio's own clamp lets it through; ``adv`` [B, 1] or [B, T]. The gradient weight is r
    where the unclipped branch is the one taken and ``live``, else 0.
    """
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))  # [B, T]
    neg = adv < 0
    if dual_clip_c is not None:
        surrogate = torch.where(neg, torch.minimum(surrogate, -adv * dual_clip_c), surrogate)
    with torch.no_grad():
        r = ratio.detach()
        high = (adv > 0) & (r > 1.0 + eps_high)  # clipped branch wins: no gradient
        low = neg & (r < 1.0 - eps_low)
        dual = neg & (r > dual_clip_c) if dual_clip_c is not None else torch.zeros_like(high)
        weight = torch.where(high | low | dual | ~live, 0.0, r)  # [B, T] or [B, 1]
        rows = {"clip_low": token_counts(low, mask_f), "clip_high": token_counts(high, mask_f)}
        if dual_clip_c is not None:
            rows["dual_clip"] = token_counts(dual, mask_f)
    return surrogate, weight, rows


register(LossSpec("grpo", grpo_loss, GrpoConfig))
