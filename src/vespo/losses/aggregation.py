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
    if mode == "token-mean":
        check_normalizer(normalizer)
        return masked.sum() / _token_count(tokens, normalizer)
    return reduce_rows(masked.sum(dim=-1), tokens, mode, normalizer)


def reduce_rows(row_sums: Tensor, tokens: Tensor, mode: str, normalizer: float | Tensor | None = None) -> Tensor:
    """:func:`aggregate` from the per-row sums ``row_sums [B]`` of the masked loss and ``tokens [B]``."""
    check_normalizer(normalizer)
    if mode == "token-mean":
        return row_sums.sum() / _token_count(tokens, normalizer)
    if mode == "seq-mean-token-mean":
        row_sums = row_sums / tokens.clamp(min=1.0)
    return row_sums.sum() / _seq_count(tokens, row_sums.dtype, normalizer)


def agg_grad_scale(tokens: Tensor, mode: str, normalizer: float | Tensor | None = None) -> Tensor | float:
    """d L / d l_it of the aggregate L for a valid token of row i: a scalar, or [B, 1] for seq-mean-token-mean."""
    if mode == "token-mean":
        return 1.0 / _token_count(tokens, normalizer)
    per_seq = 1.0 / _seq_count(tokens, tokens.dtype, normalizer)
    if mode == "seq-mean-token-mean":
        return per_seq / tokens.clamp(min=1.0)[:, None]  # [B, 1]
    return per_seq


def _token_count(tokens: Tensor, normalizer: float | Tensor | None) -> Tensor | float:
    return tokens.sum().clamp(min=1.0) if normalizer is None else normalizer


def _seq_count(tokens: Tensor, dtype: torch.dtype, normalizer: float | Tensor | None) -> Tensor | float:
    return (tokens > 0).sum().to(dtype).clamp(min=1.0) if normalizer is None else normalizer
