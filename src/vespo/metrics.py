"""Masked statistics, the step's rollout and engine-mismatch rows, and the one rule by which every metric
is reduced.

Metrics are namespaced (`reward/`, `rollout/`, `mismatch/`, `loss/`, `is/`, `kl/`, `optim/`,
`perf/`, `staleness/`). How a metric is reduced, from the rows it is made of to a rollout step's row:

    rows       per-sequence statistics [B] (float64), e.g. a row's log W, its clipped tokens
    micro-batches, ranks   rows concatenate (``concat_rows``) and are gathered over ranks
               (``Dist.gather_rows``) before any metric is formed, so a ratio, an ESS or a quantile is
               the whole mini-batch's: ``summarize`` (the loss's rows, vespo.losses.diagnostics, where
               ``TOKEN_FRACTIONS`` / ``TOKEN_MEANS`` say which rows become token fractions and means),
               ``summarize_rollout`` and ``summarize_behavior`` (this module)
    updates    a step's N updates combine metric by metric by :func:`reduction`, declared by the
               metric's name: ``_max`` max, ``_min`` min, ``_sum`` and a count ``n_*`` sum, else mean;
               a statistic of a selection (``is/*``, ``*/log_w_*``, ``vespo/*_pos|_neg``) is weighted
               by that selection's count and skipped where it is empty (:func:`reduce_metrics`)

The trainer collects tensors, calls :func:`to_floats` once per update, and hands one flat dict per
step to the run log's sinks (vespo.trainer.runlog); :func:`read_jsonl` reads metrics.jsonl back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


# ---------------------------------------------------------------- step statistics as rows
#
# Like the losses' diagnostics (vespo.losses.diagnostics), the rollout and engine-mismatch
# statistics of a step are kept as per-row tensors [B] (float64) and turned into metrics once,
# from the rows of the whole step, so they do not depend on how the step was split.


@torch.no_grad()
def rollout_rows(rewards: Tensor, response_mask: Tensor, truncated: Tensor, flat_group: Tensor) -> dict[str, Tensor]:
    """Per-row rollout statistics of every sampled response (before any row is dropped).

    ``rewards [B]``, ``response_mask [B, T]``, ``truncated [B]`` bool, ``flat_group [B]`` bool (its group's
    rewards are all equal, so its advantage is 0)."""
    return {"reward": rewards.double(), "length": response_mask.double().sum(dim=-1),
            "truncated": truncated.double(), "flat_group": flat_group.double()}


@torch.no_grad()
def summarize_rollout(rows: dict[str, Tensor]) -> dict[str, float]:
    """reward/*, rollout/* of a step from its rollout rows (:func:`rollout_rows`)."""
    if not rows or rows["reward"].numel() == 0:
        return {}
    reward, length = rows["reward"], rows["length"]
    return {
        "reward/mean": float(reward.mean()),
        "reward/accuracy": float((reward >= 1.0).double().mean()),
        "reward/std": float(reward.std()) if reward.numel() > 1 else 0.0,
        "rollout/response_len": float(length.mean()),
        "rollout/response_len_max": float(length.max()),
        "rollout/eos_rate": float(1.0 - rows["truncated"].mean()),
        "rollout/zero_var_group_frac": float(rows["flat_group"].mean()),
        "rollout/n_tokens": float(length.sum()),
        "rollout/n_samples": float(reward.numel()),
    }


@torch.no_grad()
def behavior_rows(rollout_logp: Tensor, train_logp: Tensor, entropy: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-row sums of the engine-vs-trainer gap on the same tokens (``[B, T]`` each) and of the entropy.

    d = rollout_logp - train_logp (clamped to +-20) per valid token. Padding is selected out (``where``), so
    whatever it holds (NaN, -inf) reaches no statistic."""
    valid = mask != 0
    m = valid.double()

    def on_valid(x: Tensor) -> Tensor:  # [B, T] float64, 0 on padding
        return torch.where(valid, x.double(), 0.0)

    rollout, train = on_valid(rollout_logp), on_valid(train_logp)
    d = (rollout - train).clamp(-20, 20)  # [B, T], 0 on padding
    return {"tokens": m.sum(dim=-1), "mm_k1": d.sum(dim=-1), "mm_k3": (torch.expm1(d) - d).sum(dim=-1),
            "mm_logp_rollout": rollout.sum(dim=-1), "mm_logp_train": train.sum(dim=-1),
            "mm_abs_max": d.abs().amax(dim=-1) if d.shape[-1] else m.new_zeros(m.shape[0]),
            "entropy": on_valid(entropy).sum(dim=-1)}


@torch.no_grad()
def summarize_behavior(rows: dict[str, Tensor]) -> dict[str, float]:
    """mismatch/* (engine vs trainer) and rollout/entropy from the behaviour rows of a step."""
    if not rows or rows["tokens"].numel() == 0:
        return {}
    n = rows["tokens"].sum().clamp(min=1.0)
    ppl_rollout, ppl_train = -rows["mm_logp_rollout"].sum() / n, -rows["mm_logp_train"].sum() / n
    return {
        "mismatch/k1": float(rows["mm_k1"].sum() / n),
        "mismatch/k3": float(rows["mm_k3"].sum() / n),
        "mismatch/log_ppl_rollout": float(ppl_rollout),
        "mismatch/log_ppl_train": float(ppl_train),
        "mismatch/log_ppl_diff": float(ppl_rollout - ppl_train),
        "mismatch/abs_diff_max": float(rows["mm_abs_max"].max()),
        "rollout/entropy": float(rows["entropy"].sum() / n),
    }


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """One host sync for a whole dict of scalar tensors and numbers."""
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if keys:
        values = torch.stack([metrics[k].detach().float().reshape(()) for k in keys]).tolist()
        out.update(zip(keys, values))
    return out


@dataclass(frozen=True)
class Reduction:
    """How a metric combines over the updates of a rollout step."""

    rule: str  # max | min | sum | mean
    count: str | None  # the count metric a statistic was taken over: pieces where it is 0 are skipped, means weighted


def reduction(name: str) -> Reduction:
    """A metric's reduction, declared by its name: the one rule, which every metric name follows.

    rule: a name ending in ``_max`` -> max, ``_min`` -> min, ``_sum`` or a last segment starting with ``n_``
    (a count: ``is/n_seq``, ``rollout/n_tokens``) -> sum, anything else -> mean.
    count: a statistic over the sequences (``is/*``, ``*/log_w_*``, ``*/w_ess``: ``is/n_seq``) or over the
    sequences of one sign of A (``vespo/*_pos*``, ``vespo/*_neg*``: ``vespo/n_pos``, ``vespo/n_neg``).
    A loss reports 0 for a statistic of an empty selection (a micro-batch with no A < 0 row), so a piece
    whose count is 0 enters no min, max or mean, and means are weighted by the count.
    """
    head, _, last = name.rpartition("/")
    if name.endswith(("_max", "_min")):
        rule = name[-3:]
    else:
        rule = "sum" if name.endswith("_sum") or last.startswith("n_") else "mean"
    count = None  # a count itself is not weighted
    if head == "vespo" and ("_pos" in last or "_neg" in last) and not last.startswith("n_"):
        count = "vespo/n_pos" if "_pos" in last else "vespo/n_neg"
    elif (head == "is" or last.startswith("log_w_") or last == "w_ess") and not last.startswith("n_"):
        count = "is/n_seq"
    return Reduction(rule, count)


def reduce_metrics(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise reduction of several metric dicts by each name's :func:`reduction`, once per step over all
    its pieces.

    Values may be floats or 0-dim tensors (reduced without a host sync). A key missing from some
    dicts is reduced over the dicts that have it; a statistic with a count over the pieces where that
    count is positive, its mean weighted by the count.
    """
    keys: dict[str, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d))
    return {k: _reduce(k, [d for d in dicts if k in d]) for k in keys}


def _reduce(key: str, dicts: list[dict[str, Any]]) -> Any:
    if len(dicts) == 1:
        return dicts[0][key]
    rule, counter = reduction(key).rule, reduction(key).count
    as64 = lambda x: torch.as_tensor(x, dtype=torch.float64).detach().reshape(())  # noqa: E731
    values = [as64(d[key]) for d in dicts]  # P 0-dim values
    weights = [as64(d.get(counter, 1.0)) for d in dicts] if counter else [as64(1.0)] * len(dicts)
    v, w = torch.stack(values), torch.stack(weights)  # [P], [P]
    has = w > 0
    if rule == "sum":
        out = v.sum()
    elif rule == "mean":
        out = torch.where(has.any(), (v * w).sum() / w.sum().clamp(min=1e-300), v.mean())
    else:
        fill = math.inf if rule == "min" else -math.inf
        picked = torch.where(has, v, torch.full_like(v, fill))
        out = torch.where(has.any(), picked.amin() if rule == "min" else picked.amax(), v.amin() if rule == "min"
                          else v.amax())
    if any(isinstance(d[key], Tensor) for d in dicts):
        return out.float()
    return float(out)


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl file, with a clear error on a broken line."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
    return rows
