"""Aggregation of a per-token loss matrix into a scalar: token-mean and the two sequence means.

    token-mean            sum_it m_it l_it / N_tokens
    seq-mean-token-mean   sum_i (sum_t m_it l_it / T_i) / N_seqs
    seq-mean-token-sum    sum_i (sum_t m_it l_it) / N_seqs

Without a normalizer, N_tokens is the number of valid tokens and N_seqs the number of sequences
with at least one valid token (an all-masked row contributes nothing and is not counted). A
normalizer given by the caller replaces N_tokens or N_seqs: pass the count of the whole
mini-batch and the gradients of its micro-batches sum to the mini-batch gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vespo.losses._checks import check_normalizer

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def check_agg_mode(mode: str, field: str = "agg") -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"{field} must be one of {', '.join(AGG_MODES)}; got {mode!r}")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str, normalizer: float | Tensor | None = None) -> Tensor:
    """Reduce ``loss_mat [B, T]`` over the valid tokens of ``mask [B, T]`` to a scalar by ``mode``.

    Masked positions are excluded with ``where`` (not multiplied by 0), so padding that holds
    NaN/inf cannot leak into the result or its gradient.
    """
    check_agg_mode(mode, "mode")
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat shape {tuple(loss_mat.shape)} does not match mask shape {tuple(mask.shape)}")
    mask_b = mask if mask.dtype == torch.bool else mask != 0
    masked = torch.where(mask_b, loss_mat, loss_mat.new_zeros(()))  # [B, T]
    return reduce_masked(masked, mask_b.to(loss_mat.dtype).sum(dim=-1), mode, normalizer)


def reduce_masked(masked: Tensor, tokens: Tensor, mode: str, normalizer: float | Tensor | None = None) -> Tensor:
    """:func:`aggregate` for a loss matrix already zero on padding, given the tokens per row ``tokens [B]``."""
    check_normalizer(normalizer)
    if mode == "token-mean":
        return masked.sum() / (tokens.sum().clamp(min=1.0) if normalizer is None else normalizer)
    per_seq = masked.sum(dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp(min=1.0)
    n_seqs = (tokens > 0).sum().to(masked.dtype).clamp(min=1.0)
    return per_seq.sum() / (n_seqs if normalizer is None else normalizer)
