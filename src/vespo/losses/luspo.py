"""LUSPO: length-unbiased GSPO, each sequence's clipped loss scaled by its length.

Length-Unbiased Sequence Policy Optimization (arXiv 2602.05261; TRL 1.16 `loss_type="luspo"` with
`importance_sampling_level="sequence"`, trl/trainer/grpo_trainer.py `_compute_loss`). GSPO's sequence ratio and
clip, aggregated as a token sum per sequence, so a sequence of T_i tokens weighs T_i times its clipped loss:

    log s_i = (1/T_i) sum_t m_it (logp_it - old_logp_it),   s_it = exp(min(sg[log s_i] + logp_it - sg[logp_it], 10))
    l_it    = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))
    L       = (1/N_seqs) sum_i sum_t m_it l_it                    agg = seq-mean-token-sum (TRL: .sum(-1).mean())

d L / d logp_it = -A s_i / N_seqs where the clip is not binding: the token form's gradient, which equals TRL's
d/dlogp_it [T_i (-A exp(log s_i))] = T_i (-A s_i / T_i). The length weighting is the method: its default
agg is seq-mean-token-sum (seq-mean-token-sum-norm is the same up to the constant C); with another mode the loss is
GSPO's under that mode.
Defaults: GSPO's eps = 3e-4 / 4e-4 (TRL's own default is 0.2, its docs point to GSPO's for sequence-level IS).
Where it differs from TRL: TRL's mean counts rows without valid tokens; TRL takes exp(log s_i) unclamped,
here log s_i is clamped at 10 as in GSPO (a row past it has no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from vespo.losses.base import LossOutput
from vespo.losses.gspo import GspoConfig, gspo_loss
from vespo.losses.inputs import LossInputs
from vespo.losses.registry import LossSpec, register


@dataclass
class LuspoConfig(GspoConfig):
    """GSPO's sequence clip with each sequence weighted by its length (token sum)."""

    agg: str = "seq-mean-token-sum"
    """Aggregation mode: seq-mean-token-sum (LUSPO's, TRL's) | seq-mean-token-sum-norm | token-mean |
    seq-mean-token-mean (the last two without the length weighting: GSPO's loss under that mode)."""


def luspo_loss(x: LossInputs, cfg: LuspoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """GSPO's clipped surrogate, summed over each sequence's tokens (``cfg.agg``)."""
    return gspo_loss(x, cfg, normalizer)


register(LossSpec("luspo", luspo_loss, LuspoConfig))
