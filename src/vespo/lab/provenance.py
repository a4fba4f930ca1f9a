"""A sweep directory's own record of how it was run: one line of SWEEP_DIR/sessions.jsonl per
`vespo sweep` call that runs something (start, end, command, git commit of the code, machine).

The line is written when the call starts and rewritten every ``beat_s`` seconds, so a call that is
killed outright (SIGKILL, a machine restart) still leaves its start, the last time it was seen alive
and the seconds up to then, with ``end`` null: the page counts it as killed. A sweep resumed over
several calls has several lines; its wall time is their sum.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from vespo.metrics import read_jsonl

SESSIONS = "sessions.jsonl"


class session:
    """``with session(out, command, jobs) as record: ...``; the caller may add fields to ``record``."""

    def __init__(self, out: Path, command_line: str, jobs: int, beat_s: float = 60.0):
        self.path = out / SESSIONS
        self.beat_s = beat_s
        self.record = {"command": command_line, "jobs": jobs, **source_commit(), "machine": machine()}
        self._stop = threading.Event()

    def __enter__(self) -> dict:
        self.t0 = time.time()
        self.record.update(start=_iso(self.t0), end=None, seconds=0.0, interrupted=None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            self.offset = f.tell()  # where this call's line starts: rewritten in place from here
            f.write(json.dumps(self.record) + "\n")
        self._beat = threading.Thread(target=self._beating, daemon=True)
        self._beat.start()
        return self.record

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._beat.join()
        t1 = time.time()
        self.record.update(end=_iso(t1), seconds=round(t1 - self.t0, 1), interrupted=exc_type is not None)
        self._write()

    def _beating(self) -> None:
        while not self._stop.wait(self.beat_s):
            now = time.time()
            self.record.update(last_seen=_iso(now), seconds=round(now - self.t0, 1))
            self._write()

    def _write(self) -> None:
        with open(self.path, "r+") as f:  # this call's line is the file's last: keep what came before
            f.seek(self.offset)
            f.truncate()
            f.write(json.dumps(dict(self.record)) + "\n")


def read_sessions(sweep_dir: Path) -> list[dict]:
    path = sweep_dir / SESSIONS
    return read_jsonl(path) if path.is_file() else []


def merge_sessions(out: Path, sessions: list[dict]) -> None:
    """Add to SWEEP_DIR/sessions.jsonl the (archived) sessions it does not hold yet."""
    seen = {(s.get("start"), s.get("command")) for s in read_sessions(out)}
    new = [s for s in sessions if (s.get("start"), s.get("command")) not in seen]
    if new:
        with open(out / SESSIONS, "a") as f:
            f.writelines(json.dumps(s) + "\n" for s in new)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def source_commit() -> dict:
    """{"commit", "dirty", "source"}: the git commit of the vespo code being run (the repository
    holding the package, else the current directory); dirty if src/ or configs/ have changes."""
    import vespo

    source = Path(vespo.__file__).resolve().parent
    for where in (source, Path.cwd()):
        root = _git(where, "rev-parse", "--show-toplevel")
        if root:
            status = _git(Path(root), "status", "--porcelain", "--", "src", "configs")
            return {"commit": _git(Path(root), "rev-parse", "HEAD"), "dirty": bool(status), "source": str(source)}
    return {"commit": None, "dirty": None, "source": str(source)}


def _git(where: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = None
    return {"node": platform.node(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch_version}
