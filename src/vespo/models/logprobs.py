"""Log-probs and entropy of response tokens, computed in chunks from the final hidden states.

The model body runs once over cat(prompt, response) (``response_hidden_states``), or, with
``share_prompts``, once per distinct prompt and then per group of rows of similar response
length on top of its cached keys and values (``shared_prompt_hidden_states``: the same numbers
up to float rounding, without the G-fold repeated prompts and the padding). The LM head and
log-softmax then run over blocks of [chunk tokens, vocab entries] holding at most CHUNK_ELEMENTS
logits (``chunk_shape``), inside a custom autograd function that keeps an online log-sum-exp
across vocab blocks in forward and recomputes each block's softmax in backward. So neither pass
ever holds the full [B, T, V] float32 logits: peak extra memory is about two blocks (256 MiB; 8 MiB on a CPU)
plus the V x H weight gradient that any path needs. Padded response positions are skipped entirely and read 0.
Recomputing costs one extra matmul: 4/3 of the naive path's matmul FLOPs.

With top-k / top-p sampling (``top_k > 0`` or ``top_p < 1``) the log-probs are those of the
truncated, renormalised distribution the engine samples from (docs/sampling.md): the same rule,
``outside_support``, applied to the trainer's own logits, with the scored token always kept.
Truncation needs each token's full row of logits, so that case takes a plain autograd path
(``truncated_logprobs``) over chunks of tokens, each recomputed in backward (activation
checkpointing), so it too never holds more than one [chunk tokens, vocab] block per pass.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vespo.models.moe import replay_routing
from vespo.models.checkpointing import PrefixCache

CHUNK_ELEMENTS = 1 << 25  # logits per block at most: 32M floats, 128 MiB in float32
# on a CPU, blocks that stay in its caches between the matmul that writes them and the passes that read
# them: 1M floats, 4 MiB (SmolLM2's head, 1000 tokens, one thread: 18% less time than 128 MiB blocks)
CPU_CHUNK_ELEMENTS = 1 << 20
DEFAULT_CHUNK_TOKENS = 4096  # tokens per chunk when chunk_size is None


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
    _check_truncation(top_k, top_p)
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
        logp_valid, ent_valid = _chunked(
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


def compile_decoder_layers(model: nn.Module) -> bool:
    """torch.compile each decoder layer of ``model`` in place; False (and a warning) if this machine cannot.

    The layers are where the FLOPs and the many small elementwise ops are; compiling them fuses
    the norms, rotary embedding and gated MLP into a few kernels, while masks, the KV cache and the
    LM head stay eager. Shapes are dynamic (batch and length change every step), so one graph per
    layer serves every batch. A first compilation is checked on a tiny function; if it fails (no C++
    compiler, an unsupported platform), the layers stay eager.
    """
    try:
        torch.compile(lambda x: x * 2.0, dynamic=False)(torch.ones(2))
    except Exception as e:  # noqa: BLE001 - any failure means: run eager
        warnings.warn(f"torch.compile is unavailable here ({type(e).__name__}: {e}); running eager", stacklevel=2)
        return False
    for layer in _decoder_layers(model):
        layer.compile(dynamic=True)
    return True


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    body = getattr(model, model.base_model_prefix)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise TypeError(f"compile_decoder_layers needs a model whose body has .layers; got {type(body).__name__}")
    return list(layers)


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids counting real tokens only (left padding gets position 0): [B, S]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
    chunk_size: int | None,
) -> tuple[Tensor, Tensor]:
    """log softmax((hidden @ weight.T + bias) / temperature) at targets, and entropy: [N], [N].

    Computed in float32 (float64 when hidden is float64); gradients flow to hidden, weight, bias.
    chunk_size: tokens per chunk (None: up to DEFAULT_CHUNK_TOKENS); see ``chunk_shape``.
    """
    return _chunked(hidden, weight, bias, targets, temperature, chunk_size, with_entropy=True)


def chunk_shape(tokens: int, vocab: int, chunk_size: int | None = None,
                elements: int | None = None) -> tuple[int, int]:
    """(tokens, vocab entries) of one logits block: at most ``elements`` (default CHUNK_ELEMENTS) logits.

    Tokens per chunk are chunk_size (default min(tokens, DEFAULT_CHUNK_TOKENS)); the vocabulary is
    then split into blocks of CHUNK_ELEMENTS // that many entries (at least 1, at most vocab).
    E.g. 1024 tokens, V = 151936: blocks of [1024, 32768] (5 per chunk, the last 20864 wide).
    """
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1; got {vocab}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    rows = chunk_size if chunk_size is not None else max(1, min(tokens, DEFAULT_CHUNK_TOKENS))
    return rows, min(vocab, max(1, (elements or CHUNK_ELEMENTS) // rows))


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
    for chunk in _slices(hidden.shape[0], rows) or [slice(0, 0)]:  # no tokens: one empty chunk, zero gradients
        args = (hidden[chunk], weight, bias, targets[chunk], temperature, top_k, top_p)
        parts.append(checkpoint(_truncated_rows, *args, use_reentrant=False) if grad else _truncated_rows(*args))
    logp = torch.cat([p[0] for p in parts])  # [N]
    entropy = torch.cat([p[1] for p in parts])  # [N], detached
    return logp, (entropy if with_entropy else None)


def _truncated_rows(h, weight, bias, targets, temperature, top_k, top_p) -> tuple[Tensor, Tensor]:
    """``truncated_logprobs`` of one chunk of tokens: logp [C], entropy [C]. Never autocast: float32 logits."""
    dtype = _compute_dtype(h)
    with torch.autocast(h.device.type, enabled=False):
        z = F.linear(h.to(dtype), weight.to(dtype), _as_dtype(bias, dtype)) / temperature  # [C, V]
    with torch.no_grad():
        out = outside_support(z, top_k, top_p).scatter_(-1, targets[:, None], False)  # [C, V]
    logp_all = torch.log_softmax(z.masked_fill(out, float("-inf")), dim=-1)  # [C, V], -inf outside
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [C]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all.masked_fill(out, 0.0)).sum(-1)  # [C]
    return logp, entropy


def _chunked(hidden, weight, bias, targets, temperature, chunk_size, with_entropy: bool):
    """chunked_logprobs, with entropy skipped (returned as None) when with_entropy is False."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and weight {tuple(weight.shape)} [V, H]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] = {tuple(hidden.shape[:1])}")
    elements = CPU_CHUNK_ELEMENTS if hidden.device.type == "cpu" else CHUNK_ELEMENTS
    block = chunk_shape(hidden.shape[0], weight.shape[0], chunk_size, elements)
    logp, entropy = _ChunkedLogProb.apply(hidden, weight, bias, targets, temperature, block, with_entropy)
    return logp, (entropy if with_entropy else None)


class _ChunkedLogProb(torch.autograd.Function):
    """Forward and backward over [tokens, vocab] blocks; logits are recomputed in backward, never stored.

    Forward keeps an online log-sum-exp per token across vocab blocks (running max m, sum of
    exp(z - m), and for entropy the sum of exp(z - m) (z - m)). Backward recomputes each block's
    softmax from the saved log-sum-exp. Each pass reads the weight once per token chunk, and each
    weight-gradient row is written once per token chunk. The cost over naive is one extra matmul:
    4/3 of its matmul FLOPs.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, block, with_entropy):
        dtype = _compute_dtype(hidden)
        w, b = _as_dtype(weight, dtype), _as_dtype(bias, dtype)  # converted once, not per block
        logp = hidden.new_empty(hidden.shape[0], dtype=dtype)  # [N]
        lse = torch.empty_like(logp)  # [N], kept so backward rebuilds softmax in place
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)  # [N] or [0]
        bufs = [_block_buffer(hidden, w, block, dtype) for _ in range(2 if with_entropy else 1)]
        with torch.no_grad():
            for rows in _slices(hidden.shape[0], block[0]):
                lse[rows], logp[rows], ent = _forward_rows(hidden[rows], w, b, targets[rows], temperature,
                                                           block[1], bufs)
                if with_entropy:
                    entropy[rows] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.block = temperature, block
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype = _compute_dtype(hidden)
        w, b = _as_dtype(weight, dtype), _as_dtype(bias, dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = b is not None and ctx.needs_input_grad[2]
        # every row of grad_h / grad_w is written (not added) by its first block, so no zero fill
        grad_h = torch.empty_like(hidden, dtype=dtype) if need_h else None  # [N, H]
        grad_w = None if not need_w else torch.empty_like(w) if hidden.shape[0] else torch.zeros_like(w)  # [V, H]
        grad_b = torch.zeros_like(b) if need_b else None  # [V]
        scale = grad_logp.to(dtype) / ctx.temperature  # [N]; d z / d logits = 1 / temperature
        buf = _block_buffer(hidden, w, ctx.block, dtype)
        for i, rows in enumerate(_slices(hidden.shape[0], ctx.block[0])):
            h = hidden[rows].to(dtype)  # [C, H]
            for j, cols in enumerate(_slices(w.shape[0], ctx.block[1])):
                # d logp / d z = onehot(target) - softmax(z), times the upstream grad / temperature
                g = _scaled_logits(h, w[cols], _part(b, cols), ctx.temperature, buf)  # [C, Vb], in place
                g.sub_(lse[rows, None]).exp_().mul_(-scale[rows, None])  # -softmax(z) * scale
                local, inside = _local_targets(targets[rows], cols)  # [C], [C]
                g.scatter_add_(-1, local[:, None], (scale[rows] * inside)[:, None])  # + onehot * scale
                if need_h:
                    _accumulate(grad_h[rows], g, w[cols], first=j == 0)
                if need_w:
                    _accumulate(grad_w[cols], g.T, h, first=i == 0)
                if need_b:
                    grad_b[cols] += g.sum(0)
        return (_cast(grad_h, hidden), _cast(grad_w, weight), _cast(grad_b, bias), None, None, None, None)


def _forward_rows(h, w, b, targets, temperature, block_cols, bufs):
    """Online log-sum-exp over vocab blocks for one token chunk: lse, logp, entropy (or None): [C] each.

    bufs: one flat block buffer, or two when entropy is wanted (the second holds exp(z - m)).
    """
    with_entropy = len(bufs) == 2
    m = s = t = None  # running max, sum exp(z - m), sum exp(z - m) (z - m): [C] each
    z_target = torch.zeros(h.shape[0], dtype=w.dtype, device=h.device)  # [C]
    for cols in _slices(w.shape[0], block_cols):
        z = _scaled_logits(h, w[cols], _part(b, cols), temperature, bufs[0])  # [C, Vb]
        local, inside = _local_targets(targets, cols)  # [C], [C]
        z_target = torch.where(inside, z.gather(-1, local[:, None]).squeeze(-1), z_target)
        m_block = z.amax(dim=-1)  # [C]
        m_new = m_block if m is None else torch.maximum(m, m_block)  # [C]
        zm = z.sub_(m_new[:, None])  # in place: z - m_new, all <= 0
        if with_entropy:
            e = torch.exp(zm, out=bufs[1][: zm.numel()].view_as(zm))  # [C, Vb]: zm is still needed for the dot
            s_block = e.sum(-1)  # [C]
            t_block = torch.bmm(e[:, None, :], zm[:, :, None]).view(-1)  # [C], no [C, Vb] temporary
        else:
            s_block, t_block = zm.exp_().sum(-1), None
        if m is None:
            s, t = s_block, t_block
        else:  # rescale the running sums from m to m_new: exp(z - m_new) = alpha exp(z - m)
            alpha = torch.exp(m - m_new)  # [C]
            if with_entropy:  # sum e' (z - m_new) = alpha (t + s (m - m_new))
                t = alpha * (t + s * (m - m_new)) + t_block
            s = alpha * s + s_block
        m = m_new
    log_s = s.log()  # [C]
    # entropy = lse - sum p z = (m + log s) - (t / s + m)
    return m + log_s, z_target - (m + log_s), (log_s - t / s if with_entropy else None)


def _slices(n: int, size: int) -> list[slice]:
    return [slice(k, min(k + size, n)) for k in range(0, n, size)]


def _part(b: Tensor | None, cols: slice) -> Tensor | None:
    return None if b is None else b[cols]


def _local_targets(targets: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """Target indices within the vocab block (clamped into it) and whether each falls inside: [C], [C]."""
    inside = (targets >= cols.start) & (targets < cols.stop)  # [C]
    return (targets - cols.start).clamp(0, cols.stop - cols.start - 1), inside


def _accumulate(out: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """out = a @ b on the first block, out += a @ b after; out is a view into the full gradient."""
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _scaled_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, buf: Tensor) -> Tensor:
    """Logits / temperature of one block, written into the flat buffer buf: [C, Vb].

    weight and bias are already in the compute dtype. The 1 / temperature is applied to the
    [C, H] input and the bias, not to the [C, Vb] output. Reusing one buffer for every block saves
    a fresh allocation (and its page faults) per block.
    """
    h = h.to(weight.dtype) if temperature == 1.0 else h.to(weight.dtype) / temperature  # [C, H]
    out = buf[: h.shape[0] * weight.shape[0]].view(h.shape[0], weight.shape[0])  # [C, Vb]
    if bias is None:
        return torch.mm(h, weight.T, out=out)
    b = bias if temperature == 1.0 else bias / temperature  # [Vb]
    return torch.addmm(b, h, weight.T, out=out)


def _block_buffer(hidden: Tensor, weight: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """One flat buffer big enough for any [C, Vb] block of this call: [C * Vb]."""
    rows, cols = min(block[0], hidden.shape[0]), min(block[1], weight.shape[0])
    return torch.empty(rows * cols, dtype=dtype, device=hidden.device)


def _as_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


def _compute_dtype(h: Tensor) -> torch.dtype:
    """float32 for half-precision and float32 inputs, float64 for float64 ones."""
    return torch.promote_types(h.dtype, torch.float32)


def _cast(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if grad is None or like is None else grad.to(like.dtype)


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


def _check_truncation(top_k: int, top_p: float) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off); got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off); got {top_p!r}")


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
