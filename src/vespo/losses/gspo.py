"""GSPO: sequence-level, length-normalized importance ratio with PPO clipping.

The baseline as the VESPO paper (arXiv 2602.10693) compares it:

    log s_i  = (1/T_i) sum_t m_it (logp_it - old_logp_it)          (T_i >= 1; empty rows get 0)
    s_it     = exp(min(sg[log s_i] + logp_it - sg[logp_it], 10))   value s_i, gradient s_i * grad logp_it
    l_it     = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))
    L        = agg(l)                                             default seq-mean-token-mean

Clip fractions count tokens as in GRPO (A > 0 above the upper bound, A < 0 below the lower).
Since s_it has the same value exp(min(log s_i, 10)) on every token of row i and the gradient
coefficient -A s_i (0 where a clip or the clamp at 10 binds), both are computed once per row [B, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses._checks import prepare_inputs
from vespo.losses.base import LossConfig, check_range, finish, rollout_corrected
from vespo.losses.grpo import clipped_surrogate
from vespo.losses.registry import LossSpec, register
from vespo.types import LossOutput

LOG_S_MAX = 10.0  # the token-form log ratio is clamped at 10 (verl)


@dataclass
class GspoConfig(LossConfig):
    """Sequence-level clipping of the geometric-mean token ratio."""

    agg: str = "seq-mean-token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    eps_low: float = 3e-4
    """Lower clip: s is clipped at 1 - eps_low; in [0, 1)."""
    eps_high: float = 4e-4
    """Upper clip: s is clipped at 1 + eps_high; >= 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("eps_low", self.eps_low, 0.0, None)
        if self.eps_low >= 1.0:
            raise ValueError(f"eps_low must be in [0, 1); got {self.eps_low!r}")
        check_range("eps_high", self.eps_high, 0.0, None)


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: GspoConfig,
    normalizer: float | Tensor | None = None,
    rollout_logp: Tensor | None = None,
) -> LossOutput:
    """The clipped surrogate on the sequence ratio s_i in its token form, aggregated by ``cfg.agg``."""
    inp = prepare_inputs(logp, old_logp, advantages, mask, rollout_logp)
    log_s = (inp.row_log_ratio / inp.tokens.clamp(min=1.0))[:, None]  # [B, 1]
    ratio = torch.exp(log_s.clamp(max=LOG_S_MAX))  # [B, 1]: s_it's value, the same for every token of row i
    loss_mat, coef, metrics = clipped_surrogate(ratio, inp.adv, inp.tokens, cfg.eps_low, cfg.eps_high, None)
    coef = coef * (log_s <= LOG_S_MAX)  # the clamp at 10 stops the gradient where it binds
    if coef.shape[-1] != 1:
        coef = coef * inp.mask_f  # token advantages: [B, T], 0 on padding
    loss_mat, coef = rollout_corrected(loss_mat, coef, inp, cfg)
    return finish(loss_mat, coef, inp, cfg, normalizer, metrics)


register(LossSpec("gspo", gspo_loss, GspoConfig))
