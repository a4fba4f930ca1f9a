"""The rollout engine protocol, sampling parameters, and the sampling distribution itself.

Any engine (Hugging Face, vLLM) samples from ``sampling_logprobs(logits, params)``: the
log-softmax of logits / temperature, restricted to the top-k tokens and then to the top-p
nucleus, renormalised. The behavior log-prob of a sampled token is read from that distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from vespo.types import Rollout


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled."""

    temperature: float = 1.0  # logits are divided by it; > 0 (use top_k=1 for greedy decoding)
    top_p: float = 1.0  # nucleus: keep the smallest top set with probability >= top_p; in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 means off
    max_new_tokens: int = 32  # response length cap; a row that hits it is marked truncated

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"SamplingParams.temperature must be > 0; got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1]; got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off); got {self.top_k!r}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1; got {self.max_new_tokens!r}")


def sampling_logprobs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Log-probs [B, V] (float32, or float64 for float64 logits) of the distribution sampled from;
    -inf outside top-k / top-p."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature  # [B, V]
    if params.top_k > 0 and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        z = _nucleus(z, params.top_p)
    return torch.log_softmax(z, dim=-1)


def _nucleus(z: Tensor, top_p: float) -> Tensor:
    """Mask tokens outside the smallest most-likely set whose probability reaches top_p."""
    sorted_z, order = torch.sort(z, dim=-1, descending=True)  # [B, V]
    probs = torch.softmax(sorted_z, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    drop_sorted = mass_before >= top_p  # the most likely token always stays (mass_before = 0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


@runtime_checkable
class RolloutEngine(Protocol):
    """An inference engine holding its own copy of the policy weights."""

    @property
    def version(self) -> int:
        """Policy version of the weights loaded now."""
        ...

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Replace the weights; in-flight generations continue under them."""
        ...

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Rollout:
        """Sample one response per prompt, to the end."""
        ...

    def start(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Any:
        """Begin a batch; returns an opaque generation state."""
        ...

    def advance(self, state: Any, n_tokens: int) -> bool:
        """Decode up to n_tokens more per row; True when every row has ended."""
        ...

    def finish(self, state: Any) -> Rollout:
        """The batch so far as a Rollout (rows still running are marked truncated)."""
        ...
