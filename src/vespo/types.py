"""The data that flows between stages, with shapes written where tensors live.

    Problem  (tasks / data)     a prompt and its ground truth
    Rollout  (rollout engine)   sampled responses with behavior log-probs and policy versions
    TrainBatch (rollout/learner) scored, versioned samples for the learner

Shapes: B = number of sequences, P = prompt length (left-padded), T = response length
(right-padded), L = MoE layers, K = experts chosen per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily so `import vespo.types` stays cheap
    from torch import Tensor


def torch_device(device: Any):
    import torch

    return torch.device(device)


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
    routed_experts: Tensor | None = None  # [B, P+T, L, K] int64, MoE experts routed at each position, -1 if not run

    @property
    def batch_size(self) -> int:
        return int(self.response_ids.shape[0])


@dataclass(frozen=True)
class TrainBatch:
    """Scored, versioned samples ready for the learner: one row per response. Immutable: the learner
    works on its own copies (``dataclasses.replace``) when it sets μ or the routing to replay."""

    prompt_ids: Tensor  # [B, P] int64, left-padded
    prompt_mask: Tensor  # [B, P] int64
    response_ids: Tensor  # [B, T] int64, right-padded
    response_mask: Tensor  # [B, T] float32
    rollout_logp: Tensor  # [B, T] float32, the engine's behavior log-probs
    rewards: Tensor  # [B] float32
    advantages: Tensor  # [B] float32, sequence-level
    group_ids: Tensor  # [B] int64, responses to the same prompt share a group id
    versions: Tensor  # [B] int64, the oldest policy version that sampled a token of the row
    versions_max: Tensor  # [B] int64, the newest (differs from `versions` for partial rollouts)
    # [B, T] int64: the policy version that sampled each response token (0 on padding); over a row's valid
    # tokens its min is `versions` and its max `versions_max` (they differ where a partial rollout went on
    # under newer weights)
    token_versions: Tensor
    truncated: Tensor  # [B] bool
    # [B, P+T, L, K] int64: MoE experts routed at each position of cat(prompt, response), -1 where the
    # live router chooses: the engine's record (R3) as delivered; in the learner's copy, what every
    # training forward replays (docs/router_replay.md)
    routed_experts: Tensor | None = None
    old_logp: Tensor | None = None  # [B, T] float32, μ's log-probs: only in the learner's own copy

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    def select(self, idx: Tensor) -> "TrainBatch":
        """The rows ``idx`` [b] (int64 indices), every field sliced alike."""
        kw = {f: (v[idx] if v is not None else None) for f, v in self._fields().items()}
        return TrainBatch(**kw)

    def to(self, device: Any) -> "TrainBatch":
        """The same rows with every tensor on ``device`` (self when already there)."""
        if self.response_ids.device == torch_device(device):
            return self
        kw = {f: (v.to(device) if v is not None else None) for f, v in self._fields().items()}
        return TrainBatch(**kw)

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @staticmethod
    def concat(batches: list["TrainBatch"], pad_id: int) -> "TrainBatch":
        """Rows of several batches in one, re-padding prompts (left) and responses (right)."""
        import torch

        if len(batches) == 1:
            return batches[0]
        P = max(b.prompt_ids.shape[1] for b in batches)
        T = max(b.response_ids.shape[1] for b in batches)

        def pad(t: Tensor | None, width: int, left: bool, value: float) -> Tensor | None:
            if t is None:
                return None
            extra = width - t.shape[1]
            if extra == 0:
                return t
            shape = (t.shape[0], extra, *t.shape[2:])
            filler = torch.full(shape, value, dtype=t.dtype)
            return torch.cat([filler, t] if left else [t, filler], dim=1)

        out: dict[str, Any] = {}
        for name in batches[0]._fields():
            parts = [getattr(b, name) for b in batches]
            if any(p is None for p in parts):
                out[name] = None
                continue
            if name in ("prompt_ids", "prompt_mask"):
                parts = [pad(p, P, True, pad_id if name == "prompt_ids" else 0) for p in parts]
            elif name == "routed_experts":  # prompt columns padded left, response columns right
                parts = [torch.cat([pad(r[:, : b.prompt_ids.shape[1]], P, True, -1),
                                    pad(r[:, b.prompt_ids.shape[1]:], T, False, -1)], dim=1)
                         for r, b in zip(parts, batches)]
            elif name in ("response_ids", "response_mask", "rollout_logp", "old_logp", "token_versions"):
                parts = [pad(p, T, False, pad_id if name == "response_ids" else 0) for p in parts]
            out[name] = torch.cat(parts, dim=0)
        return TrainBatch(**out)
