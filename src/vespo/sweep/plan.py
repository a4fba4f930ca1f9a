"""Planning a sweep: its grid points and what each needs (start, resume, skip), the sweep's record, archive restore."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from vespo.config import ConfigError, added_at_default, load_config, to_dict
from vespo.errors import INTERRUPTED
from vespo.lab.grid import GridPoint, Sweep, SweepError, off_grid
from vespo.sweep.provenance import write_sessions
from vespo.lab.runs import read_archive_body, start_text, write_run
from vespo.rundir import LAB, Stop, read_json, read_summary, started, stopped_nonfinite


@dataclass
class Job:
    point: GridPoint
    run_dir: Path
    action: str  # "skip" (done), "failed" (kept), "resume", "start"
    warm_key: str = ""  # warm-start cache file this run reads or writes
    protocol: dict | None = None  # the paper's terms: N, mini-batch, rollout batch, steps, samples


def run_overrides(point: GridPoint, run_dir: Path) -> list[str]:
    """A grid point's overrides, then where it writes, one torch thread and no progress bar."""
    return point.overrides + [f"run.out_dir={run_dir}", "run.threads=1", "run.progress=false"]


def parse_only(items: list[str], sweep: Sweep) -> dict[str, set[str]]:
    """``["N=1,32", "seed=0"]`` -> {"N": {"1", "32"}, "seed": {"0"}}, checked against the grid."""
    axes, only = sweep.values, {}
    for item in items:
        label, _, values = item.partition("=")
        if bad := off_grid(axes, {label: values.split(",")}):
            raise SweepError(f"--only {item!r}: {bad}")
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
        summary, lab = read_summary(run_dir), read_json(run_dir / LAB)
        action = ("skip" if summary.get("status") == Stop.DONE else
                  "failed" if lab.get("returncode", 0) not in (0, INTERRUPTED) and not retry_failed else
                  "resume" if started(run_dir) else "start")  # (no checkpoint yet: the launcher starts it over)
        jobs.append(Job(point, run_dir, action, _warm_key(cfg), protocol))
    return jobs


def start_warnings(jobs: list[Job], keys: set[str] | None = None) -> list[str]:
    """Where the pending runs of a shared on-policy start (of ``keys``, default all) would train from another start
    than the one this directory's finished runs of it recorded: a start's cache is per machine, and one remade on
    another machine can differ (docs/lab.md, "Shared starts"), and `vespo report` pairs two runs of a seed only where
    their recorded starts agree. One line per start: the cache's start differs from the recorded one, or it is not
    in the cache and the first pending run makes it again."""
    from vespo.trainer.warmstart import START_RECORD, start_stats

    lines = []
    for key in dict.fromkeys(j.warm_key for j in jobs if j.warm_key.endswith(START_RECORD)):
        if keys is not None and key not in keys:
            continue
        pending = [j.point.name for j in jobs if j.warm_key == key and j.action == "start"]
        done = {j.point.name: start_text(read_summary(j.run_dir).get("warmstart") or {})
                for j in jobs if j.warm_key == key and j.action == "skip"}
        recorded = sorted({text for text in done.values() if text})
        if not pending or not recorded:
            continue
        finished = f"this directory's finished runs of it ({', '.join(n for n, t in done.items() if t)}) trained " \
                   f"from {' and from '.join(recorded)}"
        if not Path(key).is_file():
            lines.append(f"the shared start of {', '.join(pending)} is not in the cache ({key}): the first of them "
                         f"makes it again; {finished}. A start remade on another machine can differ, and `vespo "
                         "report` pairs two runs of a seed only where their starts agree")
            continue
        cached = start_text(start_stats(_read_start(key)))
        if len(recorded) > 1 or cached != recorded[0]:
            lines.append(f"{', '.join(pending)} would train from the cached shared start ({cached}), but {finished}: "
                         "`vespo report` will not pair them; finish a seed's runs on one start (docs/lab.md, "
                         "\"Shared starts\")")
    return lines


def _read_start(key: str) -> dict:
    try:
        return json.loads(Path(key).read_text())
    except (OSError, ValueError) as e:
        raise SweepError(f"{key}: the shared start's record cannot be read ({e})") from None


def _warm_key(cfg) -> str:
    """The file whose presence says the run's warm start is ready ("" where it has none): the runs that share it
    start one at a time until it is there, so it is made once."""
    from vespo.trainer.warmstart import applies, warmstart_cache_path  # the trainer's own rule and cache naming

    return str(warmstart_cache_path(cfg)) if applies(cfg) else ""


def _config(sweep: Sweep, out: Path, point: GridPoint):
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
        lab = out / point.name / LAB
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
        # at the jobs asked for, with the file's seconds per run (measured at its own count side by side)
        asked = (f"; at your --jobs {n_jobs}, {pending * c.run_s / min(n_jobs, pending) / 60:.0f} min"
                 if n_jobs != c.jobs else "")
        print(f"expected wall time for the {pending} pending runs: {c.wall_s(pending) / 60:.0f} min (the sweep file "
              f"assumes {c.run_s:g} s per run with {c.jobs} at a time{asked}" + (f"; {c.note}" if c.note else "") + ")")
    table = pd.DataFrame([{"action": j.action, "run": j.point.name, **(j.protocol or {})} for j in jobs])
    print("\n".join("  " + line.rstrip() for line in table.to_string(index=False, justify="left").splitlines()))
    for line in start_warnings(jobs):
        print(f"warning: {line}")


def restore(archive: Path, sweep: Sweep, out: Path) -> int:
    """Write back into ``out`` the finished runs of ``sweep`` that its archive holds and ``out`` lacks (and the
    archive's sessions), so that planning skips them. Refuses an archive of another sweep, a run that is not a
    point of the grid, or one made with other overrides or another resolved config than the grid gives it now."""
    body = read_archive_body(archive)
    if body["record"].get("name") != sweep.name:
        raise SweepError(f"{archive} is the archive of sweep {body['record'].get('name')!r}, not {sweep.name!r} "
                         f"({sweep.source})")
    write_record(sweep, out)
    points, restored = {p.name: p for p in sweep.points()}, 0
    for item in body["runs"]:
        name, lab, point = item["name"], item["lab"], points.get(item["name"])
        if (item["summary"] or {}).get("status") != Stop.DONE and not stopped_nonfinite(item["summary"] or {}, lab):
            continue  # not finished: run again
        if point is None or lab.get("overrides") != point.overrides:
            raise SweepError(f"{archive}: run {name} is not a point of the grid of {sweep.source}" if point is None else
                             f"{archive}: run {name} was made with overrides {lab.get('overrides')}, the grid of "
                             f"{sweep.source} gives it {point.overrides}")
        if (out / name / LAB).exists():
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
    write_sessions(out, body["record"].get("sessions") or [], replace=False)  # add the sessions it lacks
    return restored
