"""Atomic checkpoints of the training state, written by every rank and resumable on any number of ranks.

Layout of a run directory:

    RUN_DIR/checkpoints/step-000010/  dcp/                the policy's weights and the optimizer's state
                                                          (torch.distributed.checkpoint: each rank writes
                                                          its shards, any number of ranks can read them)
                                      trainer.pt          optimizer settings, scheduler, RNG states of every
                                                          rank, data cursor, counters
                                      run_config.json     the run's config (plain data)
    RUN_DIR/checkpoints/latest        the name of the newest complete checkpoint
    RUN_DIR/policy/                   the policy as a Hugging Face directory (vespo.trainer.policy_dir)

Resharding: a checkpoint written by P ranks resumes on P' ranks (2 -> 1, 1 -> 2, ...) with the
same weights and optimizer state; with the same P it resumes bit for bit.

Safe to open: ``trainer.pt`` holds tensors and plain Python values only, and both it and ``dcp/`` are
read by vespo.trainer.safe_load, which admits nothing that could run code.

Atomic: a checkpoint is written into ``step-XXXXXX.tmp`` and renamed into place (by rank 0, once
every rank has written); ``latest`` is replaced with ``os.replace``. A crash at any moment, or a full
disk (DiskFullError, the partial copy removed), leaves the previous checkpoint intact.

Resuming: ``resume_point`` picks the checkpoint ``latest`` names when it verifies (weights, optimizer,
trainer state, RNG), else the newest step directory that does, with a note naming it; a run directory
that holds a run but no checkpoint that verifies is refused (ResumeError), never started over.
``check_resume_config`` refuses to resume under a config that trains something else (where the run
directory lies is not part of it: a moved or copied run resumes).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from vespo.config import added_at_default
from vespo.errors import FREE_AND_RESUME, CheckpointError, DiskFullError, ResumeError, disk_full
from vespo.rundir import CHECKPOINTS, METRICS
from vespo.trainer.distributed import Dist
from vespo.trainer.safe_load import check_plain, check_shard_files, load_plain, one_process_quietly, read_shards

KEEP = 2  # complete checkpoints kept on disk
SHARDS_DIR, STATE_FILE, CONFIG_FILE = "dcp", "trainer.pt", "run_config.json"
STEP_NAME = re.compile(r"step-\d{6}")


# ---------------------------------------------------------------- writing


def save_checkpoint(run_dir: str | Path, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], config: dict, dist: Dist | None = None) -> Path:
    """Write ``RUN_DIR/checkpoints/step-{step}`` atomically (every rank calls it); ``trainer_state`` must be
    tensors and plain data. ``module`` is the learner's LogprobModule (sharded or not)."""
    dist = dist or Dist.single()
    model_state, optim_state, param_groups = _sharded_state(module, optimizer)
    state = {**trainer_state, "optimizer_groups": param_groups, "rng": dist.gather_object(rng_state())}
    check_plain(state)
    root = Path(run_dir) / CHECKPOINTS
    final, tmp = root / f"step-{step:06d}", root / f"step-{step:06d}.tmp"
    try:
        if dist.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        with one_process_quietly(dist):
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / SHARDS_DIR))
        dist.barrier()
        if dist.is_main:
            torch.save(state, tmp / STATE_FILE)
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
            _fsync_tree(tmp)
    except BaseException as e:
        full = disk_full(e)
        if full is None:
            raise
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # the space the partial copy took
        previous = _pointer(root)
        raise DiskFullError(f"no room to write checkpoint {final} ({full.strerror}); the previous checkpoint "
                            f"{'(' + previous + ') ' if previous else ''}is intact: {FREE_AND_RESUME}") from e
    if dist.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        _prune(root, keep=KEEP, newest=final.name)
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


# ---------------------------------------------------------------- reading


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, if it has its trainer state (a resume asks ``resume_point``)."""
    root = Path(run_dir) / CHECKPOINTS
    name = _pointer(root)
    return root / name if name and (root / name / STATE_FILE).is_file() else None


def resume_point(run_dir: str | Path) -> tuple[Path | None, str | None]:
    """(the checkpoint a --resume continues from, a note when it is not the one ``latest`` names): that one when
    it verifies, else the newest step directory that does. (None, None) where the directory holds no run yet;
    a ResumeError, changing nothing, where it holds a run and no checkpoint verifies."""
    root = Path(run_dir) / CHECKPOINTS
    name = _pointer(root)
    if name:
        problem = verify_checkpoint(root / name)
        if problem is None:
            return root / name, None
        why = f"checkpoints/latest names {name}, which {problem}"
    else:
        why = _pointer_problem(root)
    refused = []
    for path in reversed(step_dirs(root)):
        if path.name == name:
            continue  # what is wrong with it is in ``why``
        problem = verify_checkpoint(path)
        if problem is None:
            return path, f"--resume: {why}; resuming from {path}, the newest checkpoint that verifies"
        refused.append(f"{path.name} {problem}")
    held = run_record(run_dir)
    if held:
        found = "; ".join([why, *refused]) if CHECKPOINTS in held else "none was written yet"
        raise ResumeError(f"--resume: {run_dir} holds a run ({held}) but no checkpoint to continue it from ({found}); "
                          "nothing was changed. Start the run again with another run.out_dir, or move this one away")
    return None, None


def verify_checkpoint(path: Path) -> str | None:
    """What keeps the checkpoint at ``path`` from resuming (weights, optimizer, trainer state, RNG), or None;
    reads the indexes and trainer.pt, and checks each shard's length, not the tensors."""
    if not path.is_dir():
        return "does not exist"
    try:
        state = read_trainer_state(path)
        missing = [key for key in ("rng", "updates", "source") if key not in state]
        if missing:
            return f"has a {STATE_FILE} without {', '.join(missing)}"
        if not (path / SHARDS_DIR / ".metadata").is_file():
            return f"has no {SHARDS_DIR}/.metadata (incomplete)"
        check_shard_files(path / SHARDS_DIR)
        if (path / CONFIG_FILE).is_file():
            json.loads((path / CONFIG_FILE).read_text())
    except CheckpointError as e:
        return f"is damaged ({str(e).split(';')[0]})"
    except (OSError, ValueError) as e:
        return f"cannot be read ({e})"
    return None


def step_dirs(root: Path) -> list[Path]:
    """The complete (renamed into place) step directories under ``root``, oldest first."""
    return sorted(p for p in root.glob("step-*") if p.is_dir() and STEP_NAME.fullmatch(p.name))


def run_record(run_dir: str | Path) -> str | None:
    """What shows that ``run_dir`` holds a run ("metrics.jsonl, 12 rows", "checkpoints"), or None: a directory
    with an empty metrics.jsonl and no checkpoint (a start that failed) holds none."""
    run_dir = Path(run_dir)
    held = []
    try:
        rows = sum(1 for line in (run_dir / METRICS).read_bytes().splitlines() if line.strip())
        if rows:
            held.append(f"{METRICS}, {rows} rows")
    except OSError:
        pass
    root = run_dir / CHECKPOINTS
    if step_dirs(root) or (root / "latest").exists():
        held.append(CHECKPOINTS)
    return ", ".join(held) or None


def _pointer(root: Path) -> str | None:
    """The step directory name ``latest`` holds, or None (missing, empty, unreadable, not a step name)."""
    try:
        name = (root / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_NAME.fullmatch(name) else None


def _pointer_problem(root: Path) -> str:
    pointer = root / "latest"
    if not pointer.exists():
        return "checkpoints/latest is missing"
    try:
        text = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return f"checkpoints/latest cannot be read ({type(e).__name__})"
    return "checkpoints/latest is empty" if not text else f"checkpoints/latest holds {text[:40]!r}, not a step name"


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
    read_shards(path / SHARDS_DIR, target, ResumeError)
    set_model_state_dict(module, target["model"], options=StateDictOptions(strict=True))
    if optimizer is not None:
        current = get_optimizer_state_dict(module, optimizer)
        loaded = {"state": target["optim"],
                  "param_groups": [{**g, "params": c["params"]} for g, c in zip(groups, current["param_groups"])]}
        set_optimizer_state_dict(module, optimizer, loaded)
    if dist.world == len(rngs):  # the same number of ranks: each continues its own random streams
        set_rng_state(rngs[dist.rank])
    return state


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """``trainer.pt`` of the checkpoint at ``path``, opened without running code."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}; it is incomplete, resume from another one")
    state = load_plain(file)
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a trainer state")
    return state


# fields a resumed run may change: how long it runs and how it reports, where it runs (a moved run directory
# included), not what it trains
RESUMABLE_CHANGES = ("run.out_dir", "run.steps", "run.updates", "run.progress", "run.threads", "run.loggers",
                     "run.checkpoint_every", "run.eval_every", "run.log_samples_every", "run.samples_per_log",
                     "run.save_policy_every",                     "run.max_nonfinite_steps", "model.device", "rollout.device", "warmstart.cache_dir",
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


def _prune(root: Path, keep: int, newest: str) -> None:
    """Keep the ``keep`` newest checkpoints up to ``newest`` (the one just written); step directories after it
    (left by a run resumed from an earlier step) are rewritten as the run reaches them, not removed."""
    done = [p for p in step_dirs(root) if p.name <= newest]
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
