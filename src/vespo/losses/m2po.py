"""M2PO: a second-moment trust region: mask the tokens with the largest log-ratios until the batch's
second moment of the token log-ratio is under a threshold.

Second-Moment Trust Policy Optimization (Zheng, Zhao, Chen, "Prosperity before Collapse", arXiv
2510.01161, ICLR 2026; AReaL's `actor.m2_threshold`). With the N valid tokens of the batch this loss is
given and m_j = (log r_j)^2, r_j = pi_theta / mu:

    M2(S)   = (1/|S|) sum_{j in S} m_j                       the second moment over a token set S
    sort the tokens by m_j, largest first: m_(1) >= m_(2) >= ... >= m_(N)   (ties in row-major order)
    k       = the smallest k with M2({(k+1), ..., (N)}) < tau; N - 1 if there is none
    M_j     = 0 for the k largest, 1 for the others
    l_j     = -M_j * r_j * A_j,   r_j = exp(clamp(log r_j, +-20))
    L       = agg(l)                                          default token-mean: (1 / N) sum_j l_j

so the gradient weight is M_j r_j: importance-weighted REINFORCE on the tokens kept, no clipping. A
token beyond the clamp (|log r_j| > 20) has no gradient, and so adds nothing to the loss value either
(l_j = 0, not the constant -A e^20 that would dominate the logged loss of a large batch keeping one). tau = 0.04 (the paper's and AReaL's example). The masked tokens stay in the
aggregation's count, as in the paper's objective (1 / sum_i |o_i|) sum M r A; AReaL divides each
micro-batch by the count it kept. When even the smallest m_j is >= tau, all tokens but that one are
masked (AReaL's rule: the loss is never empty). The mask is computed on detached float64 log-ratios
of the current policy, log pi_theta - log mu, the paper's M2; AReaL computes it from its proximal
policy (the recompute at the start of a training step), which is pi_theta at a step's first update.
The authors' own verl code turns the same budget into a PPO clip range on the "harmful" tokens
instead of a mask; this is the masking form the paper and AReaL describe.

The mask is a statistic of the batch the loss is given: each call masks on its own tokens, as AReaL
does per loss call. When the trainer splits a mini-batch into micro-batches (``optim.micro_batch_size``)
each micro-batch keeps its own second moment under tau, so the masked tokens, and the gradient, can
differ from one call on the whole mini-batch (the trainer's default, micro_batch_size = 0). The rows
keep the logged statistics exact whatever the split: m2po/m2 is the mini-batch's second moment before
masking, m2po/m2_kept after, loss/m2_mask_frac the share of tokens masked.
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
class M2poConfig(BaseLossConfig):
    """The threshold on the batch's second moment of the token log-ratio."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    m2_threshold: float = 0.04
    """tau: tokens are masked, largest (log r)^2 first, until the mean (log r)^2 of the rest is < tau; > 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("m2_threshold", self.m2_threshold, 0.0, None, lo_open=True)


def m2po_loss(x: LossInputs, cfg: M2poConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-M * r * A per token with M the second-moment mask of this call's tokens, aggregated by ``cfg.agg``."""
    m2 = x.log_ratio.detach().double().square()  # [B, T] (log r)^2, 0 on padding
    keep = second_moment_mask(m2, x.mask, cfg.m2_threshold)  # [B, T] bool
    ratio = x.clamped_log_ratio.exp()  # [B, T] r_t, carries the gradient
    live = x.log_ratio.detach().abs() <= TOKEN_LOG_RATIO_CLAMP  # where the clamp lets the gradient through
    loss_mat = -torch.where(keep & live, ratio, 0.0) * x.adv  # beyond the clamp: no gradient, so no value either
    weight = torch.where(keep & live, ratio.detach(), 0.0)  # [B, T] w_t
    rows = {"m2_masked": token_counts(x.mask & ~keep, x.mask_f), "m2": m2.sum(dim=-1),
            "m2_kept": torch.where(keep, m2, 0.0).sum(dim=-1)}
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


@torch.no_grad()
def second_moment_mask(m2: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """Which valid tokens M2PO keeps: all but the k largest ``m2`` [B, T], k the fewest that bring the mean
    of the rest under ``threshold`` (all but the smallest when none does).  # [B, T] bool"""
    values = m2[mask]  # [N] the valid tokens, row-major
    n = values.numel()
    if n == 0:
        return mask.clone()
    ordered, order = torch.sort(values, descending=True, stable=True)  # [N]
    counts = torch.arange(n, 0, -1, device=m2.device, dtype=m2.dtype)  # [N] tokens left after masking 0, 1, ...
    rest_mean = ordered.flip(0).cumsum(0).flip(0) / counts  # [N] mean of ordered[k:]
    below = rest_mean < threshold
    k = torch.where(below.any(), below.to(torch.int64).argmax(), n - 1)  # the first k that holds
    kept_sorted = torch.arange(n, device=m2.device) >= k  # [N]
    kept = torch.empty_like(kept_sorted)
    kept[order] = kept_sorted
    keep = torch.zeros_like(mask)
    keep[mask] = kept
    return keep


register(LossSpec("m2po", m2po_loss, M2poConfig, per_row=False))
