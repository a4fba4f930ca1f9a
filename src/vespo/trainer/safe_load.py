"""Opening a checkpoint without running code: what ``trainer.pt`` may hold, and readers that admit nothing else.

``trainer.pt`` holds tensors and plain Python values only (dict, list, tuple, str, int, float, bool,
None; RNG states are stored as such too): ``check_plain`` checks this before it is written and
``load_plain`` opens it with ``torch.load(weights_only=True)``. ``dcp/`` (torch.distributed.checkpoint)
holds tensors only; its tensor files are read with ``weights_only=True`` and its index with an
unpickler that admits only the checkpoint's own metadata types (``SafeReader``), so a checkpoint from
anyone cannot execute code; one holding other objects is refused with CheckpointError.
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from vespo.errors import CheckpointError
from vespo.trainer.distributed import Dist


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


def load_plain(file: Path) -> Any:
    """What ``torch.save`` wrote to ``file``, opened with ``weights_only=True``: tensors and plain data, or a
    CheckpointError saying why not (other objects, a damaged file)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"WeightsUnpickler error: ([^.]*)", str(e))
        raise CheckpointError(
            f"{file} holds objects other than tensors and plain data ({found.group(1) if found else e}); vespo does "
            "not open it, since loading it could run code. Load it yourself with torch.load(weights_only=False) "
            "only if you trust where it came from") from e
    except (RuntimeError, EOFError, OSError) as e:  # a truncated zip archive raises any of them
        raise CheckpointError(f"{file} cannot be read ({str(e).splitlines()[0]}); it is damaged, resume from "
                              "another checkpoint") from e


def read_shards(shards: Path, target: dict, error: type[Exception]) -> None:
    """Fill ``target`` (state dicts of this rank's tensors, shards or full) from the dcp directory ``shards`` in
    place; a mismatch of names or shapes (another model) raises ``error``."""
    if not (shards / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {shards.parent} has no {shards.name}/.metadata; it is incomplete")
    check_shard_files(shards)  # refuses an unsafe index or a short shard here, before dcp wraps the error
    try:
        with one_process_quietly():
            dcp.load(target, storage_reader=SafeReader(str(shards)))
    except (Exception, CheckpointException) as e:  # a mismatch of names or shapes: another model
        lines = [line for line in str(e).splitlines() if "Error:" in line] or [str(e)]
        detail = " ".join(lines[-1].split())[:300]
        raise error(f"{shards} holds the weights of another model ({detail}); use the config the run was started "
                    "with (RUN_DIR/config.yaml)") from e


def check_shard_files(shards: Path) -> None:
    """Raise CheckpointError naming a shard file of the dcp directory ``shards`` that is missing or shorter than its
    index says (a write cut short: a full disk, a killed copy); reads the index, not the tensors."""
    metadata = SafeReader(str(shards)).read_metadata()
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = shards / name
        if not file.is_file():
            raise CheckpointError(f"shard {file} is missing; the checkpoint is incomplete")
        if file.stat().st_size < size:
            raise CheckpointError(f"shard {file} is truncated ({file.stat().st_size} of {size} bytes); the "
                                  "checkpoint is damaged")


@contextmanager
def one_process_quietly(dist: Dist | None = None):
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
