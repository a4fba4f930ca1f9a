"""VESPO's gamma kernel, the one home of its math (used by vespo, vespo_adaptive and the diagnostics).

    phi(W) = W^k exp(lam (1 - W)),   log phi = lam + k log W - lam W      (phi(1) = 1, mode k/lam)

A kernel shape is a pair of tensors ``k, lam [2]``: row 0 for sequences (or tokens) with A >= 0,
row 1 for A < 0. lam is clamped >= 1e-4 when used (official numerics); non-finite phi is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

LAMBDA_MIN = 1e-4  # official lower clamp of lambda


def kernel_phi(log_w: Tensor, adv: Tensor, k: Tensor, lam: Tensor) -> Tensor:
    """phi(W) with the (k, lam) row picked by the sign of ``adv``, detached.  # [B, 1] or [B, T]

    ``log_w [B, 1]``; ``adv [B, 1]`` or ``[B, T]``; ``k, lam [2]`` in log_w's dtype.
    """
    nonneg = adv >= 0
    k_ = torch.where(nonneg, k[0], k[1])  # [B, 1] or [B, T]
    lam_ = torch.where(nonneg, lam[0], lam[1])
    return log_phi(log_w, k_, lam_).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def log_phi(log_w: Tensor, k: Tensor, lam: Tensor) -> Tensor:
    """log phi = lam + k log W - lam W with lam clamped >= 1e-4; the arguments broadcast."""
    lam = lam.clamp(min=LAMBDA_MIN)
    return lam + k * log_w - lam * log_w.exp()


def sign_log_phi(log_w: Tensor, k: Tensor, lam: Tensor) -> Tensor:
    """log phi of every sequence under each sign's kernel.  # [2, B]

    ``log_w [B]``; ``k, lam [2]`` (pos, neg).
    """
    return log_phi(log_w[None, :], k[:, None], lam[:, None])


def sign_groups(adv: Tensor, mask: Tensor, seq_valid: Tensor) -> Tensor:
    """Which sequences use the A >= 0 kernel (row 0) and which the A < 0 kernel (row 1).  # [2, B] bool

    Sequence advantages ``adv [B, 1]``: each non-empty sequence is in exactly one row. Token
    advantages ``adv [B, T]``: a sequence is in a row if one of its valid tokens has that sign
    (a sequence-level advantage broadcast to tokens, as verl passes it, again gives one row).
    """
    if adv.shape[-1] == 1:
        nonneg = adv[:, 0] >= 0  # [B]
        return torch.stack([seq_valid & nonneg, seq_valid & ~nonneg])
    return torch.stack([(mask & (adv >= 0)).any(dim=-1), (mask & (adv < 0)).any(dim=-1)])
