"""Aggregation of a per-token loss matrix into a scalar: token-mean and the sequence means.

    token-mean               sum_it m_it l_it / N_tokens
    seq-mean-token-mean      sum_i (sum_t m_it l_it / T_i) / N_seqs
    seq-mean-token-sum       sum_i (sum_t m_it l_it) / N_seqs
    seq-mean-token-sum-norm  sum_i (sum_t m_it l_it) / (N_seqs C)     Dr.GRPO, C a constant length

seq-mean-token-sum-norm is verl's (``agg_loss``, C = ``loss_scale_factor``) and TRL's ``dr_grpo``
(C = ``max_completion_length``; TRL's N_seqs counts rows without valid tokens too): every token weighs
the same whatever its sequence's length, and C is given, never the batch's padded width.

Each is a weighted sum sum_it a_it l_it with the token weight a_it of :func:`token_weights`.
Without a normalizer, N_tokens is the number of valid tokens and N_seqs the number of sequences
with at least one valid token (an all-masked row contributes nothing and is not counted). A
normalizer given by the caller replaces N_tokens or N_seqs: pass the count of the whole
mini-batch (over every micro-batch and every rank) and the micro-batches' losses and gradients
sum to the mini-batch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vespo.losses.inputs import check_normalizer

NORM_AGG = "seq-mean-token-sum-norm"  # the mode that takes a constant length C (norm_length)
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", NORM_AGG)


def check_agg_mode(mode: str, field: str = "agg") -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"{field} must be one of {', '.join(AGG_MODES)}; got {mode!r}")


def token_weights(mask_f: Tensor, mode: str, normalizer: float | Tensor | None = None,
                  norm_length: float | None = None) -> Tensor:
    """a_it, the weight of token (i, t) in the aggregate: 0 on padding.  # [B, T]

    ``mask_f [B, T]`` is the 0/1 mask in the loss's dtype; ``norm_length`` is C of seq-mean-token-sum-norm.
    """
    check_agg_mode(mode, "mode")
    check_normalizer(normalizer)
    if (mode == NORM_AGG) != (norm_length is not None):
        raise ValueError(f"norm_length is required with mode {NORM_AGG} and applies to it only; got mode {mode!r}, "
                         f"norm_length {norm_length!r}")
    tokens = mask_f.sum(dim=-1, keepdim=True)  # [B, 1]
    if mode == "token-mean":
        count = tokens.sum().clamp(min=1.0) if normalizer is None else normalizer
        return mask_f / count
    seqs = (tokens > 0).sum().clamp(min=1).to(mask_f.dtype) if normalizer is None else normalizer
    if mode == "seq-mean-token-mean":
        return mask_f / (tokens.clamp(min=1.0) * seqs)
    if mode == NORM_AGG:
        return mask_f / (seqs * norm_length)
    return mask_f / seqs


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str, normalizer: float | Tensor | None = None,
              norm_length: float | None = None) -> Tensor:
    """Reduce ``loss_mat [B, T]`` over the valid tokens of ``mask [B, T]`` to a scalar by ``mode``.

    Masked positions are excluded with ``where`` (not multiplied by 0), so padding that holds
    NaN/inf cannot leak into the result or its gradient.
    """
    check_agg_mode(mode, "mode")
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat shape {tuple(loss_mat.shape)} does not match mask shape {tuple(mask.shape)}")
    mask_b = mask if mask.dtype == torch.bool else mask != 0
    masked = torch.where(mask_b, loss_mat, loss_mat.new_zeros(()))  # [B, T]
    return (masked * token_weights(mask_b.to(loss_mat.dtype), mode, normalizer, norm_length)).sum()
