"""Load problems from verl-style parquet / jsonl, or from plain jsonl with `prompt` and `answer`.

verl-style row:  {"data_source": "math500", "prompt": [{"role": "user", "content": "..."}] or "...",
                  "reward_model": {"ground_truth": "..."}, "extra_info": {...}}
plain row:       {"prompt": "...", "answer": "..."}          (data_source = the file's stem)

Rows are numbered from 1 (the jsonl line number, or the parquet row + 1). Any malformed row
raises DataError (a ValueError) naming the file, the row and the field; a missing file raises
MissingPathError (a FileNotFoundError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vespo.errors import DataError, MissingPathError
from vespo.tasks.reasoning_gym import PREFIX as RG_PREFIX
from vespo.types import Problem

SUFFIXES = (".parquet", ".jsonl")


def load_problems(path: str | Path) -> list[Problem]:
    """All problems of a .parquet or .jsonl file, in file order."""
    if str(path).startswith(RG_PREFIX):
        raise DataError(f"{str(path)!r} names a reasoning-gym task, not a dataset file: use task.name={path} (with "
                        f"`vespo eval`, --task {path}) and leave task.dataset empty")
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"dataset file {str(path)!r} does not exist; check the path (task.dataset or --data)")
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    rows = _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
    problems = [_row_to_problem(row, number, path) for number, row in rows]
    if not problems:
        raise DataError(f"{path}: the file has no rows")
    _check_unique_ids(problems, path)
    return problems


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: row {number}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                f"{exc.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: row {number}: not valid JSON ({exc.msg})") from exc
    return rows


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: cannot read as parquet ({exc})") from exc
    return list(enumerate(table.to_pylist(), start=1))


def _row_to_problem(row: Any, number: int, path: Path) -> Problem:
    where = f"{path}: row {number}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = _check_prompt(row.get("prompt"), where)
    if row.get("reward_model") is not None:
        truth = _verl_ground_truth(row["reward_model"], where)
    elif "answer" in row:
        truth = row["answer"]
    else:
        raise DataError(f"{where}: field 'reward_model.ground_truth' (or 'answer') is missing")
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        raise DataError(f"{where}: the ground truth ('reward_model.ground_truth' or 'answer') is empty")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DataError(f"{where}: field 'extra_info' must be an object, got {type(extra).__name__}")
    source = row.get("data_source") or path.stem
    if not isinstance(source, str):
        raise DataError(f"{where}: field 'data_source' must be a string, got {type(source).__name__}")
    pid = row.get("id", extra.get("index", f"{path.stem}-{number}"))
    return Problem(id=str(pid), prompt=prompt, ground_truth=truth, data_source=source, extra_info=dict(extra))


def _verl_ground_truth(reward_model: Any, where: str) -> Any:
    if not isinstance(reward_model, dict):
        raise DataError(f"{where}: field 'reward_model' must be an object, got {type(reward_model).__name__}")
    if "ground_truth" not in reward_model:
        raise DataError(f"{where}: field 'reward_model.ground_truth' is missing")
    return reward_model["ground_truth"]


def _check_prompt(prompt: Any, where: str) -> str | list[dict[str, str]]:
    if prompt is None:
        raise DataError(f"{where}: field 'prompt' is missing")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is empty")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: field 'prompt' must be a string or a non-empty list of messages")
    for k, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataError(f"{where}: field 'prompt[{k}]' must be a {{role, content}} object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DataError(f"{where}: field 'prompt[{k}].{key}' must be a string")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _check_unique_ids(problems: list[Problem], path: Path) -> None:
    seen: dict[str, int] = {}
    for number, p in enumerate(problems, start=1):
        if p.id in seen:
            raise DataError(f"{path}: row {number}: field 'id' {p.id!r} repeats the id of row {seen[p.id]}")
        seen[p.id] = number
