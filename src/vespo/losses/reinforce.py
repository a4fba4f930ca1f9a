"""REINFORCE: the plain policy gradient, optionally importance-weighted; the on-policy reference.

    L = agg( -sg[w] * A * logp )      w = 1 (none) | r_t (token) | W_i (sequence)

with r_t = exp(clamp(logp - old_logp, +-20)) and log W_i = min(sum_t clamp(logp - old_logp, +-20), 20).
On-policy (logp == old_logp) every variant has the gradient -A * grad logp / normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from vespo.losses._checks import LossInputs, prepare_inputs
from vespo.losses.base import LossConfig, check_choice, finish, rollout_corrected
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
    if cfg.is_level == "none":
        coef = -inp.adv  # [B, 1] or [B, T]
    else:
        weight = _importance_weight(inp, cfg.is_level)  # [B, T] or [B, 1]
        coef = weight.mul_(-inp.adv) if weight.shape[-1] != 1 else weight * -inp.adv  # [B, T] or [B, 1]
    if coef.shape[-1] != 1 and inp.adv.shape[-1] == 1:
        coef.mul_(inp.mask_f)  # [B, T], 0 on padding
    masked = coef.shape[-1] != 1  # a [B, T] coefficient is 0 on padding, and so is coef * logp
    loss_mat, coef = rollout_corrected(coef * inp.logp, coef, inp, cfg)  # [B, T]
    return finish(loss_mat, coef, inp, cfg, normalizer, {}, loss_masked=masked)


def _importance_weight(inp: LossInputs, level: str) -> Tensor:
    """The detached weight, a new tensor: r_t [B, T] (token) or W_i [B, 1] (sequence)."""
    if level == "token":
        return inp.clamped_log_ratio.exp()
    return inp.row_clamped_log_ratio[:, None].clamp(max=LOG_W_MAX).exp()  # [B, 1]


register(LossSpec("reinforce", reinforce_loss, ReinforceConfig))
