"""Wall time for the same number of learner updates, synchronous vs asynchronous (Ray), on CPU.

    OMP_NUM_THREADS=1 python bench/async_vs_sync.py [--steps 20] [--size xs] [--digits 2] [--out runs/bench_async]

Same config, same number of updates (steps x staleness.n) and samples in every mode:
  sync-1t   the synchronous trainer, torch on 1 thread
  sync-2t   the synchronous trainer, torch on 2 threads (both cores for one process)
  async     one rollout worker (Ray actor, 1 thread) + the learner in the driver (1 thread)
Times are the training loop (after warm start, the first evaluation and, for async, Ray start and
worker creation, which are reported apart), including the final evaluation in every mode.
The goal is async <= 0.7x sync; the lag it costs is reported from the run's versions.jsonl.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from vespo.config import load_config
from vespo.metrics import read_jsonl


def config(args, mode: str, threads: int, out: str):
    return load_config(None, [
        f"model.size={args.size}", "task.name=addition", f"task.options={{digits: {args.digits}}}",
        "task.train_size=5000", "task.eval_size=32", "rollout.prompts_per_step=16", "rollout.group_size=8",
        "staleness.n=2", "warmstart.steps=60", "warmstart.batch_size=64", "warmstart.lr=3e-3",
        f"warmstart.cache_dir={args.out}/warmstart", "optim.lr=3e-4", f"run.steps={args.steps}",
        "run.progress=false", "run.loggers=[jsonl]", f"run.threads={threads}", "run.checkpoint_every=0",
        f"run.mode={mode}", "async.workers=1", f"async.sync_every={args.sync_every}",
        f"async.max_staleness={args.max_staleness}", f"async.chunk_tokens={args.chunk_tokens}", f"run.out_dir={out}",
    ])


def run(args, name: str, mode: str, threads: int) -> dict:
    from vespo.trainer import train

    out = f"{args.out}/{name}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    summary = train(config(args, mode, threads, out))
    row = {"name": name, "loop_s": summary["seconds"], "total_s": time.perf_counter() - t0,
           "updates": summary["policy_version"], "reward_final": summary["train_reward_final"]}
    if mode == "async":
        records = read_jsonl(f"{out}/versions.jsonl")
        lags = [r["learner_version"] - v for r in records for v in r["versions"]]
        metrics = read_jsonl(f"{out}/metrics.jsonl")
        row.update({"lag_mean": sum(lags) / len(lags), "lag_max": max(lags),
                    "idle_frac": sum(m["perf/learner_idle_frac"] for m in metrics) / len(metrics)})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="rollout steps (x staleness.n = 2 updates each)")
    p.add_argument("--size", default="xs", choices=["nano", "xs", "s"])
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=4)
    p.add_argument("--out", default="runs/bench_async")
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()}, cores: {os.cpu_count()}")
    rows = [run(args, "sync-1t", "sync", 1), run(args, "sync-2t", "sync", 2), run(args, "async", "async", 1)]
    print(f"load average after: {os.getloadavg()}")
    best_sync = min(r["loop_s"] for r in rows[:2])
    for r in rows:
        extra = (f"  lag mean {r['lag_mean']:.2f} max {r['lag_max']}  learner idle {r['idle_frac']:.2f}"
                 if "lag_mean" in r else "")
        print(f"{r['name']:8s} loop {r['loop_s']:6.1f}s  total {r['total_s']:6.1f}s  updates {r['updates']}  "
              f"x{r['loop_s'] / best_sync:.2f} of the faster sync  final reward {r['reward_final']:.3f}{extra}")


if __name__ == "__main__":
    main()
