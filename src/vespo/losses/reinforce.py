"""REINFORCE: the plain policy gradient, optionally importance-weighted; the on-policy reference.

    L = agg( -sg[w] * A * logp )      w = 1 (none) | r_t (token) | W_i (sequence)

with r_t = exp(clamp(logp - old_logp, +-20)) and log W_i = min(sum_t clamp(logp - old_logp, +-20), 20).
On-policy (logp == old_logp) every variant has the gradient -A * grad logp / normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses._checks import prepare_inputs
from vespo.losses.base import (
    TOKEN_LOG_RATIO_CLAMP,
    LossConfig,
    apply_rollout_correction,
    check_choice,
    finish,
)
from vespo.losses.registry import LossSpec, register
from vespo.losses.rollout_correction import LOG_W_MAX
from vespo.types import LossOutput

IS_LEVELS: tuple[str, ...] = ("none", "token", "sequence")


@dataclass
class ReinforceConfig(LossConfig):
    """Plain policy gradient with an optional importance weight."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    is_level: str = "token"
    """Importance weight on each token's gradient: none (1), token (r_t) or sequence (W_i)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("is_level", self.is_level, IS_LEVELS)


def reinforce_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: ReinforceConfig,
    normalizer: float | Tensor | None = None,
    rollout_logp: Tensor | None = None,
) -> LossOutput:
    """Policy gradient -sg[w] * A * logp, aggregated by ``cfg.agg``."""
    inp = prepare_inputs(logp, old_logp, advantages, mask, rollout_logp)
    weight = _importance_weight(inp.log_ratio.detach(), cfg.is_level)  # [B, T] or [B, 1]
    loss_mat = apply_rollout_correction(-weight * inp.adv * inp.logp, inp, cfg)  # [B, T]
    return finish(loss_mat, inp, cfg, normalizer, {})


def _importance_weight(log_ratio: Tensor, level: str) -> Tensor:
    if level == "none":
        return torch.ones_like(log_ratio)
    clamped = log_ratio.clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)  # [B, T]
    if level == "token":
        return clamped.exp()
    return clamped.sum(dim=-1, keepdim=True).clamp(max=LOG_W_MAX).exp()  # [B, 1]


register(LossSpec("reinforce", reinforce_loss, ReinforceConfig))
