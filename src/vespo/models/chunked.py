"""The LM head's log-softmax in [tokens, vocab] blocks: log-probs and entropy without the full logits.

``chunked_logprobs(hidden, weight, bias, targets, temperature, chunk_size)`` runs the LM head and
log-softmax over blocks of [chunk tokens, vocab entries] holding at most CHUNK_ELEMENTS logits
(``chunk_shape``), inside a custom autograd function that keeps an online log-sum-exp across vocab
blocks in forward and recomputes each block's softmax in backward. So neither pass ever holds the
full [N, V] float32 logits: peak extra memory is about two blocks (256 MiB; 8 MiB on a CPU) plus
the V x H weight gradient that any path needs. Recomputing costs one extra matmul: 4/3 of the naive
path's matmul FLOPs. Its oracle is the plain log_softmax (tests/models/test_logprobs.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 25  # logits per block at most: 32M floats, 128 MiB in float32
# on a CPU, blocks that stay in its caches between the matmul that writes them and the passes that read
# them: 1M floats, 4 MiB (SmolLM2's head, 1000 tokens, one thread: 18% less time than 128 MiB blocks)
CPU_CHUNK_ELEMENTS = 1 << 20
DEFAULT_CHUNK_TOKENS = 4096  # tokens per chunk when chunk_size is None


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
    chunk_size: int | None, with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log softmax((hidden @ weight.T + bias) / temperature) at targets, and entropy: [N], [N] (None when
    ``with_entropy`` is False: not computed).

    Computed in float32 (float64 when hidden is float64); gradients flow to hidden, weight, bias.
    chunk_size: tokens per chunk (None: up to DEFAULT_CHUNK_TOKENS); see ``chunk_shape``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and weight {tuple(weight.shape)} [V, H]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] = {tuple(hidden.shape[:1])}")
    elements = CPU_CHUNK_ELEMENTS if hidden.device.type == "cpu" else CHUNK_ELEMENTS
    block = chunk_shape(hidden.shape[0], weight.shape[0], chunk_size, elements)
    logp, entropy = _ChunkedLogProb.apply(hidden, weight, bias, targets, temperature, block, with_entropy)
    return logp, (entropy if with_entropy else None)


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
        dtype = compute_dtype(hidden)
        w, b = as_dtype(weight, dtype), as_dtype(bias, dtype)  # converted once, not per block
        logp = hidden.new_empty(hidden.shape[0], dtype=dtype)  # [N]
        lse = torch.empty_like(logp)  # [N], kept so backward rebuilds softmax in place
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)  # [N] or [0]
        bufs = [_block_buffer(hidden, w, block, dtype) for _ in range(2 if with_entropy else 1)]
        with torch.no_grad():
            for rows in token_slices(hidden.shape[0], block[0]):
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
        dtype = compute_dtype(hidden)
        w, b = as_dtype(weight, dtype), as_dtype(bias, dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = b is not None and ctx.needs_input_grad[2]
        # every row of grad_h / grad_w is written (not added) by its first block, so no zero fill
        grad_h = torch.empty_like(hidden, dtype=dtype) if need_h else None  # [N, H]
        grad_w = None if not need_w else torch.empty_like(w) if hidden.shape[0] else torch.zeros_like(w)  # [V, H]
        grad_b = torch.zeros_like(b) if need_b else None  # [V]
        scale = grad_logp.to(dtype) / ctx.temperature  # [N]; d z / d logits = 1 / temperature
        buf = _block_buffer(hidden, w, ctx.block, dtype)
        for i, rows in enumerate(token_slices(hidden.shape[0], ctx.block[0])):
            h = hidden[rows].to(dtype)  # [C, H]
            for j, cols in enumerate(token_slices(w.shape[0], ctx.block[1])):
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
    for cols in token_slices(w.shape[0], block_cols):
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


def token_slices(n: int, size: int) -> list[slice]:
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


def as_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


def compute_dtype(h: Tensor) -> torch.dtype:
    """float32 for half-precision and float32 inputs, float64 for float64 ones."""
    return torch.promote_types(h.dtype, torch.float32)


def _cast(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if grad is None or like is None else grad.to(like.dtype)
