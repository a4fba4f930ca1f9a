"""REINFORCE: the plain policy gradient, optionally importance-weighted; the on-policy reference.

    L = agg( -sg[w] * A * logp )      w = 1 (none) | r_t (token) | W_i (sequence)

with r_t = exp(clamp(logp - old_logp, +-20)) and log W_i = min(sum_t clamp(logp - old_logp, +-20), 20).
On-policy (logp == old_logp) every variant has the gradient -A * grad logp / normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, check_choice, finish
from vespo.losses.inputs import LossInputs
from vespo.losses.registry import LossSpec, register
from vespo.losses.rollout_correction import LOG_W_MAX

IS_LEVELS: tuple[str, ...] = ("none", "token", "sequence")


@dataclass
class ReinforceConfig(BaseLossConfig):
    """Plain policy gradient with an optional importance weight."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    is_level: str = "token"
    """Importance weight on each token's gradient: none (1), token (r_t) or sequence (W_i)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("is_level", self.is_level, IS_LEVELS)

    @property
    def weighs_by_ratio(self) -> bool:
        """is_level=none has no ratio of its own: with mu = the engine's log-probs it takes the rollout
        correction's whole weight of pi_theta / pi_rollout (verl's bypass REINFORCE)."""
        return self.is_level != "none"


def reinforce_loss(x: LossInputs, cfg: ReinforceConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """Policy gradient -sg[w] * A * logp, aggregated by ``cfg.agg``."""
    weight = importance_weight(x, cfg.is_level)  # [B, T], [B, 1] or a [B, 1] of ones
    loss_mat = -weight * x.adv * x.logp
    return finish(loss_mat, weight, x, cfg, normalizer)


def importance_weight(x: LossInputs, level: str) -> Tensor:
    """The detached weight: 1 [B, 1] (none), r_t [B, T] (token) or W_i [B, 1] (sequence)."""
    log_ratio = x.clamped_log_ratio.detach()  # [B, T]
    if level == "none":
        return x.tokens.new_ones(x.tokens.shape[0], 1)
    if level == "token":
        return log_ratio.exp()
    return log_ratio.sum(dim=-1, keepdim=True).clamp(max=LOG_W_MAX).exp()  # [B, 1]


register(LossSpec("reinforce", reinforce_loss, ReinforceConfig))
