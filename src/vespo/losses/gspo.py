"""GSPO: sequence-level, length-normalized importance ratio with PPO clipping.

The baseline as the VESPO paper (arXiv 2602.10693) compares it:

    log s_i  = (1/T_i) sum_t m_it (logp_it - old_logp_it)          (T_i >= 1; empty rows get 0)
    s_it     = exp(min(sg[log s_i] + logp_it - sg[logp_it], 10))   value s_i, gradient s_i * grad logp_it
    l_it     = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))
    L        = agg(l)                                             default seq-mean-token-mean

Clip fractions count tokens as in GRPO (A > 0 above the upper bound, A < 0 below the lower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, finish
from vespo.losses.grpo import check_clip_range, clipped_surrogate
from vespo.losses.inputs import LossInputs
from vespo.losses.registry import LossSpec, register

LOG_S_MAX = 10.0  # the token-form log ratio is clamped at 10 (verl)


@dataclass
class GspoConfig(BaseLossConfig):
    """Sequence-level clipping of the geometric-mean token ratio."""

    agg: str = "seq-mean-token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    eps_low: float = 3e-4
    """Lower clip: s is clipped at 1 - eps_low; in [0, 1)."""
    eps_high: float = 4e-4
    """Upper clip: s is clipped at 1 + eps_high; >= 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_clip_range(self.eps_low, self.eps_high)
        if self.opsm_delta is not None and math.exp(-self.opsm_delta) <= 1.0 - self.eps_low:
            raise ValueError(f"opsm_delta={self.opsm_delta} cannot change GSPO's update: OPSM masks A < 0 sequences "
                             f"whose geometric-mean ratio is below exp(-opsm_delta) = {math.exp(-self.opsm_delta):.4g}, "
                             f"and GSPO's clip already gives every A < 0 sequence below 1 - eps_low = "
                             f"{1.0 - self.eps_low:.4g} no gradient")


def gspo_loss(x: LossInputs, cfg: GspoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """The clipped surrogate on the sequence ratio s_i in its token form, aggregated by ``cfg.agg``."""
    log_s = (x.log_ratio.detach().sum(dim=-1) / x.tokens.clamp(min=1.0))[:, None]  # [B, 1] sg[log s_i]
    log_s_it = (log_s + x.logp - x.logp.detach()).clamp(max=LOG_S_MAX)  # [B, T] value log s_i, gradient grad logp
    live = log_s <= LOG_S_MAX  # [B, 1]
    loss_mat, weight, rows = clipped_surrogate(log_s_it.exp(), live, x.adv, x.mask_f, cfg.eps_low, cfg.eps_high,
                                               None)
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


register(LossSpec("gspo", gspo_loss, GspoConfig))
