"""Planning a sweep: what each grid point needs (start, resume, skip, kept as failed), the protocol
it runs (N, mini-batch, rollout batch, steps), the sweep directory's record (sweep.json, base.yaml),
and the write-back of an earlier session's archived runs (`--from-archive`).

A sweep directory refuses a changed base config or a run whose overrides changed, so results of
different settings are never mixed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from vespo.lab.grid import GridPoint, Sweep, SweepError
from vespo.lab.provenance import merge_sessions
from vespo.lab.runs import read_archive_body, write_run


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
    def updates(self) -> int:
        return self.rollout_steps * self.n


@dataclass
class Job:
    point: GridPoint
    run_dir: Path
    action: str  # "skip" (done), "failed" (kept), "resume", "start"
    warm_key: str = ""  # warm-start cache file this run reads or writes
    protocol: Protocol | None = None
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
        wanted = set(values.split(","))
        if wanted - set(axes[label]):
            raise SweepError(f"--only {item!r}: {sorted(wanted - set(axes[label]))} not in grid axis {label} {axes[label]}")
        only[label] = wanted
    return only


def plan(sweep: Sweep, out: Path, retry_failed: bool = False, only: dict[str, set[str]] | None = None) -> list[Job]:
    """Write the sweep's record into ``out`` and decide what each grid point needs."""
    write_record(sweep, out)
    jobs = []
    for point in sweep.points():
        if any(point.labels[a] not in v for a, v in (only or {}).items()):
            continue
        cfg = _config(sweep, out, point)
        jobs.append(Job(point, out / point.name, _action(out / point.name, retry_failed), _warm_key(cfg),
                        Protocol(cfg.staleness.n, cfg.prompts_per_minibatch, cfg.rollout.group_size,
                                 cfg.prompts_per_step, cfg.steps, cfg.run.mode)))
    return jobs


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


def restore(archive: Path, sweep: Sweep, out: Path) -> int:
    """Write back into ``out`` the finished runs of ``sweep`` that its archive holds and ``out`` lacks
    (vespo.lab.runs.write_run) and the archive's sessions, so that planning skips them. Refuses an
    archive of another sweep, a run that is not a point of the grid, or one made with other overrides
    or another resolved config than the grid gives it now. Returns the number of runs written back."""
    from vespo.config import to_dict

    body = read_archive_body(archive)
    if body["record"].get("name") != sweep.name:
        raise SweepError(f"{archive} is the archive of sweep {body['record'].get('name')!r}, not {sweep.name!r} "
                         f"({sweep.source})")
    write_record(sweep, out)
    points, restored = {p.name: p for p in sweep.points()}, 0
    for item in body["runs"]:
        name, lab = item["name"], item["lab"]
        if (item["summary"] or {}).get("status") != "done" and not lab.get("stopped_nonfinite"):
            continue  # not finished: run again
        point = points.get(name)
        if point is None:
            raise SweepError(f"{archive}: run {name} is not a point of the grid of {sweep.source}")
        if lab.get("overrides") != point.overrides:
            raise SweepError(f"{archive}: run {name} was made with overrides {lab.get('overrides')}, the grid of "
                             f"{sweep.source} gives it {point.overrides}")
        if (out / name / "lab.json").exists():
            continue  # this directory's own run (finished, or to resume) wins
        differs = _first_difference(json.loads(json.dumps(item["config"])),
                                    json.loads(json.dumps(to_dict(_config(sweep, out, point)))), skip={"run.out_dir"})
        if differs:
            raise SweepError(f"{archive}: run {name} ran with {differs[0]} = {differs[1]!r}, the grid of "
                             f"{sweep.source} now resolves it to {differs[2]!r}: not the same condition")
        write_run(item, out / name)
        restored += 1
    merge_sessions(out, body["record"].get("sessions") or [])
    return restored


def _first_difference(a: object, b: object, skip: set[str], at: str = "") -> tuple[str, object, object] | None:
    """(dotted key, a's value, b's value) of the first place two configs differ, else None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            where = f"{at}.{key}" if at else str(key)
            found = None if where in skip else _first_difference(a.get(key), b.get(key), skip, where)
            if found:
                return found
        return None
    return None if a == b else (at, a, b)


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
              + (f"; you asked for --jobs {n_jobs}" if n_jobs != c.jobs else "") + (f"; {c.note}" if c.note else "") + ")")
    rows = [PLAN_HEAD] + [_plan_row(job) for job in jobs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(PLAN_HEAD))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _plan_row(job: Job) -> tuple[str, ...]:
    p = job.protocol
    if p is None:
        return (job.action, job.point.name) + ("",) * 6
    mini = p.minibatch_prompts * p.group_size
    return (job.action, job.point.name, str(p.n), f"{p.minibatch_prompts} prompts x {p.group_size} = {mini}",
            f"{p.rollout_prompts} prompts = {p.rollout_prompts * p.group_size}",
            str(p.rollout_steps) + (" (async)" if p.mode == "async" else ""), str(p.updates), str(p.updates * mini))
