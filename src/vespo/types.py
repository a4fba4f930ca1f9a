"""The data that flows between stages, with shapes written where tensors live.

    Problem  (tasks / data)     a prompt and its ground truth
    Rollout  (rollout engine)   sampled responses with behavior log-probs and policy versions
    LossOutput (losses)         a scalar loss and its diagnostics

Shapes: B = number of sequences, P = prompt length (left-padded), T = response length
(right-padded), L = MoE layers, K = experts chosen per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily so `import vespo.types` stays cheap
    from torch import Tensor


@dataclass
class Problem:
    """One prompt with the ground truth its reward is computed against."""

    id: str  # stable identifier, unique within its dataset or task
    prompt: str | list[dict[str, str]]  # plain text, or chat messages [{role, content}, ...]
    ground_truth: Any  # what the reward function compares the completion with
    data_source: str = "unknown"  # task or dataset name; evaluation groups by it
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rollout:
    """A batch of sampled responses, as the rollout engine returns it."""

    prompt_ids: Tensor  # [B, P] int64, left-padded with the pad id
    prompt_mask: Tensor  # [B, P] int64, 1 on real prompt tokens
    response_ids: Tensor  # [B, T] int64, right-padded with the pad id
    response_mask: Tensor  # [B, T] float32, 1 on sampled tokens (EOS included)
    logprobs: Tensor  # [B, T] float32, behavior log-prob of each sampled token, 0 on padding
    truncated: Tensor  # [B] bool, hit max_new_tokens before EOS
    version: int  # policy version of the weights that finished the batch
    token_versions: Tensor | None = None  # [B, T] int64, version that sampled each token
    routed_experts: Tensor | None = None  # [B, T, L, K] int64, MoE experts chosen per token

    @property
    def batch_size(self) -> int:
        return int(self.response_ids.shape[0])


@dataclass
class LossOutput:
    """What every policy loss returns."""

    loss: Tensor  # [] scalar, carries the gradient
    metrics: dict[str, Tensor]  # name -> detached tensor ([] scalar), namespaced ("is/ess", ...)
