"""KL-Cov: a |log r| penalty on the tokens whose advantage and log-probability covary most.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (arXiv 2505.22617,
code PRIME-RL/Entropy-Mechanism-of-RL; verl 0.9.1 `kl_cov`, verl/trainer/ppo/core_algos.py
`compute_policy_loss_kl_cov`). Over the N valid tokens j of the call, with means over those tokens:

    cov_j = (A_j - mean A) (sg[logp_j] - mean sg[logp])
    S     = the k = max(1, floor(N kl_cov_ratio)) tokens of largest cov_j
    l_j   = -A_j r_j + coef |logp_j - old_logp_j| [j in S],     r_j = exp(clamp(log r_j, +-20)), not detached
    L     = agg(l)                                               default token-mean

Gradient weight r_j - coef sign(log r_j) / A_j on S (0 beyond the +-20 clamp but for the penalty), r_j elsewhere.
Defaults verl's (PolicyLossConfig): kl_cov_ratio = 2e-4, coef = 0.1 (its ppo_kl_coef). The selection reads the
whole call's tokens, so the loss is a batch statistic, like verl's, which selects per micro-batch (per_row False).
Where it differs from verl: verl's ratio is exp of the raw log-ratio (no +-20 clamp); ties in cov are broken
by torch.topk in both. Rows: cov_selected counts the tokens in S (loss/cov_frac).
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
class KlCovConfig(BaseLossConfig):
    """The share of tokens that get the penalty and its coefficient."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    kl_cov_ratio: float = 2e-4
    """Share of the call's valid tokens penalized (at least one): those of largest covariance; in (0, 1]."""
    coef: float = 0.1
    """Coefficient of the |log r| penalty on the selected tokens (verl's ppo_kl_coef); > 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("kl_cov_ratio", self.kl_cov_ratio, 0.0, 1.0, lo_open=True)
        check_range("coef", self.coef, 0.0, None, lo_open=True)


@torch.no_grad()
def covariance(adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """cov_j = (A_j - mean A)(logp_j - mean logp), the means over the valid tokens; 0 on padding.  # [B, T]"""
    n = mask.sum().clamp(min=1)
    a_mean = torch.where(mask, adv, 0.0).sum() / n
    lp_mean = torch.where(mask, logp, 0.0).sum() / n
    return torch.where(mask, (adv - a_mean) * (logp - lp_mean), 0.0)


def kl_cov_loss(x: LossInputs, cfg: KlCovConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-A r per token, plus coef |log r| on the tokens of largest covariance, aggregated by ``cfg.agg``."""
    log_r = x.log_ratio  # [B, T] carries the gradient
    ratio = x.clamped_log_ratio.exp()  # [B, T]
    adv = x.adv.expand_as(log_r)
    with torch.no_grad():
        cov = covariance(adv, x.logp.detach(), x.mask)[x.mask]  # [N] row-major valid tokens
        selected = torch.zeros_like(cov, dtype=torch.bool)
        if cov.numel() > 0:
            k = max(1, int(cov.numel() * cfg.kl_cov_ratio))
            selected[torch.topk(cov, k, largest=True).indices] = True
        chosen = torch.zeros_like(x.mask)
        chosen[x.mask] = selected  # [B, T]
    loss_mat = -adv * ratio + torch.where(chosen, cfg.coef * log_r.abs(), 0.0)
    with torch.no_grad():
        live = log_r.abs() <= TOKEN_LOG_RATIO_CLAMP
        penalty = cfg.coef * torch.sign(log_r) / torch.where(adv != 0, adv, 1.0)
        weight = torch.where(live, ratio, 0.0) - torch.where(chosen & (adv != 0), penalty, 0.0)
    return finish(loss_mat, weight, x, cfg, normalizer, {"cov_selected": token_counts(chosen, x.mask_f)})


register(LossSpec("kl_cov", kl_cov_loss, KlCovConfig, per_row=False))
