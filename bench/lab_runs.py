"""Lab runs per hour: the headline staleness setting, two `vespo train` processes at a time, two code versions.

    git worktree add /tmp/vespo-base 9bf1fba          # the code to compare against (once)
    python bench/lab_runs.py --base-src /tmp/vespo-base/src [--rounds 2]

The setting is the paper's staleness protocol at N = 32 (configs/lab/staleness.yaml's grid point
N = 32 with its mini-batch fixed): the xs Qwen3 reverses 16 letters, warm-started to ~0.3 sampled
accuracy; each rollout batch is N x (8 prompts x 8 responses) = 2048 responses, split into N
mini-batches of 64, one optimizer step each, 512 optimizer steps in all (16 rollout steps); VESPO
loss; held-out evaluation (128 problems, sampled and greedy) before and after, as a sweep run does.
Each run is a `vespo train` process with one torch thread, two run side by side (seeds 0 and 1),
as `vespo sweep --jobs 2` runs them on two cores. The CPU seconds each run used are reported too:
other work on the machine slows the wall clock but barely the CPU time of a one-thread process.

The warm starts are computed first, untimed, into a cache both versions read (a sweep also
warm-starts once per seed). A round times two runs of one version, then two of the other (the
order alternates between rounds, so a slower phase of a busy machine hits both); runs per hour
= 2 x 3600 / the wall time of the pair. Prints each round with the load average, then the median
of the rounds and the ratio "this checkout / base".

Extra ``section.field=value`` arguments go to both versions (e.g. run.updates=128 for a quick
look); ``--this-args`` go to this checkout only (e.g. run.compile=false).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "src"
SETTING = [
    "model.arch=qwen3", "model.size=xs", "task.name=reverse", "task.options={length: 16}", "task.eval_size=128",
    "rollout.group_size=8", "rollout.temperature=1.0", "rollout.top_k=0",
    "staleness.n=32", "staleness.minibatch_prompts=8", "staleness.behavior=recompute",
    "loss.name=vespo", "optim.lr=1.0e-4", "optim.grad_clip=1.0", "run.updates=512",
    "warmstart.steps=300", "warmstart.target_accuracy=0.3", "warmstart.check_every=5", "warmstart.lr=1.0e-3",
    "warmstart.batch_size=128", "run.checkpoint_every=10", "run.loggers=[jsonl]", "run.progress=false",
    "run.threads=1",
]
SEEDS = (0, 1)


def command(src: Path, out: Path, seed: int, extra: list[str]) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "vespo.cli", "train", *SETTING, f"run.seed={seed}", f"run.out_dir={out}", *extra]
    return cmd, env


def warm_starts(src: Path, work: Path, extra: list[str]) -> None:
    """Compute (or find) the warm start of every seed, in parallel, untimed."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); from steps import build_only; "
            "from vespo.config import load_config; build_only(load_config(None, sys.argv[1:]))")
    procs = []
    for seed in SEEDS:
        _, env = command(src, work, seed, extra)
        args = [*SETTING, f"run.seed={seed}", *extra]
        procs.append(subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.DEVNULL))
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError("warm start failed")


def pair_times(src: Path, work: Path, extra: list[str]) -> tuple[float, float]:
    """Wall time of two runs (one per seed) started together, and their CPU seconds per run."""
    shutil.rmtree(work, ignore_errors=True)
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    procs = []
    for seed in SEEDS:
        cmd, env = command(src, work / f"seed{seed}", seed, extra)
        (work / f"seed{seed}").mkdir(parents=True)
        log = open(work / f"seed{seed}" / "train.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for p, log in procs:
        if p.wait() != 0:
            raise RuntimeError(f"run failed; see {log.name}")
        log.close()
    return time.perf_counter() - t0, (_children_cpu() - cpu0) / len(SEEDS)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-src", required=True, help="src/ folder of the version to compare against")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="/tmp/vespo-lab-bench", help="scratch folder (runs, warm-start cache)")
    ap.add_argument("--this-args", nargs="*", default=[], help="overrides for this checkout only")
    ap.add_argument("overrides", nargs="*", help="section.field=value overrides for both versions")
    args = ap.parse_args()
    work = Path(args.work)
    shared = [f"warmstart.cache_dir={work / 'warmstart'}", *args.overrides]
    versions = {"this": (HERE, shared + args.this_args), "base": (Path(args.base_src).resolve(), shared)}
    print(f"load average {load_average()}; warm starts ...", flush=True)
    warm_starts(HERE, work / "warm", shared)
    walls: dict[str, list[float]] = {"this": [], "base": []}
    cpus: dict[str, list[float]] = {"this": [], "base": []}
    for r in range(args.rounds):
        for name in (("base", "this") if r % 2 == 0 else ("this", "base")):
            src, extra = versions[name]
            wall, cpu = pair_times(src, work / name, extra)
            walls[name].append(wall)
            cpus[name].append(cpu)
            print(f"round {r + 1} {name:<5} 2 runs in {wall:6.1f} s = {2 * 3600 / wall:6.1f} runs/hour; "
                  f"{cpu:6.1f} CPU-s per run (load {load_average()})", flush=True)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    print(f"\nmedian of {args.rounds} rounds: base {2 * 3600 / wall['base']:.1f} runs/hour, "
          f"this {2 * 3600 / wall['this']:.1f} runs/hour, ratio this / base = {wall['base'] / wall['this']:.2f}")
    print(f"CPU seconds per run: base {cpu['base']:.1f}, this {cpu['this']:.1f}, ratio base / this = "
          f"{cpu['base'] / cpu['this']:.2f} (what the wall-clock ratio tends to on an idle two-core machine)")


if __name__ == "__main__":
    main()
