"""Mixture-of-experts routing: record the experts each token was sent to, and replay them.

The rollout engine records, per MoE layer, the top-k experts the router chose; router replay
(R2, SPEC §4.3) then forces the training forward pass to use the same experts, so a tiny
numerical difference between engine and trainer cannot flip routing. Works on routers that
return ``(logits, scores, indices)`` over flattened tokens, as Qwen3-MoE's ``TopKRouter`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of every MoE layer, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def is_moe(model: nn.Module) -> bool:
    return len(moe_routers(model)) > 0


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[Tensor | None]]:
    """Collects the last forward's expert indices: list over layers of [N, K] (N = B*S tokens)."""
    routers = moe_routers(model)
    records: list[Tensor | None] = [None] * len(routers)

    def hook_for(layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
            records[layer] = output[2].detach()  # [N, K]
        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def stack_routing(records: list[Tensor | None], batch: int, seq: int) -> Tensor:
    """Per-layer [B*S, K] records -> [B, S, L, K] int64."""
    if any(r is None for r in records):
        raise RuntimeError("a MoE layer did not run during the recorded forward pass")
    layers = [r.reshape(batch, seq, -1) for r in records]  # each [B, S, K]
    return torch.stack(layers, dim=2).long()  # [B, S, L, K]


@contextmanager
def replay_routing(model: nn.Module, experts: Tensor, where: Tensor) -> Iterator[None]:
    """Within the block, tokens with ``where`` use the given experts instead of their own top-k.

    experts [B, S, L, K] int64, where [B, S] bool. Routing weights are the router's own softmax
    probabilities at the replayed experts (renormalised when the router normalises its top-k), so
    gradient still flows into the router.
    """
    routers = moe_routers(model)
    if experts.dim() != 4 or experts.shape[2] != len(routers):
        raise ValueError(f"routed_experts must be [B, S, L={len(routers)}, K]; got {tuple(experts.shape)}")
    flat_experts = experts.reshape(-1, experts.shape[2], experts.shape[3])  # [B*S, L, K]
    flat_where = where.reshape(-1)  # [B*S]

    def hook_for(layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]):
            logits, scores, indices = output  # [N, E], [N, K], [N, K]
            if logits.shape[0] != flat_where.shape[0]:
                raise ValueError(f"routed_experts cover {flat_where.shape[0]} tokens, the router saw {logits.shape[0]}")
            forced = torch.where(flat_where[:, None], flat_experts[:, layer].to(indices.device), indices)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
            weights = probs.gather(-1, forced)  # [N, K]
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), forced
        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
