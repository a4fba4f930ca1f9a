"""Masked statistics, engine-mismatch diagnostics, and metric sinks (jsonl, TensorBoard, W&B).

Metrics are namespaced (`reward/`, `rollout/`, `mismatch/`, `loss/`, `is/`, `kl/`, `optim/`,
`perf/`, `staleness/`) and reduced once per step: the trainer collects tensors, calls
:func:`to_floats` once, and hands one flat dict to every sink.

A metric's name says how it combines across micro-batches and mini-batches (:func:`reduce_metrics`):
a name ending in ``_max`` is reduced by max, ``_min`` by min, ``_sum`` by sum, a last path segment
starting with ``n_`` (``is/n_seq``, ``rollout/n_tokens``) by sum, and anything else by mean. So a
max stays a max and a count stays a count however many pieces a step was made of.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over the positions where mask is set (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def mismatch_metrics(rollout_logp: Tensor, train_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Train-inference mismatch between the engine's and the trainer's log-probs of the same tokens.

    k1 = mean(logp_rollout - logp_train); k3 = mean(exp(d) - 1 - d) with d = logp_rollout - logp_train;
    log-ppl of each engine = -mean(logp) over response tokens, and their difference.
    """
    mask = mask.float()
    d = torch.where(mask.bool(), rollout_logp - train_logp, torch.zeros_like(rollout_logp)).clamp(-20, 20)
    ppl_rollout = -masked_mean(rollout_logp, mask)
    ppl_train = -masked_mean(train_logp, mask)
    return {
        "mismatch/k1": masked_mean(d, mask),
        "mismatch/k3": masked_mean(torch.expm1(d) - d, mask),
        "mismatch/log_ppl_rollout": ppl_rollout,
        "mismatch/log_ppl_train": ppl_train,
        "mismatch/log_ppl_diff": ppl_rollout - ppl_train,
        "mismatch/max_abs_diff": (d.abs() * mask).max() if mask.any() else torch.zeros(()),
    }


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """One host sync for a whole dict of scalar tensors and numbers."""
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if keys:
        values = torch.stack([metrics[k].detach().float().reshape(()) for k in keys]).tolist()
        out.update(zip(keys, values))
    return out


def reduction(name: str) -> str:
    """How the metric ``name`` combines over pieces of a step: "max", "min", "sum" or "mean"."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    if name.endswith("_sum") or name.rsplit("/", 1)[-1].startswith("n_"):
        return "sum"
    return "mean"


def reduce_metrics(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise reduction of several metric dicts by each name's rule (:func:`reduction`).

    Values may be floats or 0-dim tensors (reduced without a host sync). A key missing from some
    dicts is reduced over the dicts that have it.
    """
    keys: dict[str, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d))
    out: dict[str, Any] = {}
    for k in keys:
        values = [d[k] for d in dicts if k in d]
        if len(values) == 1:
            out[k] = values[0]
            continue
        rule = reduction(k)
        if any(isinstance(v, Tensor) for v in values):
            stacked = torch.stack([torch.as_tensor(v).detach().float().reshape(()) for v in values])
            out[k] = {"max": stacked.amax, "min": stacked.amin, "sum": stacked.sum, "mean": stacked.mean}[rule]()
        else:
            out[k] = {"max": max, "min": min, "sum": math.fsum, "mean": lambda v: math.fsum(v) / len(v)}[rule](values)
    return out


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
