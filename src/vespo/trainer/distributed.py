"""The learner on many processes: torch.distributed, FSDP2 sharding, and the reductions the trainer needs.

    dist = init_distributed(device)     # from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...),
                                        # or Dist.single() when the run has one process
    module = shard_policy(LogprobModule(policy), dist, bf16=False)
    dist.sum(tensor)  dist.gather_rows(rows)  dist.gather_object(x)  dist.any(flag)  dist.barrier()

What is sharded, what is replicated (SPEC §8: sharding changes where numbers are computed, never what
they are):

- the policy's parameters, gradients and AdamW state are sharded across the P ranks with
  ``fully_shard`` (FSDP2): one unit per decoder layer and the root (embeddings, final norm, LM head),
  on a 1-D device mesh (gloo on CPU, NCCL on GPU);
- every rank holds a full copy of the weights in its rollout engine, refreshed after each rollout step
  (``full_weights``: an all-gather), generates its share of the prompts and scores it;
- a mini-batch is split across ranks; the loss normalizer is the global token (or sequence) count,
  so the summed per-rank gradients are the gradient of the global mini-batch; every diagnostic is
  formed from the rows gathered from all ranks (``gather_rows``), so it equals the one-process value.

A rank runs the same collectives in the same order as every other rank: one forward per
micro-batch (the shared-prompt path, whose number of forwards depends on the data, is off), the same
number of micro-batches everywhere (the config checks that P divides the batch), and the
checkpoint, weight refresh and evaluation on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

from vespo.losses.diagnostics import Rows

TIMEOUT = timedelta(minutes=10)  # a collective that waits this long means a rank is gone


@dataclass(frozen=True)
class Dist:
    """This process's place among the learner's ranks (a single process: rank 0 of 1, no process group)."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @classmethod
    def single(cls) -> "Dist":
        return cls(0, 1)

    def sum(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over ranks (a new tensor; ``x`` is left as it is)."""
        if not self.active:
            return x.clone()
        out = x.detach().clone()
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM)
        return out

    def max(self, value: int) -> int:
        """The largest ``value`` over ranks (every rank gets the same answer)."""
        if not self.active:
            return value
        out = torch.tensor(float(value))
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.MAX)
        return int(out)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (every rank gets the same answer)."""
        if not self.active:
            return flag
        return bool(self.sum(torch.tensor(float(flag))) > 0)

    def gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        torch_dist.all_gather_object(out, obj)
        return out

    def gather_rows(self, rows: Rows) -> Rows:
        """The per-row statistics of every rank, concatenated in rank order (the global batch's rows)."""
        if not self.active:
            return rows
        parts = self.gather_object({k: v.detach().cpu() for k, v in rows.items()})
        parts = [p for p in parts if p]
        if not parts:
            return {}
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def broadcast_state(self, module: nn.Module) -> None:
        """Every rank takes rank 0's parameters and buffers (before sharding: one source of weights)."""
        if not self.active:
            return
        with torch.no_grad():
            for tensor in list(module.state_dict().values()):
                torch_dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        if self.active:
            torch_dist.barrier()


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init_distributed(device: torch.device) -> Dist:
    """Join the process group torchrun describes in the environment (gloo on CPU, NCCL on CUDA)."""
    if not launched_by_torchrun():
        return Dist.single()
    if not torch_dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch_dist.init_process_group(backend=backend, timeout=TIMEOUT)
    return Dist(torch_dist.get_rank(), torch_dist.get_world_size())


def init_group(rank: int, world: int, address: str, port: int, device: torch.device) -> Dist:
    """Join a process group of ``world`` ranks that meet at ``address:port`` (the learner's Ray actors)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch_dist.init_process_group(backend=backend, init_method=f"tcp://{address}:{port}", rank=rank,
                                  world_size=world, timeout=TIMEOUT)
    return Dist(rank, world)


def free_port() -> int:
    """A TCP port free on this host now (where rank 0 of a process group listens)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def local_device(device: torch.device) -> torch.device:
    """On CUDA, each rank takes the GPU of its local rank."""
    if device.type == "cuda" and device.index is None and launched_by_torchrun():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def shutdown(dist: Dist, clean: bool = True) -> None:
    """Leave the process group; after a clean finish, once every rank is done with it (tearing it down while
    another rank is still in a collective aborts that rank). After an error the rank just leaves: the others
    are stopped by the launcher, not waited for."""
    if dist.active and torch_dist.is_initialized():
        try:
            if clean:
                torch_dist.barrier()
        finally:
            torch_dist.destroy_process_group()


def shard_policy(module: nn.Module, dist: Dist, device: torch.device, bf16: bool = False) -> nn.Module:
    """``fully_shard`` every decoder layer of the policy and the whole ``module`` (the root unit).

    ``bf16``: FSDP2 mixed precision, parameters all-gathered and computed in bfloat16, gradients
    reduced in float32 (what ``model.autocast`` asks for on one process). The module's parameters
    must be equal on every rank (``Dist.broadcast_state``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    for unit in module.modules():  # ranks' gradients are summed, not averaged: the loss is normalized globally
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return module


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (the ``layers`` ModuleList of its body)."""
    layers = [m for name, m in module.named_modules() if name.endswith(".layers") and isinstance(m, nn.ModuleList)]
    if not layers:
        raise ValueError(f"{type(module).__name__} has no `.layers` list of decoder blocks to shard")
    return list(layers[0])


def full_tensor(x: Tensor) -> Tensor:
    """A DTensor gathered to a plain tensor (a plain tensor as it is)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x
