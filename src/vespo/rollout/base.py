"""The rollout engine protocol, sampling parameters, and the sampling distribution itself.

Any engine (Hugging Face, vLLM) samples from ``sampling_logprobs(logits, params)``: the
log-softmax of logits / temperature, restricted to the top-k tokens and then to the top-p
nucleus, renormalised. The behavior log-prob of a sampled token is read from that distribution; the
trainer's μ and π use the same truncation (docs/sampling.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from vespo.models.truncation import outside_support
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
    -inf outside top-k / top-p (the rule of ``vespo.models.truncation.outside_support``)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature  # [B, V]
    if params.top_k > 0 or params.top_p < 1.0:
        z = z.masked_fill(outside_support(z, params.top_k, params.top_p), float("-inf"))
    return torch.log_softmax(z, dim=-1)


def sample_tokens(logp: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of exp(logp) [B, V], drawn by inverting the row's CDF with one uniform number: [B].

    A row's token is the first index whose cumulative probability exceeds u * total, u ~ U[0, 1); the
    sums are taken in float64, so rounding moves about 1e-16 of probability. A token of probability 0
    (outside top-k / top-p) is never drawn. torch.multinomial draws one exponential number per vocabulary
    entry instead: at 49k tokens that was a fifth of a decode step on CPU.
    """
    cdf = logp.exp().cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    u = torch.rand(logp.shape[0], 1, generator=generator, dtype=torch.float64, device=logp.device)  # [B, 1]
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [B, 1]
    return token.squeeze(1).clamp_(max=logp.shape[1] - 1)


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
