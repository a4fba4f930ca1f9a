"""`vespo sweep`: run every point of a sweep file's grid as its own `vespo train` process.

    vespo sweep configs/lab/staleness.yaml --out runs/staleness --jobs 2
    vespo sweep configs/lab/staleness.yaml --out runs/staleness --dry-run     the plan, nothing run
    vespo sweep configs/lab/staleness.yaml --out runs/staleness --only N=1,32 --only seed=0    part of the grid
    vespo sweep configs/lab/quick.yaml --out runs/quick run.steps=5           extra overrides for every run
    vespo sweep configs/lab/staleness.yaml --out /shared/runs/staleness --ray-address auto --jobs 64
                                               the runs as Ray tasks across a cluster's nodes

SWEEP_DIR holds `sweep.json` (the grid), `base.yaml` (the base config), `sessions.jsonl` (one line
per call that ran something: start, end, command, git commit, machine) and one normal run
directory per grid point (config.yaml, metrics.jsonl, summary.json, checkpoints/, train.log and
lab.json with the point's labels and exit status). The plan shows per run the protocol: N, the
mini-batch (prompts x responses per prompt), the rollout batch (N x mini-batch), rollout steps,
optimizer steps and samples; with the sweep file's `cost`, the expected wall time. Processes run
`jobs` at a time with one torch thread each. Re-running the same command resumes the sweep:
finished runs (summary.json with status done) are skipped, runs with a checkpoint are resumed with
--resume (a run killed before its first checkpoint starts over), failed runs are kept as failed
unless --retry-failed. A sweep directory refuses a changed base config or a run whose overrides
changed; --only runs part of the grid, and a later call can add the rest. Runs that share a warm
start wait for the first of them to write it.

On a Ray cluster (``--ray-address auto``, or ``local`` for a Ray started here on loopback) each run
is a Ray task that starts the same `vespo train` process on whichever node has the resources it
asks for (``--run-cpus``, ``--run-gpus``), at most ``--jobs`` at a time; SWEEP_DIR (and the warm-start
cache) must then be on a file system every node sees. Planning, resuming and the records are the
same as for a local sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from vespo.lab.grid import GridPoint, Sweep, SweepError, load_sweep
from vespo.lab.results import read_archive_body, write_run
from vespo.metrics import read_jsonl


@dataclass(frozen=True)
class Protocol:
    """What one run does, in the paper's terms (from its resolved config)."""

    n: int  # mini-batches (optimizer steps) per rollout batch
    minibatch_prompts: int
    group_size: int  # responses per prompt
    rollout_prompts: int  # prompts per rollout batch = n x minibatch_prompts
    rollout_steps: int
    mode: str  # sync | async

    @property
    def minibatch_responses(self) -> int:
        return self.minibatch_prompts * self.group_size

    @property
    def updates(self) -> int:
        return self.rollout_steps * self.n

    @property
    def samples(self) -> int:
        return self.updates * self.minibatch_responses


@dataclass
class Job:
    point: GridPoint
    run_dir: Path
    action: str  # "skip" (done), "failed" (kept), "resume", "start"
    warm_key: str = ""  # warm-start cache file this run reads or writes
    protocol: Protocol | None = None
    started: float | None = None  # when its process was launched (time.time)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    try:
        sweep = load_sweep(args.sweep)
        sweep.overrides += args.overrides
        if args.from_archive:
            n = restore(Path(args.from_archive), sweep, Path(args.out))
            print(f"vespo sweep: {n} finished runs written back from {args.from_archive}")
        jobs = plan(sweep, Path(args.out), args.retry_failed, parse_only(args.only, sweep))
    except (SweepError, ValueError) as e:
        print(f"vespo sweep: {e}", file=sys.stderr)
        return 2
    print_plan(sweep, jobs, args.jobs)
    if args.dry_run:
        for job in jobs:
            if job.action in ("start", "resume"):
                print(" ".join(command(job, Path(args.out))))
        return 0
    with session(Path(args.out), "vespo sweep " + shlex.join(argv), args.jobs) as record, \
            launcher_for(args) as launcher:
        failed = run_all(jobs, Path(args.out), args.jobs, launcher)
        record.update(runs=sum(j.action in ("start", "resume") for j in jobs), failed=failed)
    print(f"vespo sweep: {len(jobs)} runs, {failed} failed; `vespo report {args.out} --out DIR` for the table")
    return 1 if failed else 0


# ---------------------------------------------------------------- planning


def parse_only(items: list[str], sweep: Sweep) -> dict[str, set[str]]:
    """``["N=1,32", "seed=0"]`` -> {"N": {"1", "32"}, "seed": {"0"}}, checked against the grid."""
    axes = {a.label: a.values for a in sweep.axes}
    only: dict[str, set[str]] = {}
    for item in items:
        label, _, values = item.partition("=")
        if label not in axes or not values:
            raise SweepError(f"--only {item!r}: expected AXIS=V1,V2 with AXIS one of {sorted(axes)}")
        wanted = set(values.split(","))
        if wanted - set(axes[label]):
            raise SweepError(f"--only {item!r}: {sorted(wanted - set(axes[label]))} not in grid axis {label} "
                             f"{axes[label]}")
        only[label] = wanted
    return only


def plan(sweep: Sweep, out: Path, retry_failed: bool = False, only: dict[str, set[str]] | None = None) -> list[Job]:
    """Write the sweep's record into ``out`` and decide what each grid point needs."""
    from vespo.config import ConfigError, load_config

    write_record(sweep, out)
    jobs = []
    for point in sweep.points():
        if any(point.labels[a] not in v for a, v in (only or {}).items()):
            continue
        run_dir = out / point.name
        try:
            cfg = load_config(out / "base.yaml", point.overrides + [f"run.out_dir={run_dir}"])
        except ConfigError as e:
            raise SweepError(f"{sweep.source}: grid point {point.name}: {e}") from None
        jobs.append(Job(point, run_dir, _action(run_dir, retry_failed), _warm_key(cfg), protocol_of(cfg)))
    return jobs


def restore(archive: Path, sweep: Sweep, out: Path) -> int:
    """Write back into ``out`` the finished runs of ``sweep`` that its archive holds and ``out`` lacks, with
    the files the lab reads of them (lab.json, config.yaml, summary.json, eval_before.json, metrics.jsonl
    with the archived metrics) and the archive's sessions, so that planning skips them and the report
    reads them as it read the originals. Refuses an archive of another sweep, a run that is not a point
    of the grid, or one made with other overrides or another resolved config than the grid gives it now.
    A run that had not finished is left out (run again). Returns the number of runs written back."""
    from vespo.config import ConfigError, load_config, to_dict

    body = read_archive_body(archive)
    if body["record"].get("name") != sweep.name:
        raise SweepError(f"{archive} is the archive of sweep {body['record'].get('name')!r}, not {sweep.name!r} "
                         f"({sweep.source})")
    write_record(sweep, out)
    points = {p.name: p for p in sweep.points()}
    restored = 0
    for item in body["runs"]:
        name, lab = item["name"], item["lab"]
        if (item["summary"] or {}).get("status") != "done" and not lab.get("stopped_nonfinite"):
            continue
        point = points.get(name)
        if point is None:
            raise SweepError(f"{archive}: run {name} is not a point of the grid of {sweep.source}")
        if lab.get("overrides") != point.overrides:
            raise SweepError(f"{archive}: run {name} was made with overrides {lab.get('overrides')}, the grid of "
                             f"{sweep.source} gives it {point.overrides}")
        run_dir = out / name
        if (run_dir / "lab.json").exists():
            continue  # this directory's own run (finished, or to resume) wins
        try:
            cfg = load_config(out / "base.yaml", run_overrides(point, run_dir))
        except ConfigError as e:
            raise SweepError(f"{sweep.source}: grid point {name}: {e}") from None
        differs = _first_difference(_plain(item["config"]), _plain(to_dict(cfg)), skip={"run.out_dir"})
        if differs:
            raise SweepError(f"{archive}: run {name} ran with {differs[0]} = {differs[1]!r}, the grid of "
                             f"{sweep.source} now resolves it to {differs[2]!r}: not the same condition")
        write_run(item, run_dir)
        restored += 1
    _merge_sessions(out, body["record"].get("sessions") or [])
    return restored


def _plain(value: object) -> object:
    return json.loads(json.dumps(value))


def _first_difference(a: object, b: object, skip: set[str], at: str = "") -> tuple[str, object, object] | None:
    """(dotted key, a's value, b's value) of the first place two configs differ, else None. A field ``a`` lacks
    (written before the field existed) that ``b`` has at its default is no difference."""
    from vespo.config import added_at_default

    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            where = f"{at}.{key}" if at else str(key)
            if key not in a and added_at_default(where, b[key]):
                continue
            if where not in skip:
                found = _first_difference(a.get(key), b.get(key), skip, where)
                if found:
                    return found
        return None
    return None if a == b else (at, a, b)


def _merge_sessions(out: Path, sessions: list[dict]) -> None:
    """Add to SWEEP_DIR/sessions.jsonl the archived sessions it does not hold yet."""
    path = out / "sessions.jsonl"
    have = read_jsonl(path) if path.is_file() else []
    seen = {(s.get("start"), s.get("command")) for s in have}
    new = [s for s in sessions if (s.get("start"), s.get("command")) not in seen]
    if new:
        with open(path, "a") as f:
            f.writelines(json.dumps(s) + "\n" for s in new)


def protocol_of(cfg) -> Protocol:
    """The resolved config's staleness protocol (rollout batch and run length already derived)."""
    return Protocol(cfg.staleness.n, cfg.prompts_per_minibatch, cfg.rollout.group_size, cfg.prompts_per_step,
                    cfg.steps, cfg.run.mode)


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
    record = {"name": sweep.name, "source": sweep.source, "overrides": sweep.overrides,
              "axes": [{"label": a.label, "values": a.values, "overrides": a.overrides} for a in sweep.axes],
              "reference": sweep.reference, "exclude": sweep.exclude,
              **({"description": sweep.description} if sweep.description else {})}
    (out / "base.yaml").write_text(base)
    (out / "sweep.json").write_text(json.dumps(record, indent=2))


def _action(run_dir: Path, retry_failed: bool) -> str:
    summary, lab = run_dir / "summary.json", run_dir / "lab.json"
    if summary.exists() and json.loads(summary.read_text()).get("status") == "done":
        return "skip"
    if lab.exists() and json.loads(lab.read_text()).get("returncode", 0) != 0 and not retry_failed:
        return "failed"
    checkpoints = run_dir / "checkpoints"
    started = (run_dir / "metrics.jsonl").exists() or (checkpoints.is_dir() and any(checkpoints.iterdir()))
    return "resume" if started else "start"  # --resume starts over a run killed before its first checkpoint


def _warm_key(cfg) -> str:
    if not cfg.warmstart.enabled or cfg.warmstart.steps == 0 or cfg.model.path is not None or cfg.task.dataset:
        return ""  # no warm start (build_run's condition): nothing to wait for
    from vespo.trainer.warmstart import warmstart_cache_path  # the trainer's own cache naming

    return str(warmstart_cache_path(cfg))


PLAN_HEAD = ("action", "run", "N", "mini-batch", "rollout batch", "rollout steps", "optimizer steps", "samples")


def print_plan(sweep: Sweep, jobs: list[Job], n_jobs: int = 2) -> None:
    """The runs with their protocol, and the expected wall time when the sweep file states a cost."""
    counts = {a: sum(j.action == a for j in jobs) for a in ("start", "resume", "skip", "failed")}
    print(f"sweep {sweep.name}: {len(jobs)} runs ({', '.join(f'{v} {k}' for k, v in counts.items() if v)})")
    pending = counts["start"] + counts["resume"]
    if sweep.cost is not None and pending:
        c = sweep.cost
        print(f"expected wall time for the {pending} pending runs: {c.wall_s(pending) / 60:.0f} min "
              f"(the sweep file assumes {c.run_s:g} s per run with {c.jobs} at a time"
              + (f"; you asked for --jobs {n_jobs}" if n_jobs != c.jobs else "") + (f"; {c.note}" if c.note else "")
              + ")")
    rows = [PLAN_HEAD] + [_plan_row(job) for job in jobs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(PLAN_HEAD))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _plan_row(job: Job) -> tuple[str, ...]:
    p = job.protocol
    if p is None:
        return (job.action, job.point.name) + ("",) * 6
    return (job.action, job.point.name, str(p.n),
            f"{p.minibatch_prompts} prompts x {p.group_size} = {p.minibatch_responses}",
            f"{p.rollout_prompts} prompts = {p.rollout_prompts * p.group_size}",
            str(p.rollout_steps) + (" (async)" if p.mode == "async" else ""), str(p.updates), str(p.samples))


# ---------------------------------------------------------------- the sweep's own record


class session:
    """One line of SWEEP_DIR/sessions.jsonl per call that runs something: when it started and ended,
    the command, the git commit of the code and the machine. A sweep resumed over several calls has
    several lines; its wall time is their sum.

    The line is written when the call starts and rewritten every ``beat_s`` seconds, so a call that is
    killed outright (SIGKILL, a machine restart) still leaves its start, the last time it was seen
    alive and the seconds up to then, with ``end`` null: the page counts it as killed."""

    def __init__(self, out: Path, command_line: str, jobs: int, beat_s: float = 60.0):
        self.path = out / "sessions.jsonl"
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
        # this call's line is the file's last: keep what came before, replace the rest
        with open(self.path, "r+") as f:
            f.seek(self.offset)
            f.truncate()
            f.write(json.dumps(dict(self.record)) + "\n")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def source_commit() -> dict:
    """{"commit", "dirty", "source"}: the git commit of the vespo code being run (the repository
    holding the package, else the current directory); dirty if src/ or configs/ have changes."""
    import vespo

    for where in (Path(vespo.__file__).resolve().parent, Path.cwd()):
        root = _git(where, "rev-parse", "--show-toplevel")
        if root:
            status = _git(Path(root), "status", "--porcelain", "--", "src", "configs")
            return {"commit": _git(Path(root), "rev-parse", "HEAD"), "dirty": bool(status),
                    "source": str(Path(vespo.__file__).resolve().parent)}
    return {"commit": None, "dirty": None, "source": str(Path(vespo.__file__).resolve().parent)}


def _git(where: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=20,
                             check=False)
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


# ---------------------------------------------------------------- running


def command(job: Job, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "vespo.cli", "train", "--config", str(out / "base.yaml")]
    return cmd + (["--resume"] if job.action == "resume" else []) + run_overrides(job.point, job.run_dir)


def run_overrides(point: GridPoint, run_dir: Path) -> list[str]:
    """The overrides a grid point's `vespo train` gets: the grid's, then where it writes, one torch thread
    and no progress bar."""
    return point.overrides + [f"run.out_dir={run_dir}", "run.threads=1", "run.progress=false"]


def run_all(jobs: list[Job], out: Path, n_jobs: int, launcher: "Launcher | None" = None) -> int:
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
            job = next((j for j in pending if _may_start(j, writing)), None)
            if job is None:
                break
            pending.remove(job)
            if job.warm_key and not Path(job.warm_key).is_file():
                writing.add(job.warm_key)
            running[launch(job, out, launcher)] = job
        time.sleep(0.2)
    return failed


def _may_start(job: Job, writing: set[str]) -> bool:
    return not job.warm_key or job.warm_key not in writing


def launch(job: Job, out: Path, launcher: "Launcher") -> object:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    print(f"  {job.action:<7} {job.point.name}", flush=True)
    job.started = time.time()
    _write_lab(job, {"status": "running", "started": job.started})
    return launcher.start(command(job, out)[1:], job.run_dir / "train.log")


RUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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
    """A process on this machine."""

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
    """One run, as a process on the node this Ray task landed on (its own Python)."""
    with open(log, "a") as f:
        return subprocess.call([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})


def launcher_for(args: argparse.Namespace) -> Launcher:
    if args.ray_address:
        return RayLauncher(args.ray_address, args.run_cpus, args.run_gpus, args.jobs)
    return LocalLauncher()


def finish(job: Job, returncode: int) -> int:
    ok = returncode == 0
    _write_lab(job, {"status": "finished" if ok else "failed", "returncode": returncode, "started": job.started,
                     "ended": time.time(),
                     "stopped_nonfinite": (not ok) and "NonFiniteError" in _tail(job.run_dir / "train.log")})
    print(f"  {'done' if ok else 'FAILED':<7} {job.point.name}" + ("" if ok else f" (exit {returncode}; see "
                                                                         f"{job.run_dir / 'train.log'})"), flush=True)
    return 0 if ok else 1


def _write_lab(job: Job, extra: dict) -> None:
    record = {"labels": job.point.labels, "overrides": job.point.overrides, **extra}
    (job.run_dir / "lab.json").write_text(json.dumps(record, indent=2))


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""
