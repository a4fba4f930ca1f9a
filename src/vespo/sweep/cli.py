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
Ctrl-C, or SIGTERM to the sweep alone (`kill`, a scheduler; passed on to the runs it started here, not to Ray
tasks), stops it: no further run starts, the running ones finish their step, checkpoint and exit 130, the sweep
exits 130, and the same command resumes.
"""


import argparse
import contextlib
import shlex
import sys
from pathlib import Path

from vespo.lab.grid import SweepError, load_sweep
from vespo.errors import INTERRUPTED
from vespo.sweep.launch import RayStarter, Stopping, command, run_all, start_local
from vespo.sweep.plan import parse_only, plan, print_plan, restore
from vespo.sweep.provenance import session


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
    starter = (contextlib.closing(RayStarter(args.ray_address, args.run_cpus, args.run_gpus, args.jobs))
               if args.ray_address else contextlib.nullcontext(start_local))
    with starter as start, session(out, "vespo sweep " + shlex.join(argv), args.jobs) as record, \
            Stopping() as stopping:
        failed = run_all(jobs, out, args.jobs, start, stopping)
        record.update(runs=sum(j.action in ("start", "resume") for j in jobs), failed=failed)
        if stopping.event.is_set():
            record.update(stopped=stopping.signal)
    if stopping.event.is_set():
        print(f"vespo sweep: stopped ({stopping.signal}), {failed} failed; the same command resumes it",
              file=sys.stderr)
        return INTERRUPTED
    print(f"vespo sweep: {len(jobs)} runs, {failed} failed; `vespo report {args.out} --out DIR` for the table")
    return 1 if failed else 0
