"""Running a sweep's planned jobs: each grid point a `vespo train` process, ``jobs`` at a time, on
this machine (LocalLauncher) or as Ray tasks on a cluster's nodes (RayLauncher). A run's lab.json
records its labels, overrides and exit status; runs that share a warm start wait for the first of
them to write it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vespo.lab.plan import Job, run_overrides

RUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def command(job: Job, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "vespo.cli", "train", "--config", str(out / "base.yaml")]
    return cmd + (["--resume"] if job.action == "resume" else []) + run_overrides(job.point, job.run_dir)


class Launcher:
    """Where a run's `vespo train` process runs: ``start`` it, then ask which have ``finished``."""

    def start(self, args: list[str], log: Path) -> object: ...

    def finished(self, handles: list[object]) -> list[tuple[object, int]]:
        """(handle, exit code) of the runs among ``handles`` that have ended."""

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class LocalLauncher(Launcher):
    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        with open(log, "a") as f:
            return subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, **RUN_ENV})

    def finished(self, handles: list[object]) -> list[tuple[object, int]]:
        return [(p, p.returncode) for p in handles if p.poll() is not None]


class RayLauncher(Launcher):
    """A Ray task on a cluster node with ``cpus`` and ``gpus`` free, which runs the process there."""

    def __init__(self, address: str, cpus: float, gpus: float, jobs: int):
        import ray

        self.ray, self.started = ray, False
        if not ray.is_initialized():
            if address == "local":
                ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=max(jobs * cpus, 1),
                         log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
            self.started = True
        self.task = ray.remote(_run_on_node).options(num_cpus=cpus, num_gpus=gpus, max_retries=0)

    def start(self, args: list[str], log: Path) -> object:
        return self.task.remote(args, str(log), RUN_ENV)

    def finished(self, handles: list[object]) -> list[tuple[object, int]]:
        if not handles:
            return []
        done, _ = self.ray.wait(handles, num_returns=len(handles), timeout=0)
        out = []
        for ref in done:
            try:
                out.append((ref, int(self.ray.get(ref))))
            except Exception:  # the node or the task died: a failed run (resumable)
                out.append((ref, -1))
        return out

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.ray.shutdown()


def _run_on_node(args: list[str], log: str, env: dict[str, str]) -> int:
    with open(log, "a") as f:
        return subprocess.call([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})


def run_all(jobs: list[Job], out: Path, n_jobs: int, launcher: Launcher | None = None) -> int:
    """Run the pending jobs ``n_jobs`` at a time; returns how many failed."""
    launcher = launcher or LocalLauncher()
    pending = [j for j in jobs if j.action in ("start", "resume")]
    running: dict[object, Job] = {}
    writing: set[str] = set()  # warm-start files being written by a running job
    failed = 0
    while pending or running:
        for handle, code in launcher.finished(list(running)):
            job = running.pop(handle)
            writing.discard(job.warm_key)  # written, or the writer failed: let the next one try
            failed += finish(job, code)
        writing = {key for key in writing if not Path(key).is_file()}
        while len(running) < n_jobs:
            job = next((j for j in pending if not j.warm_key or j.warm_key not in writing), None)
            if job is None:
                break
            pending.remove(job)
            if job.warm_key and not Path(job.warm_key).is_file():
                writing.add(job.warm_key)
            running[launch(job, out, launcher)] = job
        time.sleep(0.2)
    return failed


def launch(job: Job, out: Path, launcher: Launcher) -> object:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    print(f"  {job.action:<7} {job.point.name}", flush=True)
    job.started = time.time()
    _write_lab(job, {"status": "running", "started": job.started})
    return launcher.start(command(job, out)[1:], job.run_dir / "train.log")


def finish(job: Job, returncode: int) -> int:
    ok = returncode == 0
    log = job.run_dir / "train.log"
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    _write_lab(job, {"status": "finished" if ok else "failed", "returncode": returncode, "started": job.started,
                     "ended": time.time(), "stopped_nonfinite": (not ok) and "NonFiniteError" in tail})
    print(f"  {'done' if ok else 'FAILED':<7} {job.point.name}"
          + ("" if ok else f" (exit {returncode}; see {log})"), flush=True)
    return 0 if ok else 1


def _write_lab(job: Job, extra: dict) -> None:
    record = {"labels": job.point.labels, "overrides": job.point.overrides, **extra}
    (job.run_dir / "lab.json").write_text(json.dumps(record, indent=2))
