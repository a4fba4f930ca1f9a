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

from vespo.losses._checks import prepare_inputs
from vespo.losses.base import LossConfig, check_range, clamp_pass, finish, indicator, rollout_corrected, token_ratio
from vespo.losses.diagnostics import clip_metrics, count_selected, token_count
from vespo.losses.registry import LossSpec, register
from vespo.types import LossOutput


@dataclass
class GrpoConfig(LossConfig):
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
        check_range("eps_low", self.eps_low, 0.0, None)
        if self.eps_low >= 1.0:
            raise ValueError(f"eps_low must be in [0, 1); got {self.eps_low!r}")
        check_range("eps_high", self.eps_high, 0.0, None)
        if self.dual_clip_c is not None:
            check_range("dual_clip_c", self.dual_clip_c, 1.0, None, lo_open=True)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: GrpoConfig,
    normalizer: float | Tensor | None = None,
    rollout_logp: Tensor | None = None,
) -> LossOutput:
    """The clipped surrogate max(-A r, -A clip(r)) per token (dual-clipped for A < 0), aggregated."""
    inp = prepare_inputs(logp, old_logp, advantages, mask, rollout_logp)
    ratio = token_ratio(inp.clamped_log_ratio)  # [B, T], 1 on padding
    loss_mat, coef, metrics = clipped_surrogate(ratio, inp.adv, inp.tokens, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)
    coef.mul_(inp.mask_f)  # [B, T], 0 on padding
    passes = clamp_pass(inp, inp.clamped_log_ratio)
    if passes is not None:
        coef.mul_(passes)  # the +-20 clamp of the log-ratio stops the gradient where it binds
    loss_mat, coef = rollout_corrected(loss_mat, coef, inp, cfg)
    return finish(loss_mat, coef, inp, cfg, normalizer, metrics)


@torch.no_grad()
def clipped_surrogate(
    ratio: Tensor, adv: Tensor, tokens: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """PPO's clipped loss per token, its gradient coefficient and its clip fractions; shared with GSPO.

    max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) is -A min(r, 1 + eps_high) for A > 0 and
    -A max(r, 1 - eps_low) for A < 0; the dual clip min(., -A c) caps the latter at r = c. So the
    loss is -A clamp(r, lo, hi) with bounds picked by the sign of A, and its derivative w.r.t. log r
    is -A r where lo <= r <= hi, else 0 (the coefficient returned, not yet masked).
    ``ratio`` is [B, T] (1 on padding, where nothing clips) or [B, 1] (GSPO's sequence ratio);
    it is consumed (the coefficient may be written into it).
    """
    neg = adv < 0  # [B, 1] or [B, T]
    inf = torch.full_like(adv, torch.inf)
    lo = torch.where(neg, adv.new_tensor(1.0 - eps_low), -inf)
    hi = torch.where(neg, inf if dual_clip_c is None else adv.new_tensor(dual_clip_c), adv.new_tensor(1.0 + eps_high))
    clipped = ratio.clamp(lo, hi)  # [B, T]
    flags = torch.empty_like(clipped)  # [B, T] one buffer for the three 0/1 flags below
    above = indicator(torch.lt, clipped, ratio, flags)  # cut by hi: A > 0 above 1 + eps_high, or A < 0 above c
    n_high = _count(above, adv > 0, tokens)
    n_dual = None if dual_clip_c is None else _count(above, neg, tokens)
    below = indicator(torch.gt, clipped, ratio, flags)  # cut by lo: A < 0 below 1 - eps_low
    metrics = clip_metrics(_count(below, neg, tokens), n_high, tokens)
    if n_dual is not None:
        metrics["loss/dual_clip_frac"] = n_dual / token_count(tokens).clamp(min=1)
    inside = indicator(torch.eq, clipped, ratio, flags)  # lo <= r <= hi: the gradient passes
    coef = ratio.mul_(-adv) if ratio.shape == clipped.shape else ratio * -adv  # -A r
    loss_mat = clipped.mul_(-adv)  # [B, T] -A clamp(r, lo, hi)
    return loss_mat, coef.mul_(inside), metrics


def _count(flags: Tensor, select: Tensor, tokens: Tensor) -> Tensor:
    """int64 count of valid tokens with flags = 1 in the selected rows/tokens; [B, 1] flags count every token."""
    if flags.shape[-1] == 1 and tokens.dim() == 1:
        flags = flags * tokens[:, None]  # a sequence-level flag counts for each of the row's tokens
    return count_selected(flags, select)


register(LossSpec("grpo", grpo_loss, GrpoConfig))
