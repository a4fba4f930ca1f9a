"""Masked statistics, engine-mismatch diagnostics, and metric sinks (jsonl, TensorBoard, W&B).

Metrics are namespaced (`reward/`, `rollout/`, `mismatch/`, `loss/`, `is/`, `kl/`, `optim/`,
`perf/`, `staleness/`) and reduced once per step: the trainer collects tensors, calls
:func:`to_floats` once, and hands one flat dict to every sink.

A metric's name says how it combines across micro-batches and mini-batches (:func:`reduce_metrics`,
by ``vespo.losses.diagnostics.metric_reduction``): a name ending in ``_max`` is reduced by max,
``_min`` by min, ``_sum`` by sum, a last path segment starting with ``n_`` (``is/n_seq``,
``rollout/n_tokens``) by sum, and anything else by mean. So a max stays a max and a count stays a
count however many pieces a step was made of.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

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


def count_key(name: str) -> str | None:
    """The count a statistic was taken over: the sequences (``is/n_seq``) or the sequences of one sign
    of A (``vespo/n_pos``, ``vespo/n_neg``); None for a metric that is not a per-selection statistic.

    A loss reports 0 for a statistic over an empty selection (a micro-batch with no A < 0 row), so
    pieces whose count is 0 must not enter a min, max or mean, and means are weighted by the count.
    """
    head, _, last = name.rpartition("/")
    if last.startswith("n_"):
        return None
    if head == "vespo" and ("_pos" in last or "_neg" in last):
        return "vespo/n_pos" if "_pos" in last else "vespo/n_neg"
    if head == "is" or last.startswith("log_w_") or last == "w_ess":
        return "is/n_seq"
    return None


def reduce_metrics(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise reduction of several metric dicts by each name's rule (``metric_reduction``: _max by
    max, _min by min, _sum and n_* by sum, else mean), once per step over all its pieces.

    Values may be floats or 0-dim tensors (reduced without a host sync). A key missing from some
    dicts is reduced over the dicts that have it; a statistic with a count (:func:`count_key`) over
    the pieces where that count is positive, its mean weighted by the count.
    """
    keys: dict[str, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d))
    return {k: _reduce(k, [d for d in dicts if k in d]) for k in keys}


def _reduce(key: str, dicts: list[dict[str, Any]]) -> Any:
    from vespo.losses.diagnostics import metric_reduction

    if len(dicts) == 1:
        return dicts[0][key]
    rule, counter = metric_reduction(key), count_key(key)
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


# ---------------------------------------------------------------- sinks


class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"step": k, ...metrics}. Non-finite values are written as null."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (v if isinstance(v, (int, str)) or math.isfinite(v) else None)
                                for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Samples as a markdown table under the "samples" text tag."""
        if not rows:
            return
        keys = list(rows[0])
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_cell(r[k]) for k in keys) + " |" for r in rows]
        self._w.add_text("samples", "\n".join(lines), step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


class WandbSink:
    def __init__(self, run_dir: str | Path, config: dict, name: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("run.loggers includes 'wandb' but wandb is not installed (pip install wandb)") from e
        self._run = wandb.init(dir=str(run_dir), config=config, name=name, reinit=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        import wandb

        if rows:
            keys = list(rows[0])
            self._run.log({"samples": wandb.Table(columns=keys, data=[[r[k] for k in keys] for r in rows])}, step=step)

    def close(self) -> None:
        self._run.finish()


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
