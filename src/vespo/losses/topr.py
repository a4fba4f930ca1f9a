"""TOPR: tapered off-policy REINFORCE, plain REINFORCE on positive samples, the ratio truncated at 1 on negative.

Le Roux et al., "Tapering Off-Policy REINFORCE" (arXiv 2503.14286, Eq. 8); ROLL (alibaba/ROLL
roll/pipeline/agentic/agentic_actor_pg_worker.py `_compute_topr_loss`, `pg_variant="topr"`; commit
8eb27cc2dc34c4d1310b169d9b86d339004d811a):

    r_t = exp(clamp(logp_t - old_logp_t, +-20))
    l_t = -w_pos A_t logp_t                    A_t > 0   (SFT-like: no importance weight)
          -w_neg sg[min(r_t, 1)] A_t logp_t    A_t <= 0  (truncated IS in [0, 1])
    L   = agg(l)                                          default token-mean

Gradient weight w_pos on A > 0 tokens, w_neg min(r, 1) on the others. Defaults ROLL's: w_pos = w_neg = 1
(topr_positive_weight, topr_negative_weight). Where it differs from ROLL: ROLL splits the samples by the
episode's score (score > 0 positive), which a loss here is not given; the split is by the sign of the
advantage (per token with token advantages). ROLL's ratio is not clamped (differs only past |log r| = 20).
Rows: ratio_cap counts A <= 0 tokens whose ratio was truncated at 1 (loss/ratio_cap_frac).
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
class ToprConfig(BaseLossConfig):
    """The weights of the positive (untruncated) and negative (ratio truncated at 1) terms."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    positive_weight: float = 1.0
    """w_pos on the A > 0 tokens (ROLL's topr_positive_weight); >= 0."""
    negative_weight: float = 1.0
    """w_neg on the A <= 0 tokens (ROLL's topr_negative_weight); >= 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("positive_weight", self.positive_weight, 0.0, None)
        check_range("negative_weight", self.negative_weight, 0.0, None)


def topr_loss(x: LossInputs, cfg: ToprConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-w A logp per token with w = w_pos (A > 0) or w_neg sg[min(r, 1)] (A <= 0), aggregated by ``cfg.agg``."""
    ratio = x.clamped_log_ratio.detach().exp()  # [B, T]
    positive = (x.adv > 0).expand_as(ratio)  # [B, T]
    weight = torch.where(positive, cfg.positive_weight, cfg.negative_weight * ratio.clamp(max=1.0))  # [B, T]
    loss_mat = -weight * x.adv * x.logp
    rows = {"ratio_cap": token_counts(~positive & (ratio > 1.0), x.mask_f)}
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


register(LossSpec("topr", topr_loss, ToprConfig))
