"""Mixture-of-experts routing: record the experts each token was sent to, and replay them.

Router replay (docs/router_replay.md) records the top-k experts every MoE layer chose at every
position of one forward pass and forces later forward passes over the same tokens to use them,
so that a numerical difference (another precision, another kernel, weights a few updates newer)
cannot flip the discrete choice. Only the selection is replayed: the gate weights are the live
router's softmax at the replayed experts, so the router still gets its gradient. Works on
routers that return ``(logits, scores, indices)`` over flattened tokens, as Qwen3-MoE's
``TopKRouter`` does.

Routing tensors are [B, S, L, K] int64 (sequences, positions, MoE layers, experts per token);
-1 marks a position with no record, where a replaying forward lets the live router choose.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

NO_RECORD = -1  # routing entry of a position that was never run


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of every MoE layer, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def is_moe(model: nn.Module) -> bool:
    return len(moe_routers(model)) > 0


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[Tensor | None]]:
    """Collects the last forward's expert indices: list over layers of [N, K] (N = B*S tokens).

    A hook registered before this one (e.g. an enclosing ``replay_routing``) has already
    replaced the router's output, so the record is what the experts were given.
    """
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
    if not records or any(r is None for r in records):
        raise RuntimeError("a MoE layer did not run during the recorded forward pass")
    layers = [r.reshape(batch, seq, -1) for r in records]  # each [B, S, K]
    return torch.stack(layers, dim=2).long()  # [B, S, L, K]


@contextmanager
def replay_routing(model: nn.Module, experts: Tensor) -> Iterator[None]:
    """Within the block, every token with a record uses the recorded experts instead of its own top-k.

    experts [B, S, L, K] int64, ``NO_RECORD`` (-1) where the live router should choose; a
    position is recorded at all K slots or at none. The routing weights are the router's own
    softmax probabilities at the replayed experts (renormalised over them when the router
    normalises its top-k), computed from the live logits, so gradient still flows into the router.
    Replaying a forward's own record therefore reproduces that forward bit for bit.
    """
    routers = moe_routers(model)
    if experts.dim() != 4 or experts.shape[2] != len(routers):
        raise ValueError(f"routed_experts must be [B, S, L={len(routers)}, K]; got {tuple(experts.shape)}")
    flat = experts.reshape(-1, experts.shape[2], experts.shape[3])  # [B*S, L, K]

    def hook_for(layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]):
            logits, scores, indices = output  # [N, E], [N, K], [N, K]
            if logits.shape[0] != flat.shape[0] or indices.shape[1] != flat.shape[2]:
                raise ValueError(f"routed_experts cover {flat.shape[0]} tokens x K={flat.shape[2]}; "
                                 f"the router saw {logits.shape[0]} tokens x K={indices.shape[1]}")
            recorded = flat[:, layer].to(indices.device)  # [N, K]
            forced = torch.where(recorded >= 0, recorded, indices)  # [N, K]
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
