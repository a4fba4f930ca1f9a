"""Group baselines: turn the rewards of G responses per prompt into sequence advantages.

    grpo : A_i = (R_i - mean(R_group)) / (std(R_group) + eps)     (verl's default; the official runs)
    mean : A_i =  R_i - mean(R_group)
    rloo : A_i =  R_i - mean(R_group without i)  = G/(G-1) * (R_i - mean(R_group))

The std is the unbiased sample std (torch's default, as verl uses). A group whose rewards are all
equal gets A = 0 under every estimator.
"""

from __future__ import annotations

import torch
from torch import Tensor

ESTIMATORS = ("grpo", "mean", "rloo")


def group_advantages(rewards: Tensor, group_ids: Tensor, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Advantages [B] of rewards [B] whose rows belong to groups ``group_ids`` [B] (any integer labels)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of: {', '.join(ESTIMATORS)}")
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D shapes")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards has non-finite values at rows {bad[:10]}")
    rewards = rewards.double()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, rewards)
    mean = (sums / counts)[inverse]  # [B]
    centered = rewards - mean
    if estimator == "mean":
        return centered.float()
    n = counts[inverse].double()  # [B] group size of each row
    if estimator == "rloo":
        return torch.where(n > 1, centered * n / (n - 1).clamp(min=1), torch.zeros_like(centered)).float()
    sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, centered**2)[inverse]
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    return (centered / (std + eps)).float()


def zero_variance_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A bool mask [B] of the rows whose group has identical rewards (their advantage is 0)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    hi = torch.full((n_groups,), -float("inf"), dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amax")
    lo = torch.full((n_groups,), float("inf"), dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amin")
    return (hi == lo)[inverse]
