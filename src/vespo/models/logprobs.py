"""Log-probs and entropy of response tokens: the policy's forward paths to the final hidden states.

The model body runs once over cat(prompt, response) (``response_hidden_states``), or, with
``share_prompts``, once per distinct prompt and then per group of rows of similar response
length on top of its cached keys and values (``shared_prompt_hidden_states``: the same numbers
up to float rounding, without the G-fold repeated prompts and the padding). Padded response
positions are skipped entirely and read 0. The LM head then runs on the valid positions' hidden
states in the chunked autograd kernel (vespo.models.chunked), or, under top-k / top-p
sampling, over the truncated distribution (vespo.models.truncation; docs/sampling.md).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vespo.models.checkpointing import PrefixCache
from vespo.models.chunked import chunked_logprobs
from vespo.models.moe import replay_routing
from vespo.models.truncation import check_truncation, truncated_logprobs


def response_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    routed_experts: Tensor | None = None,
    share_prompts: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """logp [B, T] float32 (float64 for a float64 model; with grad when enabled) and entropy [B, T] detached
    (or None).

    prompt_ids/prompt_mask [B, P] left-padded; response_ids/response_mask [B, T] right-padded.
    routed_experts [B, P+T, L, K]: MoE experts to replay at every position of cat(prompt, response)
    (router replay, docs/router_replay.md); -1 where the live router chooses.
    chunk_size: tokens per chunk, None (the default) for ``chunk_shape``'s; entropy is only computed
    when with_entropy is True.
    share_prompts: run each distinct prompt once for all the rows that share it (see
    ``shared_prompt_hidden_states``): the same numbers up to float rounding, faster for groups.
    The model then runs twice (prompts, responses) rather than once over cat(prompt, response),
    so it cannot be combined with routed_experts, nor with hooks that expect that one pass.
    top_k / top_p: the sampling truncation (0 / 1.0: none, the full softmax). With either on, logp
    and entropy are those of the truncated, renormalised distribution of logits / temperature,
    the scored token always inside it (``truncated_logprobs``; docs/sampling.md).
    """
    _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask, temperature, chunk_size)
    check_truncation(top_k, top_p)
    if share_prompts and routed_experts is not None:
        raise ValueError("share_prompts cannot replay routed_experts: router replay indexes one pass over "
                         "cat(prompt, response)")
    states = shared_prompt_hidden_states if share_prompts else response_hidden_states
    hidden = states(model, prompt_ids, prompt_mask, response_ids, response_mask, routed_experts)
    valid = response_mask > 0  # [B, T]
    head = _lm_head(model)
    if top_k > 0 or top_p < 1.0:
        logp_valid, ent_valid = truncated_logprobs(
            hidden[valid], head.weight, head.bias, response_ids[valid], temperature, top_k, top_p, chunk_size,
            with_entropy,
        )  # [N], [N] or None
    else:
        logp_valid, ent_valid = chunked_logprobs(
            hidden[valid], head.weight, head.bias, response_ids[valid], temperature, chunk_size, with_entropy
        )  # [N], [N] or None
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logp = torch.zeros(valid.shape, dtype=dtype, device=hidden.device)  # [B, T]
    logp = logp.masked_scatter(valid, logp_valid.to(dtype))
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(logp, requires_grad=False).masked_scatter(valid, ent_valid.detach())
    return logp, entropy


def response_hidden_states(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    routed_experts: Tensor | None = None,
) -> Tensor:
    """Final hidden states at the positions that predict each response token: [B, T, H].

    One forward over every position of cat(prompt, response) (replaying routed_experts if given).
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+T]
    attention_mask = torch.cat([prompt_mask.long(), (response_mask > 0).long()], dim=1)  # [B, P+T]
    position_ids = positions_from_mask(attention_mask)  # [B, P+T]
    body = getattr(model, model.base_model_prefix)
    P, T = prompt_ids.shape[1], response_ids.shape[1]
    with _maybe_replay(model, routed_experts, input_ids):
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[:, P - 1 : P + T - 1]  # [B, T, H]


def shared_prompt_hidden_states(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    routed_experts: Tensor | None = None,
) -> Tensor:
    """``response_hidden_states`` without repeated prompts or padding runs: [B, T, H] (0 past a row's end).

    Each distinct prompt runs once (the G responses of a group share it), recording its keys and
    values in a ``PrefixCache``. The rows are then grouped by response length (``length_groups``)
    and each group runs only as far as its longest response, on top of a gather of its rows' prompt
    keys and values (differentiable, so the gradients of the rows that share a prompt add up), so
    short answers do not pay for the batch's longest one. The last response position predicts
    nothing and is not run. The tokens are embedded in one lookup for all the passes. Every cache update is a function of its inputs, so activation
    checkpointing may recompute any layer. With routed_experts (router replay needs one pass over every
    position) or a model with linear-attention layers (whose recurrent state a prefix of keys cannot
    carry) it is ``response_hidden_states``.
    """
    if routed_experts is not None or 0 in response_ids.shape or not PrefixCache.fits(model.config):
        return response_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask, routed_experts)
    B, T = response_ids.shape
    body = getattr(model, model.base_model_prefix)
    distinct, copies = distinct_rows(torch.cat([prompt_ids, prompt_mask.long()], dim=1))  # [U], [B]
    if distinct is None:  # every prompt differs: each row is its own
        distinct = copies = torch.arange(B, device=prompt_ids.device)
    # one embedding lookup for every pass, so its backward fills one [V, H] gradient, not one per pass
    U, P = len(distinct), prompt_ids.shape[1]
    embedded = body.get_input_embeddings()(torch.cat([prompt_ids[distinct].flatten(), response_ids.flatten()]))
    prompt_embeds, response_embeds = embedded[: U * P].unflatten(0, (U, P)), embedded[U * P:].unflatten(0, (B, T))
    prompts = PrefixCache(model.config)
    prompt_out = prompts.run(body, inputs_embeds=prompt_embeds, attention_mask=prompt_mask[distinct].long(),
                             position_ids=positions_from_mask(prompt_mask[distinct]))  # [U, P, H]
    lengths = (response_mask > 0).sum(dim=1).tolist()  # [B] valid tokens per row (a prefix of the row)
    parts, order = [], []
    for rows, longest in length_groups(lengths, GROUP_OVERHEAD_TOKENS):
        idx = torch.tensor(rows, device=response_ids.device)
        width = max(longest, 1)
        hidden = prompt_out[copies[idx], -1:]  # [b, 1, H], predicts response token 0
        if width > 1:
            mask = torch.cat([prompt_mask[idx].long(), (response_mask[idx, : width - 1] > 0).long()], dim=1)
            rest = prompts.select(copies[idx]).run(
                body, inputs_embeds=response_embeds[idx, : width - 1], attention_mask=mask,
                position_ids=positions_from_mask(mask)[:, P:])  # [b, width-1, H]
            hidden = torch.cat([hidden, rest], dim=1)  # [b, width, H]
        parts.append(F.pad(hidden, (0, 0, 0, T - width)))  # [b, T, H], zeros past the group's longest row
        order += rows
    inverse = torch.empty(B, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(B)
    return torch.cat(parts)[inverse.to(response_ids.device)]  # [B, T, H], the caller's row order


# One more length group costs about as much as this many more tokens: on the xs tiny model its
# per-operator costs, on SmolLM2-135M the full weight gradient it writes and adds once more (CPU, one
# thread, bench/real_model.py's batch: 16 to 160 agree within noise on both, 3 is 25% slower on SmolLM2).
GROUP_OVERHEAD_TOKENS = 64


def length_groups(lengths: list[int], overhead: int) -> list[tuple[list[int], int]]:
    """Rows grouped by length so that the sum over groups of (overhead + rows x longest length) is least.

    Groups are runs of the rows sorted by length, longest first; returns (row indices, longest
    length) per group. Dynamic programming over the distinct lengths. E.g. lengths [64, 3, 60, 2]
    with overhead 8: {64, 60} then {3, 2} costs (8 + 2*64) + (8 + 2*3) = 150, one group 8 + 4*64 = 264.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    values = [lengths[i] for i in order]
    n = len(values)
    starts = [k for k in range(n) if k == 0 or values[k] != values[k - 1]] + [n]  # where a group may start
    best = {n: (0, n)}  # start -> (least cost of rows start.., end of its first group)
    for a in reversed(starts[:-1]):
        best[a] = min((overhead + (b - a) * values[a] + best[b][0], b) for b in starts if b > a)
    groups, a = [], 0
    while a < n:
        b = best[a][1]
        groups.append(([order[k] for k in range(a, b)], values[a]))
        a = b
    return groups


def distinct_rows(rows: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """One representative of each distinct row of ``rows`` [B, S], and which one each row is.

    Returns (indices [U] of the first copy of each distinct row, index [B] into those U), or
    (None, None) when all B rows differ. E.g. rows a, b, a -> ([0, 1], [0, 1, 0]).
    """
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)  # [U, S], [B]
    if unique.shape[0] == rows.shape[0]:
        return None, None
    first = torch.full((unique.shape[0],), rows.shape[0], dtype=torch.long, device=rows.device)
    first = first.scatter_reduce(0, inverse, torch.arange(rows.shape[0], device=rows.device), reduce="amin")  # [U]
    return first, inverse


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids counting real tokens only (left padding gets position 0): [B, S]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def _lm_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"response_logprobs needs a plain nn.Linear LM head; got {type(head).__name__}")
    return head


def _maybe_replay(model: nn.Module, routed_experts: Tensor | None, input_ids: Tensor):
    """Router replay over every position of input_ids [B, P+T], or a no-op."""
    if routed_experts is None:
        return nullcontext()
    if routed_experts.dim() != 4 or routed_experts.shape[:2] != input_ids.shape:
        raise ValueError(f"routed_experts must be [B, P+T, L, K] with [B, P+T] = {tuple(input_ids.shape)}; "
                         f"got {tuple(routed_experts.shape)}")
    return replay_routing(model, routed_experts)


def _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask, temperature, chunk_size) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} "
                         "must both be [B, P]")
    if response_ids.dim() != 2 or response_ids.shape != response_mask.shape:
        raise ValueError(f"response_ids {tuple(response_ids.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must both be [B, T]")
    if prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(f"prompt_ids has {prompt_ids.shape[0]} rows, response_ids {response_ids.shape[0]}")
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompt_ids has no columns: every response needs at least one prompt token")
    if not bool((prompt_mask[:, -1] > 0).all()):
        raise ValueError("prompt_mask must be left-padded: the last prompt column must be a real token in every row")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
