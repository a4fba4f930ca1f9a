"""Clip-Cov: PPO's clipped loss with the gradient of a few high-covariance tokens cut.

Cui et al. (arXiv 2505.22617, code PRIME-RL/Entropy-Mechanism-of-RL; verl 0.9.1 `clip_cov`,
verl/trainer/ppo/core_algos.py `compute_policy_loss_clip_cov`). Over the N valid tokens of the call:

    r_j   = exp(clamp(log r_j, +-20));   l_j = max(-A_j r_j, -A_j clip(r_j, 1 - eps_low, 1 + eps_high))
    cov_j = (A_j - mean A)(sg[logp_j] - mean sg[logp])                     (means over the valid tokens)
    C     = the valid tokens PPO's clip leaves alone (-A clip(r) > -A r is false) with lb < cov_j < ub
    S     = min(|C|, max(1, floor(N clip_cov_ratio))) tokens of C drawn at random: C in row-major order,
            permuted by torch.randperm(|C|) from torch's global generator, the first ones (verl's draw)
    l_j  <- 0 for j in S
    L     = agg(l)                                                          default token-mean

Gradient weight r_j where PPO's clip leaves it a gradient and j not in S, else 0. Defaults verl's: clip_cov_ratio
= 2e-4, lb = 1, ub = 5, eps = 0.2 / 0.2 (its clip_ratio); no dual clip (verl's clip_cov has none). The random
draw consumes torch's global CPU generator exactly as verl's does, so the same seed cuts the same tokens. A batch
statistic, per call (per_row False), as verl's (per micro-batch). Where it differs from verl: the ratio is clamped
at +-20; verl's means divide by (N + 1e-8). Rows: cov_selected counts the tokens in S (loss/cov_frac).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, check_range, finish
from vespo.losses.diagnostics import token_counts
from vespo.losses.grpo import check_clip_range, clipped_surrogate
from vespo.losses.inputs import TOKEN_LOG_RATIO_CLAMP, LossInputs
from vespo.losses.kl_cov import covariance
from vespo.losses.registry import LossSpec, register


@dataclass
class ClipCovConfig(BaseLossConfig):
    """PPO's clip range and which tokens of high covariance lose their gradient."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    eps_low: float = 0.2
    """Lower clip: r is clipped at 1 - eps_low; in [0, 1)."""
    eps_high: float = 0.2
    """Upper clip: r is clipped at 1 + eps_high; >= 0."""
    clip_cov_ratio: float = 2e-4
    """Share of the call's valid tokens cut (at least one, if there are candidates); in (0, 1]."""
    clip_cov_lb: float = 1.0
    """Candidates have cov > clip_cov_lb (verl's clip_cov_lb)."""
    clip_cov_ub: float = 5.0
    """Candidates have cov < clip_cov_ub (verl's clip_cov_ub); > clip_cov_lb."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_clip_range(self.eps_low, self.eps_high)
        check_range("clip_cov_ratio", self.clip_cov_ratio, 0.0, 1.0, lo_open=True)
        check_range("clip_cov_lb", self.clip_cov_lb)
        check_range("clip_cov_ub", self.clip_cov_ub, self.clip_cov_lb, None, lo_open=True)


def clip_cov_loss(x: LossInputs, cfg: ClipCovConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """PPO's clipped loss per token, 0 on a random few unclipped tokens of high covariance; aggregated."""
    ratio = x.clamped_log_ratio.exp()  # [B, T]
    live = x.log_ratio.abs() <= TOKEN_LOG_RATIO_CLAMP
    loss_mat, weight, rows = clipped_surrogate(ratio, live, x.adv, x.mask_f, cfg.eps_low, cfg.eps_high, None)
    with torch.no_grad():
        adv = x.adv.expand_as(ratio)
        r = ratio.detach()
        clipped = ((adv > 0) & (r > 1.0 + cfg.eps_high)) | ((adv < 0) & (r < 1.0 - cfg.eps_low))
        cov = covariance(adv, x.logp.detach(), x.mask)  # [B, T]
        candidates = torch.nonzero(x.mask & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub))  # [K, 2]
        count = max(int(cfg.clip_cov_ratio * int(x.mask.sum())), 1)
        cut = torch.zeros_like(x.mask)
        if len(candidates) > 0:
            chosen = candidates[torch.randperm(len(candidates))[:count].to(candidates.device)]
            cut[chosen[:, 0], chosen[:, 1]] = True
    loss_mat = torch.where(cut, 0.0, loss_mat)
    weight = torch.where(cut, 0.0, weight)
    return finish(loss_mat, weight, x, cfg, normalizer, {**rows, "cov_selected": token_counts(cut, x.mask_f)})


register(LossSpec("clip_cov", clip_cov_loss, ClipCovConfig, per_row=False))
