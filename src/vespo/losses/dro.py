"""DRO: REINFORCE on log pi with a quadratic penalty on the log-ratio.

Direct Reward Optimization (Richemond et al., arXiv 2405.19107; verl 0.9.1 `dro`,
verl/trainer/ppo/core_algos.py `compute_policy_loss_dro`):

    l_t = -(A_t logp_t - beta/2 (logp_t - old_logp_t)^2)
    L   = agg(l)                                        default token-mean (verl's loss_agg_mode default)

d l_t / d logp_t = -A_t + beta (logp_t - old_logp_t), so the gradient weight is 1 - beta log r_t / A_t (0 where
A_t = 0, where the penalty's gradient has no such factor). No ratio is exponentiated, so there is no clamp.
Default beta = 0.1, this project's choice: verl has none (its dro_beta is required). Equal to verl's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, check_range, finish
from vespo.losses.inputs import LossInputs
from vespo.losses.registry import LossSpec, register


@dataclass
class DroConfig(BaseLossConfig):
    """The weight of the quadratic log-ratio penalty."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    beta: float = 0.1
    """beta of the penalty beta/2 (log r)^2 (verl's dro_beta, which it requires); > 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("beta", self.beta, 0.0, None, lo_open=True)


def dro_loss(x: LossInputs, cfg: DroConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-(A logp - beta/2 (log r)^2) per token, aggregated by ``cfg.agg``."""
    log_r = x.log_ratio  # [B, T] carries the gradient, 0 on padding
    loss_mat = -(x.adv * x.logp - 0.5 * cfg.beta * log_r.square())
    with torch.no_grad():
        adv = x.adv.expand_as(log_r)
        weight = torch.where(adv != 0, 1.0 - cfg.beta * log_r.detach() / torch.where(adv != 0, adv, 1.0), 0.0)
    return finish(loss_mat, weight, x, cfg, normalizer)


register(LossSpec("dro", dro_loss, DroConfig))
