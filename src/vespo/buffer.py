"""Between rollout and learner: splitting a rollout batch into stale mini-batches, and the
admission rule that bounds how far rollout may run ahead of the learner.

Staleness, exactly: the policy version counts optimizer steps. A rollout batch sampled at version
v is split into N mini-batches; mini-batch j (0-based) is trained at version v + j, so its lag is j.
"""

from __future__ import annotations

import torch

from vespo.types import TrainBatch


def split_minibatches(batch: TrainBatch, n: int, generator: torch.Generator | None = None) -> list[TrainBatch]:
    """Split ``batch`` into ``n`` mini-batches of whole groups (all responses to a prompt together).

    With a generator the groups are shuffled first; without one they keep their order.
    Groups are dealt into n nearly equal parts (equal when n divides the number of groups).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    groups, inverse = torch.unique(batch.group_ids, sorted=True, return_inverse=True)  # [G], [B]
    if len(groups) < n:
        raise ValueError(f"cannot split {len(groups)} groups into {n} mini-batches")
    order = torch.randperm(len(groups), generator=generator) if generator is not None else torch.arange(len(groups))
    parts = torch.tensor_split(order, n)
    out = []
    for part in parts:
        rows = torch.nonzero(torch.isin(inverse, part)).flatten()  # [b] rows whose group is in this part
        # keep rows ordered by the part's group order, then by original position
        rank = torch.empty(len(groups), dtype=torch.long)
        rank[part] = torch.arange(len(part))
        rows = rows[torch.argsort(rank[inverse[rows]] * len(inverse) + rows)]
        out.append(batch.select(rows))
    return out


class StalenessBound:
    """The staleness rule: a sample whose oldest token was sampled at version v may be trained at
    learner version u only if u - v <= max_staleness. The async trainer enforces it by admission
    (rollout waits) rather than by discarding samples."""

    def __init__(self, max_staleness: int):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness

    def lag_ok(self, sample_version: int, learner_version: int) -> bool:
        """Whether a sample from ``sample_version`` may be trained at ``learner_version``."""
        return learner_version - sample_version <= self.max_staleness
