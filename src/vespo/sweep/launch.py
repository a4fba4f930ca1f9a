"""Running a sweep's jobs, each its own `vespo train` process, here or as Ray tasks; each run's lab.json (its
labels and overrides, how its process ended, and whether the learner's non-finite guard stopped it, as the run's
summary.json says)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from vespo.errors import INTERRUPTED
from vespo.rundir import (CHECKPOINTS, EVAL_BEFORE, LAB, METRICS, RESTARTED, SAMPLES, SUMMARY, TRAIN_LOG, read_summary,
                          stopped_nonfinite)
from vespo.sweep.plan import Job, run_overrides, start_warnings

RUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def command(job: Job, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "vespo.cli", "train", "--config", str(out / "base.yaml")]
    return cmd + (["--resume"] if job.action == "resume" else []) + run_overrides(job.point, job.run_dir)


def start_local(args: list[str], log: Path) -> subprocess.Popen:
    """A process on this machine (a started run is anything with poll() and wait())."""
    with open(log, "a") as f:
        return subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **RUN_ENV})


class RayStarter:
    """Starts each run as a Ray task on a node with ``cpus`` and ``gpus`` free, which runs the process there."""

    def __init__(self, address: str, cpus: float, gpus: float, jobs: int):
        import ray

        self.ray, self.owned = ray, not ray.is_initialized()
        if self.owned:
            ray.init(**({"address": address} if address != "local" else {"include_dashboard": False, "num_cpus": max(
                jobs * cpus, 1), "_node_ip_address": "127.0.0.1"}), log_to_driver=False)
        self.task = ray.remote(_run_on_node).options(num_cpus=cpus, num_gpus=gpus, max_retries=0)

    def __call__(self, args: list[str], log: Path) -> RayStarter.Run:
        return self.Run(self.task.remote(args, str(log)).future())

    class Run(NamedTuple):  # a run started as a Ray task, polled like a process
        future: Future

        def poll(self) -> int | None:
            return self.wait() if self.future.done() else None

        def wait(self) -> int:
            try:
                return int(self.future.result())
            except Exception:  # the node or the task died: a failed run (resumable)
                return -1

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()


def _run_on_node(args: list[str], log: str) -> int:
    return start_local(args, Path(log)).wait()


class Stopping:
    """A sweep asked to stop (Ctrl-C, or SIGTERM from `kill` or a scheduler) starts no further run; SIGTERM is
    passed on to the runs of this machine it started, which, as Ctrl-C does (the terminal sends that to every
    process of the group), finish their step, checkpoint and exit 130. The same command resumes them."""

    def __init__(self) -> None:
        self.event, self.signal, self.running = threading.Event(), None, set()
        self._previous: dict = {}

    def __enter__(self) -> Stopping:
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not in the main thread: leave signals alone
            self._previous = {}
        return self

    def _handle(self, signum, frame) -> None:
        first = not self.event.is_set()
        self.event.set()
        self.signal = self.signal or signal.Signals(signum).name
        if signum == signal.SIGTERM:
            for run in list(self.running):
                if hasattr(run, "send_signal") and run.poll() is None:
                    run.send_signal(signal.SIGTERM)
        if first:
            print(f"vespo sweep: stopping ({self.signal}): no further run starts; the running ones checkpoint and "
                  "stop; the same command resumes", flush=True)

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


def run_all(jobs: list[Job], out: Path, n_jobs: int, start: Callable = start_local,
            stopping: Stopping | None = None) -> int:
    """Run the pending jobs ``n_jobs`` at a time; returns how many failed. Once ``stopping`` is set no further
    job starts (each is left as it was: the next call runs it)."""
    pending = [j for j in jobs if j.action in ("start", "resume")]
    locks = {j.warm_key: threading.Lock() for j in pending if j.warm_key} | {"": contextlib.nullcontext()}
    stopping = stopping or Stopping()

    def one(job: Job) -> int:
        log = job.run_dir / TRAIN_LOG
        with locks[job.warm_key]:  # the first of a warm start's runs holds it until the file is there
            if stopping.event.is_set():
                print(f"  left    {job.point.name} (the sweep was stopped; the same command runs it)", flush=True)
                return 0
            job.run_dir.mkdir(parents=True, exist_ok=True)
            if job.action == "resume":
                _set_aside_uncheckpointed(job.run_dir)
            print(f"  {job.action:<7} {job.point.name}", flush=True)
            started, earlier = time.time(), _summary_written(job.run_dir)
            _write_lab(job, {"status": "running", "started": started})
            run = start(command(job, out)[1:], log)  # the node's own Python runs it
            stopping.running.add(run)
            if stopping.event.is_set() and stopping.signal == "SIGTERM" and hasattr(run, "send_signal"):
                run.send_signal(signal.SIGTERM)  # started as the signal came: stopped as the others were
            made = bool(job.warm_key) and not Path(job.warm_key).is_file()
            while job.warm_key and not Path(job.warm_key).is_file() and run.poll() is None:
                time.sleep(0.5)
            if made and Path(job.warm_key).is_file():  # made now: is it the start the finished runs recorded?
                for line in start_warnings(jobs, {job.warm_key}):
                    print(f"  warning: {line}", flush=True)
        returncode = run.wait()
        stopping.running.discard(run)
        ok = returncode in (0, INTERRUPTED)
        status = "finished" if returncode == 0 else "interrupted" if returncode == INTERRUPTED else "failed"
        _write_lab(job, {"status": status, "returncode": returncode, "started": started,
                         "ended": time.time(), "stopped_nonfinite": (not ok) and _stopped_nonfinite(job, earlier)})
        shown = {"finished": "done", "interrupted": "stopped", "failed": "FAILED"}[status]
        said = {"finished": "", "interrupted": " (Ctrl-C or SIGTERM; the next call resumes it)",
                "failed": f" (exit {returncode}; see {log})"}[status]
        print(f"  {shown:<7} {job.point.name}{said}", flush=True)
        return 0 if ok else 1

    with ThreadPoolExecutor(max(1, n_jobs)) as pool:
        return sum(pool.map(one, pending))


def _summary_written(run_dir: Path) -> int | None:
    """When the run's summary.json was written (ns), None where it has none."""
    path = run_dir / SUMMARY
    return path.stat().st_mtime_ns if path.is_file() else None


def _stopped_nonfinite(job: Job, earlier: int | None) -> bool:
    """The run's summary, written by this start of it (not the one an earlier start left, written ``earlier``),
    says the learner's non-finite guard stopped it."""
    written = _summary_written(job.run_dir)
    return written is not None and written != earlier and stopped_nonfinite(read_summary(job.run_dir))


def _set_aside_uncheckpointed(run_dir: Path) -> None:
    """A run of the sweep killed before its first checkpoint has nothing to resume from, and `vespo train
    --resume` refuses to start a run directory with rows over: the sweep, which owns the directory, starts
    the run over itself (the rows are redone bit for bit). The old files are moved to
    RUN_DIR/restarted/<time>/, never deleted."""
    if any((run_dir / CHECKPOINTS).glob("step-*")):
        return
    old = [run_dir / name for name in (METRICS, SAMPLES, EVAL_BEFORE)]
    if not any(path.exists() for path in old):
        return
    aside = run_dir / RESTARTED / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for path in old:
        if path.exists():
            path.replace(aside / path.name)


def _write_lab(job: Job, extra: dict) -> None:
    (job.run_dir / LAB).write_text(json.dumps({"labels": job.point.labels, "overrides": job.point.overrides,
                                                      **extra}, indent=2))
