"""Masked statistics, engine-mismatch diagnostics, and metric sinks (jsonl, TensorBoard, W&B).

Metrics are namespaced (`reward/`, `rollout/`, `mismatch/`, `loss/`, `is/`, `kl/`, `optim/`,
`perf/`, `staleness/`) and reduced once per step: the trainer collects tensors, calls
:func:`to_floats` once, and hands one flat dict to every sink.
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


def mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise mean of several metric dicts (e.g. the N mini-batches of one rollout step)."""
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in sorted(keys)}


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

    def close(self) -> None:
        self._w.close()


class WandbSink:
    def __init__(self, run_dir: str | Path, config: dict, name: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("run.loggers includes 'wandb' but wandb is not installed (pip install wandb)") from e
        self._run = wandb.init(dir=str(run_dir), config=config, name=name, reinit=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

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
