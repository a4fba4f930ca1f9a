"""Top-k / top-p truncation: where sampling never draws, and the log-probs of the truncated distribution.

With top-k / top-p sampling (``top_k > 0`` or ``top_p < 1``) the log-probs are those of the
truncated, renormalised distribution the engine samples from (docs/sampling.md): the same rule,
``outside_support``, applied by the rollout engines to their logits and by the trainer to its own,
with the scored token always kept. Truncation needs each token's full row of logits, so the trainer
takes a plain autograd path (``truncated_logprobs``) over chunks of tokens, each recomputed in
backward (activation checkpointing), so it never holds more than one [chunk tokens, vocab] block per pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from vespo.models.chunked import CHUNK_ELEMENTS, as_dtype, compute_dtype, token_slices


def outside_support(z: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Where top-k / top-p sampling from logits z [N, V] (already divided by the temperature) never
    draws: [N, V] bool.

    Top-k first: tokens below the k-th largest logit are out (ties with it stay; k >= V keeps all).
    Then the nucleus of what is left: out goes every token whose strictly more likely tokens already
    hold probability >= top_p, so the most likely token always stays, and tied tokens (common with
    bfloat16 logits) are in or out together, whatever order a sort puts them in. The one rule of
    the rollout engines (``vespo.rollout.sampling_logprobs``) and of the trainer (``truncated_logprobs``).
    """
    out = torch.zeros_like(z, dtype=torch.bool)  # [N, V]
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]  # [N, 1]
        out = z < kth
    if top_p < 1.0:
        sorted_z, order = torch.sort(z.masked_fill(out, float("-inf")), dim=-1, descending=True)  # [N, V]
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [N, V] probability of the tokens sorted before
        out = out | torch.zeros_like(out).scatter(-1, order, _first_of_ties(sorted_z, mass_before) >= top_p)
    return out


def _first_of_ties(sorted_z: Tensor, values: Tensor) -> Tensor:
    """values [N, V] read at the first position of each run of equal sorted_z [N, V] (sorted descending):
    for the mass sorted before a token, the mass of the strictly larger ones."""
    position = torch.arange(sorted_z.shape[-1], device=sorted_z.device).expand_as(sorted_z)  # [N, V]
    starts = torch.ones_like(sorted_z, dtype=torch.bool)
    starts[:, 1:] = sorted_z[:, 1:] != sorted_z[:, :-1]
    first = torch.where(starts, position, 0).cummax(dim=-1).values  # [N, V] where each run starts
    return values.gather(-1, first)


def truncated_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float, top_k: int,
    top_p: float, chunk_size: int | None = None, with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log-probs [N] of targets under the truncated, renormalised distribution, and its entropy [N] (or None).

    z = (hidden @ weight.T + bias) / temperature; the tokens ``outside_support(z)`` are removed,
    except the target (a token the engine drew under other weights or kernels stays scorable:
    its log-prob is finite, renormalised over the support plus itself); then log_softmax. The
    support is chosen without gradient, as sampling chose it; the log-prob is differentiable in
    hidden, weight and bias through the renormalisation over it. Computed in float32 (float64
    for float64 hidden), over chunks of tokens of at most CHUNK_ELEMENTS logits, each recomputed
    in backward.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and weight {tuple(weight.shape)} [V, H]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] = {tuple(hidden.shape[:1])}")
    rows = chunk_size or max(1, CHUNK_ELEMENTS // weight.shape[0])  # tokens per chunk
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    parts = []
    for chunk in token_slices(hidden.shape[0], rows) or [slice(0, 0)]:  # no tokens: one empty chunk, zero gradients
        args = (hidden[chunk], weight, bias, targets[chunk], temperature, top_k, top_p)
        parts.append(checkpoint(_truncated_rows, *args, use_reentrant=False) if grad else _truncated_rows(*args))
    logp = torch.cat([p[0] for p in parts])  # [N]
    entropy = torch.cat([p[1] for p in parts])  # [N], detached
    return logp, (entropy if with_entropy else None)


def _truncated_rows(h, weight, bias, targets, temperature, top_k, top_p) -> tuple[Tensor, Tensor]:
    """``truncated_logprobs`` of one chunk of tokens: logp [C], entropy [C]. Never autocast: float32 logits."""
    dtype = compute_dtype(h)
    with torch.autocast(h.device.type, enabled=False):
        z = F.linear(h.to(dtype), weight.to(dtype), as_dtype(bias, dtype)) / temperature  # [C, V]
    with torch.no_grad():
        out = outside_support(z, top_k, top_p).scatter_(-1, targets[:, None], False)  # [C, V]
    logp_all = torch.log_softmax(z.masked_fill(out, float("-inf")), dim=-1)  # [C, V], -inf outside
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [C]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all.masked_fill(out, 0.0)).sum(-1)  # [C]
    return logp, entropy


def check_truncation(top_k: int, top_p: float) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off); got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off); got {top_p!r}")
