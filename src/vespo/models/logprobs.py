"""Log-probs and entropy of response tokens, computed in chunks from the final hidden states.

The model body runs once over cat(prompt, response); the LM head and log-softmax then run over
``chunk_size`` response tokens at a time, inside a custom autograd function whose backward
recomputes each chunk's softmax. So neither pass ever holds the full [B, T, V] float32 logits:
peak extra memory is about chunk_size x V floats. Padded response positions are skipped entirely
and read 0.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vespo.models.moe import replay_routing


def response_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    routed_experts: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """logp [B, T] float32 (with grad when enabled) and entropy [B, T] detached (or None).

    prompt_ids/prompt_mask [B, P] left-padded; response_ids/response_mask [B, T] right-padded.
    routed_experts [B, T, L, K]: experts to replay at the position that predicts each response
    token (router replay); prompt positions keep their own routing.
    """
    _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask, temperature, chunk_size)
    hidden = response_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask, routed_experts)
    valid = response_mask > 0  # [B, T]
    head = _lm_head(model)
    logp_valid, ent_valid = chunked_logprobs(
        hidden[valid], head.weight, head.bias, response_ids[valid], temperature, chunk_size
    )  # [N], [N]
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
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """log softmax((hidden @ weight.T + bias) / temperature) at targets, and entropy: [N], [N].

    Computed in float32 (float64 when hidden is float64); gradients flow to hidden, weight, bias.
    """
    return _ChunkedLogProb.apply(hidden, weight, bias, targets, temperature, chunk_size)


class _ChunkedLogProb(torch.autograd.Function):
    """Forward and backward over token chunks; logits are recomputed in backward, never stored."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        logp = hidden.new_empty(hidden.shape[0], dtype=_compute_dtype(hidden))  # [N]
        entropy = torch.empty_like(logp)  # [N]
        lse = torch.empty_like(logp)  # [N], kept so backward rebuilds softmax in place
        with torch.no_grad():
            for s in range(0, hidden.shape[0], chunk_size):
                z = _scaled_logits(hidden[s : s + chunk_size], weight, bias, temperature)  # [C, V]
                lse[s : s + chunk_size] = torch.logsumexp(z, dim=-1)
                logsm = z.sub_(lse[s : s + chunk_size, None])  # in place: z is now log-softmax
                logp[s : s + chunk_size] = logsm.gather(-1, targets[s : s + chunk_size, None]).squeeze(-1)
                entropy[s : s + chunk_size] = -(logsm.exp() * logsm).sum(-1)
                del z, logsm
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype = _compute_dtype(hidden)
        w32 = weight.to(dtype)
        grad_h = torch.zeros_like(hidden, dtype=dtype) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w32) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias, dtype=dtype) if bias is not None and ctx.needs_input_grad[2] else None
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            h = hidden[s : s + ctx.chunk_size].to(dtype)  # [C, H]
            # d logp / d z = onehot(target) - softmax(z); d z / d logits = 1 / temperature
            g = _scaled_logits(h, w32, bias, ctx.temperature)  # [C, V], one buffer reused in place
            g.sub_(lse[s : s + ctx.chunk_size, None]).exp_().neg_()  # -softmax(z)
            g.scatter_add_(-1, targets[s : s + ctx.chunk_size, None], torch.ones_like(g[:, :1]))
            g *= grad_logp[s : s + ctx.chunk_size, None] / ctx.temperature  # [C, V]
            if grad_h is not None:
                grad_h[s : s + ctx.chunk_size] = g @ w32
            if grad_w is not None:
                grad_w.addmm_(g.T, h)
            if grad_b is not None:
                grad_b += g.sum(0)
        return (_cast(grad_h, hidden), _cast(grad_w, weight), _cast(grad_b, bias), None, None, None)


def _scaled_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """Logits / temperature of one chunk, in float32 (float64 for float64 inputs): [C, V]."""
    dtype = _compute_dtype(h)
    b = None if bias is None else bias.to(dtype)
    return F.linear(h.to(dtype), weight.to(dtype), b).div_(temperature)


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
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
