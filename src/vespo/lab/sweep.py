"""`vespo sweep`: run every point of a sweep file's grid as its own `vespo train` process.

    vespo sweep configs/lab/staleness.yaml --out runs/staleness --jobs 2
    vespo sweep configs/lab/staleness.yaml --out runs/staleness --dry-run     the plan, nothing run
    vespo sweep configs/lab/staleness.yaml --out runs/staleness --only N=1,32 --only seed=0    part of the grid
    vespo sweep configs/lab/quick.yaml --out runs/quick run.steps=5           extra overrides for every run
    vespo sweep configs/lab/staleness.yaml --out /shared/runs/staleness --ray-address auto --jobs 64

SWEEP_DIR holds sweep.json (the grid), base.yaml, sessions.jsonl (per call: command, commit, machine, start,
end) and a run directory per grid point (config.yaml, metrics.jsonl, summary.json, checkpoints/, train.log,
lab.json). The same command again resumes the sweep: finished runs skipped, others resumed from their
checkpoints, failed ones kept unless --retry-failed; another base config or changed overrides are refused.
Runs go `--jobs` at a time, one torch thread each, here or as Ray tasks on a cluster (SWEEP_DIR and the
warm-start cache on a file system every node sees); runs sharing a warm start wait for the first to write it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import yaml

from vespo.lab.grid import GridPoint, Sweep, SweepError, load_sweep
from vespo.lab.runs import SESSIONS, read_archive_body, read_sessions, write_run

RUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep file (YAML)")
    p.add_argument("--out", required=True, help="sweep directory (one run directory per grid point)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    p.add_argument("--only", action="append", default=[], metavar="AXIS=V1,V2",
                   help="run only the grid points with these values on an axis (repeatable), e.g. --only N=1,32")
    p.add_argument("--retry-failed", action="store_true", help="run again the points whose process failed")
    p.add_argument("--from-archive", default=None, metavar="RUNS_JSON_GZ",
                   help="first write back the finished runs of this sweep's archive (the runs.json.gz an "
                        "earlier session's `vespo report` wrote) that SWEEP_DIR lacks, so they are skipped")
    p.add_argument("--ray-address", default=None, help="run the runs as Ray tasks: a cluster's address (auto, "
                   "HOST:PORT) or local (a Ray on this machine)")
    p.add_argument("--run-cpus", type=float, default=1.0, help="CPUs each run asks Ray for (with --ray-address)")
    p.add_argument("--run-gpus", type=float, default=0.0, help="GPUs each run asks Ray for (with --ray-address)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides applied to every run (after the grid)")
    args = p.parse_intermixed_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    out = Path(args.out)
    try:
        sweep = load_sweep(args.sweep)
        sweep.overrides += args.overrides
        if args.from_archive:
            print(f"vespo sweep: {restore(Path(args.from_archive), sweep, out)} finished runs written back from "
                  f"{args.from_archive}")
        jobs = plan(sweep, out, args.retry_failed, parse_only(args.only, sweep))
    except (SweepError, ValueError) as e:
        print(f"vespo sweep: {e}", file=sys.stderr)
        return 2
    print_plan(sweep, jobs, args.jobs)
    if args.dry_run:
        for job in (j for j in jobs if j.action in ("start", "resume")):
            print(" ".join(command(job, out)))
        return 0
    start = RayStarter(args.ray_address, args.run_cpus, args.run_gpus, args.jobs) if args.ray_address else start_local
    with session(out, "vespo sweep " + shlex.join(argv), args.jobs) as record:
        try:
            failed = run_all(jobs, out, args.jobs, start)
        finally:
            getattr(start, "close", lambda: None)()
        record.update(runs=sum(j.action in ("start", "resume") for j in jobs), failed=failed)
    print(f"vespo sweep: {len(jobs)} runs, {failed} failed; `vespo report {args.out} --out DIR` for the table")
    return 1 if failed else 0


# ---------------------------------------------------------------- the plan


@dataclass
class Job:
    point: GridPoint
    run_dir: Path
    action: str  # "skip" (done), "failed" (kept), "resume", "start"
    warm_key: str = ""  # warm-start cache file this run reads or writes
    protocol: dict | None = None  # the paper's terms: N, mini-batch, rollout batch, steps, samples
    started: float | None = None  # when its process was launched (time.time)


def run_overrides(point: GridPoint, run_dir: Path) -> list[str]:
    """A grid point's overrides, then where it writes, one torch thread and no progress bar."""
    return point.overrides + [f"run.out_dir={run_dir}", "run.threads=1", "run.progress=false"]


def parse_only(items: list[str], sweep: Sweep) -> dict[str, set[str]]:
    """``["N=1,32", "seed=0"]`` -> {"N": {"1", "32"}, "seed": {"0"}}, checked against the grid."""
    axes, only = sweep.values, {}
    for item in items:
        label, _, values = item.partition("=")
        if label not in axes or not values:
            raise SweepError(f"--only {item!r}: expected AXIS=V1,V2 with AXIS one of {sorted(axes)}")
        if bad := set(values.split(",")) - set(axes[label]):
            raise SweepError(f"--only {item!r}: {sorted(bad)} not in grid axis {label} {axes[label]}")
        only[label] = set(values.split(","))
    return only


def plan(sweep: Sweep, out: Path, retry_failed: bool = False, only: dict[str, set[str]] | None = None) -> list[Job]:
    """Write the sweep's record into ``out`` and decide what each grid point needs."""
    write_record(sweep, out)
    jobs = []
    for point in (p for p in sweep.points() if all(p.labels[a] in v for a, v in (only or {}).items())):
        cfg, run_dir = _config(sweep, out, point), out / point.name
        mini, group = cfg.prompts_per_minibatch * cfg.rollout.group_size, cfg.rollout.group_size
        protocol = {"N": cfg.staleness.n, "mini-batch": f"{cfg.prompts_per_minibatch} prompts x {group} = {mini}",
                    "rollout batch": f"{cfg.prompts_per_step} prompts = {cfg.prompts_per_step * group}",
                    "rollout steps": f"{cfg.steps}" + (" (async)" if cfg.run.mode == "async" else ""),
                    "optimizer steps": cfg.steps * cfg.staleness.n, "samples": cfg.steps * cfg.staleness.n * mini}
        summary, lab = (json.loads(f.read_text()) if f.exists() else {} for f in (run_dir / "summary.json",
                                                                                   run_dir / "lab.json"))
        started = (run_dir / "metrics.jsonl").exists() or any((run_dir / "checkpoints").glob("*"))
        action = ("skip" if summary.get("status") == "done" else
                  "failed" if lab.get("returncode", 0) != 0 and not retry_failed else
                  "resume" if started else "start")  # --resume starts over a run killed before its first checkpoint
        jobs.append(Job(point, run_dir, action, _warm_key(cfg), protocol))
    return jobs


def _warm_key(cfg) -> str:
    if not cfg.warmstart.enabled or cfg.warmstart.steps == 0 or cfg.model.path is not None or cfg.task.dataset:
        return ""  # no warm start (build_run's condition): nothing to wait for
    from vespo.trainer.warmstart import warmstart_cache_path  # the trainer's own cache naming

    return str(warmstart_cache_path(cfg))


def _config(sweep: Sweep, out: Path, point: GridPoint):
    from vespo.config import ConfigError, load_config

    try:
        return load_config(out / "base.yaml", run_overrides(point, out / point.name))
    except ConfigError as e:
        raise SweepError(f"{sweep.source}: grid point {point.name}: {e}") from None


def write_record(sweep: Sweep, out: Path) -> None:
    """sweep.json and base.yaml; refuse to mix another base config or other overrides into a sweep."""
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_dump(sweep.base, sort_keys=False)
    if (out / "base.yaml").exists() and (out / "base.yaml").read_text() != base:
        raise SweepError(f"{out / 'base.yaml'} differs from the base of {sweep.source}: this sweep directory was "
                         "started with another base config; choose another --out")
    for point in sweep.points():
        lab = out / point.name / "lab.json"
        if lab.exists() and json.loads(lab.read_text()).get("overrides") != point.overrides:
            raise SweepError(f"{lab}: run {point.name} was made with other overrides than {sweep.source} gives it "
                             "now; choose another --out")
    (out / "base.yaml").write_text(base)
    (out / "sweep.json").write_text(json.dumps(sweep.record(), indent=2))


def print_plan(sweep: Sweep, jobs: list[Job], n_jobs: int = 2) -> None:
    """The runs with their protocol, and the expected wall time when the sweep file states a cost."""
    counts = {a: sum(j.action == a for j in jobs) for a in ("start", "resume", "skip", "failed")}
    print(f"sweep {sweep.name}: {len(jobs)} runs ({', '.join(f'{v} {k}' for k, v in counts.items() if v)})")
    pending, c = counts["start"] + counts["resume"], sweep.cost
    if c is not None and pending:
        asked = f"; you asked for --jobs {n_jobs}" if n_jobs != c.jobs else ""
        print(f"expected wall time for the {pending} pending runs: {c.wall_s(pending) / 60:.0f} min (the sweep file "
              f"assumes {c.run_s:g} s per run with {c.jobs} at a time{asked}" + (f"; {c.note}" if c.note else "") + ")")
    table = pd.DataFrame([{"action": j.action, "run": j.point.name, **(j.protocol or {})} for j in jobs])
    print("\n".join("  " + line.rstrip() for line in table.to_string(index=False, justify="left").splitlines()))


def restore(archive: Path, sweep: Sweep, out: Path) -> int:
    """Write back into ``out`` the finished runs of ``sweep`` that its archive holds and ``out`` lacks (and the
    archive's sessions), so that planning skips them. Refuses an archive of another sweep, a run that is not a
    point of the grid, or one made with other overrides or another resolved config than the grid gives it now."""
    from vespo.config import added_at_default, to_dict

    body = read_archive_body(archive)
    if body["record"].get("name") != sweep.name:
        raise SweepError(f"{archive} is the archive of sweep {body['record'].get('name')!r}, not {sweep.name!r} "
                         f"({sweep.source})")
    write_record(sweep, out)
    points, restored = {p.name: p for p in sweep.points()}, 0
    for item in body["runs"]:
        name, lab, point = item["name"], item["lab"], points.get(item["name"])
        if (item["summary"] or {}).get("status") != "done" and not lab.get("stopped_nonfinite"):
            continue  # not finished: run again
        if point is None or lab.get("overrides") != point.overrides:
            raise SweepError(f"{archive}: run {name} is not a point of the grid of {sweep.source}" if point is None else
                             f"{archive}: run {name} was made with overrides {lab.get('overrides')}, the grid of "
                             f"{sweep.source} gives it {point.overrides}")
        if (out / name / "lab.json").exists():
            continue  # this directory's own run (finished, or to resume) wins
        was, now = (pd.json_normalize(json.loads(json.dumps(c))).iloc[0].to_dict() for c in (
            item["config"], to_dict(_config(sweep, out, point))))
        differs = [k for k in {**was, **now} if k != "run.out_dir" and str(was.get(k)) != str(now.get(k))
                   and not (k not in was and added_at_default(k, now[k]))]  # a field newer than the run, at its default
        if differs:
            raise SweepError(f"{archive}: run {name} ran with {differs[0]} = {was.get(differs[0])!r}, the grid of "
                             f"{sweep.source} now resolves it to {now.get(differs[0])!r}: not the same condition")
        write_run(item, out / name)
        restored += 1
    seen = {(s.get("start"), s.get("command")) for s in read_sessions(out)}  # add the sessions it lacks
    with open(out / SESSIONS, "a") as f:
        f.writelines(json.dumps(s) + "\n" for s in body["record"].get("sessions") or []
                     if (s.get("start"), s.get("command")) not in seen)
    return restored


# ---------------------------------------------------------------- running the jobs


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


def run_all(jobs: list[Job], out: Path, n_jobs: int, start: Callable = start_local) -> int:
    """Run the pending jobs ``n_jobs`` at a time; returns how many failed."""
    pending = [j for j in jobs if j.action in ("start", "resume")]
    locks = {j.warm_key: threading.Lock() for j in pending if j.warm_key}

    def one(job: Job) -> int:
        lock = locks.get(job.warm_key)
        with lock or contextlib.nullcontext():  # the first of a warm start's runs holds it until the file is there
            job.run_dir.mkdir(parents=True, exist_ok=True)
            print(f"  {job.action:<7} {job.point.name}", flush=True)
            job.started = time.time()
            _write_lab(job, {"status": "running", "started": job.started})
            run = start(command(job, out)[1:], job.run_dir / "train.log")  # the node's own Python runs it
            while lock is not None and not Path(job.warm_key).is_file() and run.poll() is None:
                time.sleep(0.5)
        return finish(job, run.wait())

    with ThreadPoolExecutor(max(1, n_jobs)) as pool:
        return sum(pool.map(one, pending))


def finish(job: Job, returncode: int) -> int:
    ok, log = returncode == 0, job.run_dir / "train.log"
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    _write_lab(job, {"status": "finished" if ok else "failed", "returncode": returncode, "started": job.started,
                     "ended": time.time(), "stopped_nonfinite": (not ok) and "NonFiniteError" in tail})
    print(f"  {'done' if ok else 'FAILED':<7} {job.point.name}" + ("" if ok else f" (exit {returncode}; see {log})"),
          flush=True)
    return 0 if ok else 1


def _write_lab(job: Job, extra: dict) -> None:
    (job.run_dir / "lab.json").write_text(json.dumps({"labels": job.point.labels, "overrides": job.point.overrides,
                                                      **extra}, indent=2))


# ---------------------------------------------------------------- the session's record (sessions.jsonl)


@contextlib.contextmanager
def session(out: Path, command_line: str, jobs: int, beat_s: float = 60.0):
    """``with session(out, command, jobs) as record: ...``; the caller may add fields to ``record``. Its line of
    sessions.jsonl is rewritten every ``beat_s`` seconds; a call killed outright leaves ``end`` null."""
    path, t0, stop = out / SESSIONS, time.time(), threading.Event()
    record = {"command": command_line, "jobs": jobs, **source_commit(), "machine": machine(), "start": _iso(t0),
              "end": None, "seconds": 0.0, "interrupted": None}
    out.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        offset = f.tell()  # where this call's line starts: rewritten in place from here
        f.write(json.dumps(record) + "\n")

    def write() -> None:
        with open(path, "r+") as f:  # this call's line is the file's last: keep what came before
            f.seek(offset)
            f.truncate()
            f.write(json.dumps(dict(record)) + "\n")

    def beat() -> None:
        while not stop.wait(beat_s):
            record.update(last_seen=_iso(time.time()), seconds=round(time.time() - t0, 1))
            write()

    thread, interrupted = threading.Thread(target=beat, daemon=True), True
    thread.start()
    try:
        yield record
        interrupted = False
    finally:
        stop.set()
        thread.join()
        record.update(end=_iso(time.time()), seconds=round(time.time() - t0, 1), interrupted=interrupted)
        write()


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def source_commit() -> dict:
    """{"commit", "dirty", "source"}: the git commit of the vespo code being run (the repository holding the
    package, else the current directory); dirty if src/ or configs/ have changes."""
    import vespo

    source = Path(vespo.__file__).resolve().parent
    for root in (_git(where, "rev-parse", "--show-toplevel") for where in (source, Path.cwd())):
        if root:
            dirty = bool(_git(Path(root), "status", "--porcelain", "--", "src", "configs"))
            return {"commit": _git(Path(root), "rev-parse", "HEAD"), "dirty": dirty, "source": str(source)}
    return {"commit": None, "dirty": None, "source": str(source)}


def _git(where: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def machine() -> dict:
    from importlib.metadata import version  # torch is a dependency: installed where vespo is

    return {"node": platform.node(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": version("torch")}
