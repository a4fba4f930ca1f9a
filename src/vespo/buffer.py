"""Between rollout and learner: splitting a rollout batch into stale mini-batches (sync mode), and
in async mode the admission rule that bounds how far rollout may run ahead of the learner, the
in-order queue of finished mini-batches, and the version-lag statistics.

Staleness, exactly: the policy version counts optimizer steps. A rollout batch sampled at version
v is split into N mini-batches; mini-batch j (0-based) is trained at version v + j, so its lag is j.
In async mode a row's lag is ``u - v_min``: u = the learner's version when the row is trained,
v_min = the oldest version that sampled one of its tokens (partial rollouts span versions). A token's
lag is ``u - v_t``, v_t = the version that sampled it (``TrainBatch.token_versions``): what decoupled_ppo's
proximal policy reads (``token_lags``), and what ``token_lag_stats`` logs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

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
    """Admission control for asynchronous rollout: a bound on version lag kept by making rollout
    wait, never by discarding samples.

    Every mini-batch gets a *ticket* t = the index of the learner update it is destined for (the
    learner trains tickets in order, one update each). The learner has made ``skipped`` updates
    that were dropped as non-finite, so ticket t is trained at learner version u <= t - skipped.
    A worker holding weights of version w starts ticket t only if ``t - skipped - w <= max_staleness``;
    every token of that mini-batch is then sampled at a version >= w, so its lag u - v_min <= max_staleness.
    Hand-worked: max_staleness 2, weights w = 4, no skips: tickets 4, 5, 6 may start, ticket 7 waits
    for weights >= 5.
    """

    def __init__(self, max_staleness: int):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness

    def admits(self, ticket: int, weights_version: int, skipped: int = 0) -> bool:
        """Whether a worker holding ``weights_version`` may start generating ``ticket``."""
        return ticket - skipped - weights_version <= self.max_staleness

    def needed_version(self, ticket: int, skipped: int = 0) -> int:
        """The oldest weights version that may start ``ticket``."""
        return ticket - skipped - self.max_staleness


class TicketQueue:
    """Finished mini-batches, handed to the learner strictly in ticket order (workers may finish
    out of order); ``depth`` counts the finished ones waiting."""

    def __init__(self, first_ticket: int = 0):
        self.next_ticket = first_ticket
        self._ready: dict[int, Any] = {}

    def put(self, ticket: int, item: Any) -> None:
        if ticket < self.next_ticket or ticket in self._ready:
            raise ValueError(f"ticket {ticket} was already delivered or queued (next is {self.next_ticket})")
        self._ready[ticket] = item

    def ready(self) -> bool:
        return self.next_ticket in self._ready

    def pop(self) -> tuple[int, Any]:
        """The next ticket and its item; raises KeyError when it has not arrived."""
        if not self.ready():
            raise KeyError(f"ticket {self.next_ticket} has not arrived")
        ticket = self.next_ticket
        self.next_ticket += 1
        return ticket, self._ready.pop(ticket)

    @property
    def depth(self) -> int:
        return len(self._ready)


def lag_stats(lags: Tensor, spans: Tensor, max_staleness: int) -> dict[str, float]:
    """Version-lag histogram and partial-rollout span of trained rows.

    lags [R] int64 = learner version at train time - oldest token version, one per row;
    spans [R] int64 = newest - oldest token version of the row (> 0 for a partial rollout).
    ``staleness/lag_hist_j`` is the fraction of rows with lag j, j = 0..max_staleness; a lag above
    the bound would show up in ``lag_max`` (and the bins would not sum to 1).
    """
    if lags.numel() == 0:
        raise ValueError("lag_stats: no rows (lags is empty)")
    lags, spans = lags.long(), spans.long()
    counts = torch.bincount(lags.clamp(min=0), minlength=max_staleness + 1)[: max_staleness + 1]  # [S+1]
    out = {f"staleness/lag_hist_{j}": float(c) / lags.numel() for j, c in enumerate(counts.tolist())}
    out.update({
        "staleness/lag_mean": float(lags.double().mean()),
        "staleness/lag_p50": float(lags.double().quantile(0.5)),
        "staleness/lag_max": float(lags.max()),
        "staleness/span_mean": float(spans.double().mean()),
        "staleness/span_max": float(spans.max()),
        "staleness/partial_frac": float((spans > 0).double().mean()),
    })
    return out


def token_lags(batch: TrainBatch, version: int | Tensor) -> Tensor:
    """Versions each response token is behind ``version`` (the learner's when it trains the batch: an int, or [B]
    per row): ``version - token_versions`` on valid tokens, 0 on padding.  # [B, T] int64"""
    at = torch.as_tensor(version, dtype=torch.long, device=batch.token_versions.device).reshape(-1, 1)  # [1|B, 1]
    return torch.where(batch.response_mask > 0, at - batch.token_versions, 0)


def token_lag_rows(batch: TrainBatch, lags: Tensor) -> dict[str, Tensor]:
    """Per row [B] float64, for ``token_lag_stats``: valid tokens, the sum of their lags, and how many of them a
    version newer than the row's oldest sampled. ``lags`` [B]: each row's lag when trained (``u - v_min``)."""
    valid = batch.response_mask > 0  # [B, T]
    lag = token_lags(batch, lags.long() + batch.versions)  # u = lag + v_min, the learner's version when trained
    newer = valid & (batch.token_versions > batch.versions[:, None])  # [B, T]
    return {"tokens": valid.sum(dim=1).double(), "token_lag_sum": lag.sum(dim=1).double(),
            "newer": newer.sum(dim=1).double()}


def token_lag_stats(rows: dict[str, Tensor]) -> dict[str, float]:
    """``staleness/token_lag_mean`` (mean lag of the trained response tokens) and ``staleness/token_newer_frac``
    (the share of them sampled by a version newer than their row's oldest: > 0 only with partial rollouts), formed
    from the summed rows of ``token_lag_rows``; {} without tokens."""
    tokens = float(rows["tokens"].sum()) if rows else 0.0
    if tokens == 0:
        return {}
    return {"staleness/token_lag_mean": float(rows["token_lag_sum"].sum()) / tokens,
            "staleness/token_newer_frac": float(rows["newer"].sum()) / tokens}
