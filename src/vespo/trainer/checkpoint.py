"""Atomic checkpoints that cannot run code when opened, and the policy a run leaves behind.

Layout of a run directory:

    RUN_DIR/checkpoints/step-000010/  model.safetensors   the policy's weights
                                      trainer.pt          optimizer, scheduler, RNG states, data cursor, counters
                                      run_config.json     the run's config (plain data)
    RUN_DIR/checkpoints/latest        the name of the newest complete checkpoint
    RUN_DIR/policy/                   the policy as a Hugging Face directory (save_pretrained: config.json,
                                      model.safetensors, tokenizer files) plus run_config.json

Safe to open: ``trainer.pt`` holds tensors and plain Python values only (dict, list, tuple, str,
int, float, bool, None; RNG states are stored as such too). ``save_checkpoint`` checks this and
``load_checkpoint`` opens the file with ``torch.load(weights_only=True)``, so a checkpoint from
anyone cannot execute code; one holding other objects is refused with CheckpointError.

Atomic: a checkpoint is written into ``step-XXXXXX.tmp`` and renamed into place; ``latest`` is
replaced with ``os.replace``. A crash at any moment leaves the previous checkpoint intact.

``load_trained_policy`` is what ``vespo eval --model`` opens: a run directory, a checkpoint (its
weights in the run's architecture) or a Hugging Face model directory.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vespo.errors import CheckpointError, ModelError, ResumeError

KEEP = 2  # complete checkpoints kept on disk
MODEL_FILE, STATE_FILE, CONFIG_FILE = "model.safetensors", "trainer.pt", "run_config.json"
POLICY_DIR = "policy"


# ---------------------------------------------------------------- writing


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any],
                    config: dict) -> Path:
    """Write ``RUN_DIR/checkpoints/step-{step}`` atomically; ``trainer_state`` must be tensors and plain data."""
    state = {**trainer_state, "rng": rng_state()}
    check_plain(state)
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / MODEL_FILE))  # clones: tied weights are stored twice
    torch.save(state, tmp / STATE_FILE)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _prune(root, keep=KEEP)
    return final


PLAIN_TYPES = (str, int, float, bool, type(None))
CONTAINER_TYPES = (dict, OrderedDict, list, tuple, torch.Size)


def check_plain(value: Any, where: str = "trainer state") -> None:
    """Raise TypeError naming the first value that ``torch.load(weights_only=True)`` would refuse.

    Exact types are checked: a numpy float64 is a float subclass, but it pickles as a numpy object."""
    if isinstance(value, torch.Tensor) or type(value) in PLAIN_TYPES:
        return
    if type(value) not in CONTAINER_TYPES:
        raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint stores "
                        "tensors and plain Python values only (dict, list, tuple, str, int, float, bool, None)")
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(value, dict) and type(key) not in PLAIN_TYPES:
            raise TypeError(f"{where} has a key of type {type(key).__qualname__}; use str or int keys")
        check_plain(item, f"{where}.{key}" if isinstance(value, dict) else f"{where}[{key}]")


def save_run_policy(run_dir: str | Path, model: torch.nn.Module, tokenizer: Any, config: dict) -> Path:
    """Write ``RUN_DIR/policy/`` (replacing the previous one as a whole); returns its path."""
    from vespo.models.loading import save_policy

    return save_policy(model, tokenizer, Path(run_dir) / POLICY_DIR, config)


# ---------------------------------------------------------------- reading


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load weights into ``model`` (in place) and return the trainer state (RNG restored).

    The trainer state is read first, so a refused checkpoint leaves the model untouched."""
    path = Path(path)
    state = read_trainer_state(path)
    rng = state.pop("rng", None)
    if rng is None:
        raise CheckpointError(f"{path / STATE_FILE} has no RNG state; it was not written by this version of vespo")
    _load_weights(path, model, ResumeError)
    set_rng_state(rng)
    return state


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """``trainer.pt`` of the checkpoint at ``path``, opened without running code."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}; it is incomplete, resume from another one")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"WeightsUnpickler error: ([^.]*)", str(e))
        raise CheckpointError(
            f"{file} holds objects other than tensors and plain data ({found.group(1) if found else e}); vespo does "
            "not open it, since loading it could run code. Load it yourself with torch.load(weights_only=False) "
            "only if you trust where it came from") from e
    except (RuntimeError, EOFError) as e:
        raise CheckpointError(f"{file} cannot be read ({str(e).splitlines()[0]}); it is damaged, resume from "
                              "another checkpoint") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a trainer state")
    return state


def policy_from_checkpoint(path: str | Path, dtype: str | None = None) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode, tokenizer): the run's architecture, built from the checkpoint's
    ``run_config.json`` (a tiny model, or the ``model.path`` it started from), with the
    checkpoint's weights; in ``dtype`` (default: the run's ``model.dtype``)."""
    from vespo.config import from_dict
    from vespo.models.loading import build_model, resolve_dtype

    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}; it is incomplete or not a vespo checkpoint")
    cfg = from_dict(json.loads(config_file.read_text()))
    model, tokenizer = build_model(cfg.model, seed=cfg.run.seed)
    _load_weights(path, model, CheckpointError)
    return model.to(resolve_dtype(dtype or cfg.model.dtype)).eval(), tokenizer


def load_trained_policy(path: str | Path, dtype: str = "float32") -> tuple[torch.nn.Module, Any, str]:
    """(model, tokenizer, what was loaded) from what ``vespo eval --model`` accepts:

    - a run directory: its ``policy/``, else its latest checkpoint;
    - a checkpoint directory (``RUN_DIR/checkpoints/step-NNNNNN``): its weights in the run's architecture;
    - a Hugging Face model directory (``config.json`` and weights), e.g. ``RUN_DIR/policy``.
    """
    from vespo.models.loading import load_policy

    path = Path(path)
    if (path / POLICY_DIR / "config.json").is_file():
        model, tokenizer = load_policy(path / POLICY_DIR, dtype=dtype)
        return model, tokenizer, f"{path / POLICY_DIR} (the run's final policy)"
    if (path / MODEL_FILE).is_file() and (path / CONFIG_FILE).is_file() and not (path / "config.json").is_file():
        model, tokenizer = policy_from_checkpoint(path, dtype)
        return model, tokenizer, f"{path} (a checkpoint)"
    if (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ModelError(f"run directory {path} has no {POLICY_DIR}/ and no complete checkpoint yet; evaluate it "
                             "after its first checkpoint (run.checkpoint_every), or pass a model directory")
        model, tokenizer = policy_from_checkpoint(latest, dtype)
        return model, tokenizer, f"{latest} (the run has no {POLICY_DIR}/ yet: its latest checkpoint)"
    model, tokenizer = load_policy(path, dtype=dtype)
    return model, tokenizer, str(path)


def _load_weights(path: Path, model: torch.nn.Module, error: type[Exception]) -> None:
    file = path / MODEL_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MODEL_FILE}; it is incomplete")
    try:
        model.load_state_dict(load_file(str(file)))
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise error(f"{file} holds the weights of another model ({detail}); use the config the run was started "
                    "with (RUN_DIR/config.yaml)") from e


# ---------------------------------------------------------------- RNG states as tensors and plain values


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch (and CUDA, once in use) generator states, as tensors and plain values."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),  # [625]
                   "gauss_next": gauss_next},
        "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),  # [624]
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` saved. CUDA states are restored when this process has as many devices."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


# ---------------------------------------------------------------- housekeeping


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
