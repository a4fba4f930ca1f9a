"""Atomic checkpoints: model, optimizer, RNG states, data cursor, step and config.

Layout under ``RUN_DIR/checkpoints/``:

    step-000010/  model.safetensors  trainer.pt (optimizer, scheduler, RNG, cursor, counters)  config.json
    latest        the name of the newest complete checkpoint

A checkpoint is written into ``step-XXXXXX.tmp`` and renamed into place; ``latest`` is replaced
with ``os.replace``. A crash at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

KEEP = 2  # complete checkpoints kept on disk


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any],
                    config: dict) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))  # clones: tied weights are stored twice
    torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer.pt")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _prune(root, keep=KEEP)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "trainer.pt").is_file() else None


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load weights into ``model`` (in place) and return the trainer state (RNG restored)."""
    path = Path(path)
    weights = load_file(str(path / "model.safetensors"))
    model.load_state_dict(weights)
    state = torch.load(path / "trainer.pt", weights_only=False)
    set_rng_state(state.pop("rng"))
    return state


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
