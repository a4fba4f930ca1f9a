"""Log-probs and entropy of response tokens, computed in chunks from the final hidden states.

The model body runs once over cat(prompt, response); the LM head and log-softmax then run over
``chunk_size`` response tokens at a time, inside a custom autograd function whose backward
recomputes each chunk's softmax. So neither pass ever holds the full [B, T, V] float32 logits:
peak extra memory is about two chunk_size x V blocks (plus the V x H weight gradient that any
path needs). The default chunk size adapts to the vocabulary: CHUNK_ELEMENTS // V tokens.
Padded response positions are skipped entirely and read 0. Recomputing costs one extra
[C, H] x [H, V] matmul per chunk, about 4/3 of the naive path's matmul FLOPs.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vespo.models.moe import replay_routing

CHUNK_ELEMENTS = 1 << 25  # logits per chunk by default: 32M floats, 128 MiB in float32


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
) -> tuple[Tensor, Tensor | None]:
    """logp [B, T] float32 (with grad when enabled) and entropy [B, T] detached (or None).

    prompt_ids/prompt_mask [B, P] left-padded; response_ids/response_mask [B, T] right-padded.
    routed_experts [B, T, L, K]: experts to replay at the position that predicts each response
    token (router replay); prompt positions keep their own routing.
    chunk_size None (the default) picks ``default_chunk_size(V)``; entropy is only computed
    when with_entropy is True.
    """
    _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask, temperature, chunk_size)
    hidden = response_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask, routed_experts)
    valid = response_mask > 0  # [B, T]
    head = _lm_head(model)
    logp_valid, ent_valid = _chunked(
        hidden[valid], head.weight, head.bias, response_ids[valid], temperature, chunk_size, with_entropy
    )  # [N], [N] or None
    logp = torch.zeros(valid.shape, dtype=torch.float32, device=hidden.device)  # [B, T]
    logp = logp.masked_scatter(valid, logp_valid.float())
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
    """Final hidden states at the positions that predict each response token: [B, T, H]."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+T]
    attention_mask = torch.cat([prompt_mask.long(), (response_mask > 0).long()], dim=1)  # [B, P+T]
    position_ids = positions_from_mask(attention_mask)  # [B, P+T]
    body = getattr(model, model.base_model_prefix)
    P, T = prompt_ids.shape[1], response_ids.shape[1]
    with _maybe_replay(model, routed_experts, response_mask, P):
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[:, P - 1 : P + T - 1]  # [B, T, H]


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids counting real tokens only (left padding gets position 0): [B, S]."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
    chunk_size: int | None,
) -> tuple[Tensor, Tensor]:
    """log softmax((hidden @ weight.T + bias) / temperature) at targets, and entropy: [N], [N].

    Computed in float32 (float64 when hidden is float64); gradients flow to hidden, weight, bias.
    chunk_size None picks ``default_chunk_size(V)``.
    """
    return _chunked(hidden, weight, bias, targets, temperature, chunk_size, with_entropy=True)


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk so that one [C, V] float32 block holds about CHUNK_ELEMENTS logits."""
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1; got {vocab}")
    return max(1, CHUNK_ELEMENTS // vocab)


def _chunked(hidden, weight, bias, targets, temperature, chunk_size, with_entropy: bool):
    """chunked_logprobs, with entropy skipped (returned as None) when with_entropy is False."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and weight {tuple(weight.shape)} [V, H]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] = {tuple(hidden.shape[:1])}")
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    logp, entropy = _ChunkedLogProb.apply(hidden, weight, bias, targets, temperature, chunk_size, with_entropy)
    return logp, (entropy if with_entropy else None)


class _ChunkedLogProb(torch.autograd.Function):
    """Forward and backward over token chunks; logits are recomputed in backward, never stored.

    Per chunk, forward is one matmul and 3-4 passes over the [C, V] block (max, shift, exp, and a
    row dot for entropy); backward is the recomputing matmul, 3 passes (shift, exp, scale), and the
    two gradient matmuls. So the cost over naive is one extra matmul: about 4/3 of its FLOPs.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy):
        dtype = _compute_dtype(hidden)
        w, b = _as_dtype(weight, dtype), _as_dtype(bias, dtype)  # converted once, not per chunk
        logp = hidden.new_empty(hidden.shape[0], dtype=dtype)  # [N]
        lse = torch.empty_like(logp)  # [N], kept so backward rebuilds softmax in place
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)  # [N] or [0]
        with torch.no_grad():
            for s in range(0, hidden.shape[0], chunk_size):
                rows = slice(s, s + chunk_size)
                z = _scaled_logits(hidden[rows], w, b, temperature)  # [C, V]
                m = z.amax(dim=-1, keepdim=True)  # [C, 1]
                zm = z.sub_(m)  # in place: z - max, all <= 0
                z_target = zm.gather(-1, targets[rows, None]).squeeze(-1)  # [C]
                if with_entropy:
                    e = torch.exp(zm)  # [C, V], a second block: zm is still needed for the dot
                    sum_e = e.sum(-1)  # [C]
                    # H = lse - sum(p z) = log(sum_e) - sum(e (z - m)) / sum_e
                    dot = torch.bmm(e[:, None, :], zm[:, :, None]).view(-1)  # [C], no [C, V] temporary
                    entropy[rows] = sum_e.log() - dot / sum_e
                    del e
                else:
                    sum_e = zm.exp_().sum(-1)  # [C]
                log_sum_e = sum_e.log()  # [C]
                lse[rows] = m.squeeze(-1) + log_sum_e
                logp[rows] = z_target - log_sum_e
                del z, zm
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype = _compute_dtype(hidden)
        w, b = _as_dtype(weight, dtype), _as_dtype(bias, dtype)
        grad_h = torch.empty_like(hidden, dtype=dtype) if ctx.needs_input_grad[0] else None  # [N, H]
        grad_w = None  # [V, H], born from the first chunk's matmul (no zero fill)
        grad_b = torch.zeros_like(b) if b is not None and ctx.needs_input_grad[2] else None  # [V]
        scale = grad_logp.to(dtype) / ctx.temperature  # [N]; d z / d logits = 1 / temperature
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(s, s + ctx.chunk_size)
            h = hidden[rows].to(dtype)  # [C, H]
            # d logp / d z = onehot(target) - softmax(z), times the upstream grad / temperature
            g = _scaled_logits(h, w, b, ctx.temperature)  # [C, V], one buffer reused in place
            g.sub_(lse[rows, None]).exp_().mul_(-scale[rows, None])  # -softmax(z) * scale
            g.scatter_add_(-1, targets[rows, None], scale[rows, None])  # + onehot * scale
            if grad_h is not None:
                torch.mm(g, w, out=grad_h[rows])
            if ctx.needs_input_grad[1]:
                grad_w = g.T @ h if grad_w is None else grad_w.addmm_(g.T, h)
            if grad_b is not None:
                grad_b += g.sum(0)
            del g
        if ctx.needs_input_grad[1] and grad_w is None:  # no tokens at all
            grad_w = torch.zeros_like(w)
        return (_cast(grad_h, hidden), _cast(grad_w, weight), _cast(grad_b, bias), None, None, None, None)


def _scaled_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """Logits / temperature of one chunk: [C, V]. weight and bias are already in the compute dtype.

    The 1 / temperature is applied to the [C, H] input and the bias, not to the [C, V] output.
    """
    dtype = weight.dtype
    h = h.to(dtype) if temperature == 1.0 else h.to(dtype) / temperature  # [C, H]
    b = bias if bias is None or temperature == 1.0 else bias / temperature  # [V]
    return F.linear(h, weight, b)


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


def _maybe_replay(model: nn.Module, routed_experts: Tensor | None, response_mask: Tensor, P: int):
    """Router replay over the positions predicting response tokens, or a no-op."""
    if routed_experts is None:
        return nullcontext()
    B, T = response_mask.shape
    L, K = routed_experts.shape[2], routed_experts.shape[3]
    if routed_experts.shape[:2] != (B, T):
        raise ValueError(f"routed_experts must start with [B, T] = {(B, T)}; got {tuple(routed_experts.shape)}")
    experts = routed_experts.new_zeros(B, P + T, L, K)  # [B, P+T, L, K]
    where = torch.zeros(B, P + T, dtype=torch.bool, device=response_mask.device)  # [B, P+T]
    experts[:, P - 1 : P + T - 1] = routed_experts
    where[:, P - 1 : P + T - 1] = response_mask > 0
    return replay_routing(model, experts, where)


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
