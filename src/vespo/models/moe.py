"""Mixture-of-experts routing: record the experts each token was sent to, replay them, count the replay.

Router replay (docs/router_replay.md) records the top-k experts every MoE layer chose at every
position of one forward pass and forces later forward passes over the same tokens to use them,
so that a numerical difference (another precision, another kernel, weights a few updates newer)
cannot flip the discrete choice. Only the selection is replayed: the gate weights are recomputed
from the live router logits by the family's own gate rule (``vespo.models.moe_families``), so
the router still gets its gradient, and replaying a forward's own record reproduces it bit for bit.

Each supported family is listed explicitly; a model holding a router or MoE block of any other
class stops record and replay with a ``ModelError`` naming the class, rather than running
unreplayed. A dense model has no routers: record gives nothing and replay changes nothing.

Routing tensors are [B, S, L, K] int64 (sequences, positions, MoE layers, experts per token);
-1 marks a position with no record, where a replaying forward lets the live router choose.

    with count_replay(model) as count:          # optional: how much of the routing was forced
        with replay_routing(model, experts):    # experts [B, S, L, K]
            model(input_ids, attention_mask=mask)
    count.forced / count.routed                 # 1.0 when every position that matters was replayed
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vespo.errors import ModelError
from vespo.models.moe_families import FAMILIES, MoEFamily, family_of, looks_like_moe

NO_RECORD = -1  # routing entry of a position that was never run


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer, in layer order (empty for a dense model).

    Raises ``ModelError`` naming the class when the model holds a router or MoE block of a family
    replay does not know: replaying around it would silently do nothing.
    """
    return [router for router, _ in _routers(model)]


def _routers(model: nn.Module) -> list[tuple[nn.Module, MoEFamily]]:
    """(router, its family) of every MoE layer, in layer order; an unknown MoE raises."""
    named = [(name, m, family_of(m)) for name, m in model.named_modules()]
    known = [(name, m, family) for name, m, family in named if family is not None]
    _check_known(model, [name for name, _, _ in known])
    return [(m, family) for _, m, family in known]


def is_moe(model: nn.Module) -> bool:
    """Whether the model routes tokens to experts (a known family or not; never raises)."""
    return any(family_of(m) is not None or looks_like_moe(m) for m in model.modules())


def _check_known(model: nn.Module, router_names: list[str]) -> None:
    """Every router-like module is a known router, a part of one, or an MoE block holding one.

    An unknown router is named before an unknown block, the block being what holds it.
    """
    known = set(router_names)
    unknown = []
    for name, module in model.named_modules():
        if name in known or not looks_like_moe(module):
            continue
        around = any(r.startswith(f"{name}.") or not name for r in known)  # an MoE block holding a known router
        inside = any(name.startswith(f"{r}.") for r in known)  # a part of a known router
        if not (around or inside):
            unknown.append((name, type(module).__name__))
    if unknown:
        name, cls = min(unknown, key=lambda u: "router" not in u[1].lower())
        supported = ", ".join(f.name for f in FAMILIES)
        raise ModelError(f"router replay does not know the MoE module {cls} ({name}): it supports {supported} "
                         "(docs/router_replay.md); use rollout.router_replay=none")


def _check_eager(model: nn.Module, what: str) -> None:
    """Replay and record hook the routers; a compiled graph would ignore hooks added after it was built."""
    compiled = [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled or type(model).__name__ == "OptimizedModule":
        where = f"module {compiled[0] or 'model'}" if compiled else "the model"
        raise ModelError(f"{what} cannot run on torch.compile'd layers ({where}): compiled graphs ignore "
                         "the routing hooks; run eager (run.compile=false)")


# ------------------------------------------------------------------ record


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[Tensor | None]]:
    """Collects the last forward's expert indices: list over layers of [N, K] (N = B*S tokens).

    A hook registered before this one (e.g. an enclosing ``replay_routing``) has already
    replaced the router's output, so the record is what the experts were given.
    """
    routers = _routers(model)
    if routers:
        _check_eager(model, "recording the routing")
    records: list[Tensor | None] = [None] * len(routers)

    def hook_for(layer: int, family: MoEFamily):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            records[layer] = family.output.indices(output).detach()  # [N, K]
        return hook

    handles = [r.register_forward_hook(hook_for(i, family)) for i, (r, family) in enumerate(routers)]
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


# ------------------------------------------------------------------ count


@dataclass(eq=False)
class ReplayCount:
    """Routed token positions x MoE layers in the forwards of a ``count_replay`` block.

    A position counts when it holds a real token followed by another real token of its row:
    exactly the positions the row's log-probs depend on (a row's last token predicts nothing, and
    padding is masked out). ``routed`` counts them at every MoE layer of every forward through the
    model's body in the block; ``forced`` those among them whose experts a replay set. Both are
    0-dim int64 tensors on the device of the inputs, summed without a host sync; the share
    replayed is forced / routed (routed is 0 on a dense model).
    """

    forced: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))  # [] int64
    routed: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))  # [] int64


@dataclass(eq=False)  # identity: a block removes its own tally
class _Tally:
    count: ReplayCount
    feeds: Tensor | None = None  # [B*S] bool, the positions of the current forward that count
    layers_seen: set[int] = field(default_factory=set)  # MoE layers of the current forward counted so far


_TALLIES: weakref.WeakKeyDictionary[nn.Module, list[_Tally]] = weakref.WeakKeyDictionary()


@contextmanager
def count_replay(model: nn.Module) -> Iterator[ReplayCount]:
    """Counts the routed and the replayed positions of every forward inside the block (``ReplayCount``).

    Replays inside the block, however they are opened (``replay_routing`` directly or through
    ``response_logprobs(routed_experts=...)``), add to it; forwards that replay nothing add to
    ``routed`` only, so a replay that silently did nothing reads 0 rather than 1.
    """
    layers = len(moe_routers(model))
    tally = _Tally(ReplayCount())

    def before_body(module: nn.Module, args: tuple, kwargs: dict) -> None:
        tally.feeds = _positions_that_count(args, kwargs)  # [B*S]
        tally.layers_seen = set()
        tally.count.routed = tally.count.routed + layers * tally.feeds.sum()

    handle = _body(model).register_forward_pre_hook(before_body, with_kwargs=True) if layers else None
    _TALLIES.setdefault(model, []).append(tally)
    try:
        yield tally.count
    finally:
        _TALLIES[model].remove(tally)
        if handle is not None:
            handle.remove()


def _body(model: nn.Module) -> nn.Module:
    """The transformer body (embeddings and layers), or the model itself when it is one."""
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


def _positions_that_count(args: tuple, kwargs: dict) -> Tensor:
    """[B*S] bool: a real token followed by a real token, from the body's input_ids and attention_mask."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs["inputs_embeds"][..., 0]
    B, S = ids.shape[:2]
    mask = kwargs.get("attention_mask")
    real = torch.ones(B, S, dtype=torch.bool, device=ids.device)
    if isinstance(mask, Tensor) and mask.dim() == 2:
        real = mask[:, -S:] > 0  # [B, S] (a cached decode step passes the mask of every position so far)
    return (real & F.pad(real[:, 1:], (0, 1))).reshape(-1)  # [B*S]


def _add_forced(model: nn.Module, layer: int, recorded: Tensor) -> None:
    """recorded [N] bool: the tokens a replay hook forced at MoE layer ``layer`` of the current forward.

    A layer counts once per forward: activation checkpointing runs it again in the backward pass.
    """
    for tally in _TALLIES.get(model, ()):
        if tally.feeds is not None and tally.feeds.shape == recorded.shape and layer not in tally.layers_seen:
            tally.layers_seen.add(layer)
            tally.count.forced = tally.count.forced + (recorded & tally.feeds).sum()


# ------------------------------------------------------------------ replay


@contextmanager
def replay_routing(model: nn.Module, experts: Tensor) -> Iterator[ReplayCount]:
    """Within the block, every token with a record uses the recorded experts instead of its own top-k.

    experts [B, S, L, K] int64, ``NO_RECORD`` (-1) where the live router should choose; a
    position is recorded at all K slots or at none. The gate weights at the replayed experts are
    the family's gate rule applied to the live router logits (``moe_families``), so gradient still
    flows into the router, and replaying a forward's own record reproduces that forward bit for
    bit. Yields the ``ReplayCount`` of the forwards inside the block. With activation
    checkpointing, run the backward pass inside the block too, so that its recomputation replays.
    """
    routers = _routers(model)
    if experts.dim() != 4 or experts.shape[2] != len(routers):
        raise ValueError(f"routed_experts must be [B, S, L={len(routers)}, K]; got {tuple(experts.shape)}")
    if routers:
        _check_eager(model, "router replay")
    flat = experts.reshape(-1, experts.shape[2], experts.shape[3])  # [B*S, L, K]

    def hook_for(layer: int, family: MoEFamily):
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
            logits, indices = family.output.logits(output), family.output.indices(output)  # [N, E], [N, K]
            if logits.shape[0] != flat.shape[0] or indices.shape[1] != flat.shape[2]:
                raise ValueError(f"routed_experts cover {flat.shape[0]} tokens x K={flat.shape[2]}; "
                                 f"the router saw {logits.shape[0]} tokens x K={indices.shape[1]}")
            recorded = flat[:, layer].to(indices.device)  # [N, K]
            forced = torch.where(recorded >= 0, recorded, indices)  # [N, K]
            _add_forced(model, layer, recorded[:, 0] >= 0)
            return family.output.replaced(output, family.gate_weights(module, logits, forced), forced)
        return hook

    with count_replay(model) as count:
        handles = [r.register_forward_hook(hook_for(i, family)) for i, (r, family) in enumerate(routers)]
        try:
            yield count
        finally:
            for h in handles:
                h.remove()
