"""Atomic checkpoints that cannot run code when opened, and the policy a run leaves behind.

Layout of a run directory:

    RUN_DIR/checkpoints/step-000010/  dcp/                the policy's weights and the optimizer's state
                                                          (torch.distributed.checkpoint: each rank writes
                                                          its shards, any number of ranks can read them)
                                      trainer.pt          optimizer settings, scheduler, RNG states of every
                                                          rank, data cursor, counters
                                      run_config.json     the run's config (plain data)
    RUN_DIR/checkpoints/latest        the name of the newest complete checkpoint
    RUN_DIR/policy/                   the policy as a Hugging Face directory (save_pretrained: config.json,
                                      model.safetensors, tokenizer files) plus run_config.json

Resharding: a checkpoint written by P ranks resumes on P' ranks (2 -> 1, 1 -> 2, ...) with the
same weights and optimizer state; with the same P it resumes bit for bit.

Safe to open: ``trainer.pt`` holds tensors and plain Python values only (dict, list, tuple, str,
int, float, bool, None; RNG states are stored as such too). ``save_checkpoint`` checks this and
``load_checkpoint`` opens the file with ``torch.load(weights_only=True)``. ``dcp/`` holds tensors
only (the optimizer's plain settings live in trainer.pt), its tensor files are read with
``weights_only=True`` and its index with an unpickler that admits only the checkpoint's own metadata
types (``SafeReader``), so a checkpoint from anyone cannot execute code; one holding other objects is
refused with CheckpointError.

Atomic: a checkpoint is written into ``step-XXXXXX.tmp`` and renamed into place (by rank 0, once
every rank has written); ``latest`` is replaced with ``os.replace``. A crash at any moment leaves the
previous checkpoint intact.

``load_trained_policy`` is what ``vespo eval --model`` opens: a run directory, a checkpoint (its
weights in the run's architecture) or a Hugging Face model directory.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from vespo.config import added_at_default
from vespo.errors import CheckpointError, ModelError, ResumeError
from vespo.models.forward import policy_keys
from vespo.trainer.distributed import Dist

KEEP = 2  # complete checkpoints kept on disk
SHARDS_DIR, STATE_FILE, CONFIG_FILE = "dcp", "trainer.pt", "run_config.json"
POLICY_DIR = "policy"


# ---------------------------------------------------------------- writing


def save_checkpoint(run_dir: str | Path, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], config: dict, dist: Dist | None = None) -> Path:
    """Write ``RUN_DIR/checkpoints/step-{step}`` atomically (every rank calls it); ``trainer_state`` must be
    tensors and plain data. ``module`` is the learner's LogprobModule (sharded or not)."""
    dist = dist or Dist.single()
    model_state, optim_state, param_groups = _sharded_state(module, optimizer)
    state = {**trainer_state, "optimizer_groups": param_groups, "rng": dist.gather_object(rng_state())}
    check_plain(state)
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step:06d}", root / f"step-{step:06d}.tmp"
    if dist.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    with _one_process_quietly(dist):
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / SHARDS_DIR))
    dist.barrier()
    if dist.is_main:
        torch.save(state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        _prune(root, keep=KEEP)
    dist.barrier()
    return final


def _sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """(model state, optimizer tensors by parameter name, optimizer settings) of this rank, keyed by the module's
    parameter names: tensors (DTensor shards on several ranks) for dcp, plain settings (lr, betas, ...) for
    trainer.pt."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(module)
    if optimizer is None:
        return model_state, {}, []
    optim = get_optimizer_state_dict(module, optimizer)
    return model_state, dict(optim["state"]), [_plain_group(g) for g in optim["param_groups"]]


def _plain_group(group: dict) -> dict:
    """An optimizer param group as plain data (tuples of betas become lists; parameter names kept)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}


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


def save_run_policy(run_dir: str | Path, model: torch.nn.Module, tokenizer: Any, config: dict,
                    weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``RUN_DIR/policy/`` (replacing the previous one as a whole); returns its path.

    ``weights``: the full weights when ``model`` itself holds shards (a sharded learner gathers them);
    the directory is then written from a fresh copy of the architecture holding them."""
    from vespo.models.loading import save_policy

    if weights is not None:
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_config(model.config)
        full.load_state_dict(weights)
        model = full
    return save_policy(model, tokenizer, Path(run_dir) / POLICY_DIR, config)


# ---------------------------------------------------------------- reading


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def load_checkpoint(path: str | Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    dist: Dist | None = None) -> dict[str, Any]:
    """Load weights (and optimizer state) into the learner's ``module`` in place, on any number of ranks, and
    return the trainer state (this rank's RNG restored when the checkpoint has one for it).

    The trainer state is read first, so a refused checkpoint leaves the model untouched."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

    dist = dist or Dist.single()
    path = Path(path)
    state = read_trainer_state(path)
    rngs = state.pop("rng", None)
    if rngs is None:
        raise CheckpointError(f"{path / STATE_FILE} has no RNG state; it was not written by this version of vespo")
    groups = state.pop("optimizer_groups", [])
    model_state, optim_state, _ = _sharded_state(module, optimizer)
    target = {"model": model_state, "optim": optim_state} if optimizer is not None else {"model": model_state}
    _read_shards(path, target, ResumeError)
    set_model_state_dict(module, target["model"], options=StateDictOptions(strict=True))
    if optimizer is not None:
        current = get_optimizer_state_dict(module, optimizer)
        loaded = {"state": target["optim"],
                  "param_groups": [{**g, "params": c["params"]} for g, c in zip(groups, current["param_groups"])]}
        set_optimizer_state_dict(module, optimizer, loaded)
    if dist.world == len(rngs):  # the same number of ranks: each continues its own random streams
        set_rng_state(rngs[dist.rank])
    return state


# fields a resumed run may change: how long it runs and how it reports, where it runs, not what it trains
RESUMABLE_CHANGES = ("run.steps", "run.updates", "run.progress", "run.threads", "run.loggers", "run.checkpoint_every",
                     "run.eval_every", "run.log_samples_every", "run.samples_per_log", "run.save_policy_every",
                     "run.max_nonfinite_steps", "model.device", "rollout.device", "warmstart.cache_dir",
                     "async.ray_address", "async.stall_timeout_s", "async.max_restarts", "async.workers",
                     "async.learner_num_cpus", "async.learner_num_gpus")


def check_resume_config(path: str | Path, config: dict) -> None:
    """Refuse to resume the checkpoint at ``path`` under a config that trains something else than its run."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return
    saved = _flat(json.loads(file.read_text()))
    now = _flat(json.loads(json.dumps(config, default=str)))
    changed = sorted(k for k in saved.keys() | now.keys()
                     if saved.get(k) != now.get(k) and not k.startswith(RESUMABLE_CHANGES)
                     and not (k not in saved and added_at_default(k, now[k])))  # a field newer than the run
    if changed:
        shown = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:4])
        raise ResumeError(f"--resume with another config than the run's ({shown}{'; ...' if len(changed) > 4 else ''}):"
                          f" resume with its config ({Path(path).parent.parent / 'config.yaml'}), changing only how "
                          "long it runs and how it reports")


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("options",):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def policy_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load a run checkpoint's weights (a learner's LogprobModule: ``policy.*``) into a plain policy ``model``
    in place, in one process."""
    target = {"model": {f"policy.{k}": v for k, v in model.state_dict().items()}}
    _read_shards(Path(path), target, CheckpointError)
    model.load_state_dict(policy_keys(target["model"]))


def _read_shards(path: Path, target: dict, error: type[Exception]) -> None:
    """Fill ``target`` (state dicts of this rank's tensors, shards or full) from ``path/dcp`` in place."""
    shards = path / SHARDS_DIR
    if not (shards / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} has no {SHARDS_DIR}/.metadata; it is incomplete")
    SafeReader(str(shards)).read_metadata()  # refuses an unsafe index here, before dcp wraps the error
    try:
        with _one_process_quietly():
            dcp.load(target, storage_reader=SafeReader(str(shards)))
    except (Exception, CheckpointException) as e:  # a mismatch of names or shapes: another model
        lines = [line for line in str(e).splitlines() if "Error:" in line] or [str(e)]
        detail = " ".join(lines[-1].split())[:300]
        raise error(f"{shards} holds the weights of another model ({detail}); use the config the run was started "
                    "with (RUN_DIR/config.yaml)") from e


@contextmanager
def _one_process_quietly(dist: Dist | None = None):
    """dcp warns each time it saves or loads without a process group; in one process that is the intent."""
    with warnings.catch_warnings():
        if not (dist or Dist.single()).active:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class SafeReader(FileSystemReader):
    """dcp's file reader whose index (``.metadata``) is unpickled admitting only dcp's own metadata types."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

        with open(Path(self.path) / ".metadata", "rb") as f:
            try:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"{self.path}/.metadata holds objects other than checkpoint metadata ({e}); "
                                      "vespo does not open it, since loading it could run code") from e
        if any(isinstance(m, BytesStorageMetadata) for m in metadata.state_dict_metadata.values()):
            raise CheckpointError(f"{self.path} stores pickled objects besides tensors; vespo does not open it")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes a dcp index is made of, nothing else."""

    ALLOWED = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module in self.MODULES:  # classes defined there (dataclasses of the index), not names they import
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


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
    policy_weights(path, model)
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
    if (path / SHARDS_DIR).is_dir() and (path / CONFIG_FILE).is_file() and not (path / "config.json").is_file():
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


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
