"""A sweep session's record in sessions.jsonl (with its heartbeat), the code's git commit and the machine."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import subprocess
import threading
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import vespo
from vespo.lab.runs import SESSIONS


@contextlib.contextmanager
def session(out: Path, command_line: str, jobs: int, beat_s: float = 60.0):
    """``with session(out, command, jobs) as record: ...``; the caller may add fields to ``record``. Its line of
    sessions.jsonl is rewritten every ``beat_s`` seconds; a call killed outright leaves ``end`` null."""
    t0, stop = time.time(), threading.Event()
    record = {"command": command_line, "jobs": jobs, **source_commit(), "machine": machine(), "start": _iso(t0),
              "end": None, "seconds": 0.0, "interrupted": None}
    out.mkdir(parents=True, exist_ok=True)
    write_sessions(out, [record])

    def beat() -> None:
        while not stop.wait(beat_s):
            record.update(last_seen=_iso(time.time()), seconds=round(time.time() - t0, 1))
            write_sessions(out, [record])

    thread, interrupted = threading.Thread(target=beat, daemon=True), True
    thread.start()
    try:
        yield record
        interrupted = False
    finally:
        stop.set()
        thread.join()
        record.update(end=_iso(time.time()), seconds=round(time.time() - t0, 1), interrupted=interrupted)
        write_sessions(out, [record])


def write_sessions(out: Path, records: list[dict], replace: bool = True) -> None:
    """Each record's line of sessions.jsonl, found by its (command, start): rewritten (kept unless ``replace``),
    else added. Under a file lock: calls may run at once on one sweep directory (on different points)."""
    path = out / SESSIONS
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        lines = {_key(line): line for line in path.read_text().splitlines()} if path.is_file() else {}
        for record in records:
            key = record.get("command"), record.get("start")
            if replace or key not in lines:
                lines[key] = json.dumps(dict(record))  # a copy: the heartbeat's thread may write it meanwhile
        path.with_suffix(".tmp").write_text("".join(line + "\n" for line in lines.values()))
        os.replace(path.with_suffix(".tmp"), path)


def _key(line: str) -> tuple | str:
    """(command, start) of a sessions.jsonl line: the call that wrote it."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError:  # a line another version's concurrent calls garbled: kept as it is
        return line
    return item.get("command"), item.get("start")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def source_commit() -> dict:
    """{"commit", "dirty", "source"}: the git commit of the vespo code being run (the repository holding the
    package, else the current directory); dirty if src/ or configs/ have changes."""
    source = Path(vespo.__file__).resolve().parent
    for where in (source, Path.cwd()):
        if commit := _git(where, "rev-parse", "HEAD"):
            dirty = bool(_git(where, "status", "--porcelain", "--", ":/src", ":/configs"))  # ":/": from the top
            return {"commit": commit, "dirty": dirty, "source": str(source)}
    return {"commit": None, "dirty": None, "source": str(source)}


def _git(where: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def machine() -> dict:
    return {"node": platform.node(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": version("torch")}  # torch is a dependency: installed where vespo is
