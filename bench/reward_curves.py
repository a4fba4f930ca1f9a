"""Same learning, faster: training-reward curves of several code versions or switches, a few seeds each.

    python bench/reward_curves.py --base-src /tmp/vespo-base/src          # base vs eager vs compiled, 3 seeds
    python bench/reward_curves.py --variants eager,compiled --seeds 0,1,2 run.steps=60

The faster paths change log-probs only by float rounding (shared prompts, dropped finished rows,
μ of the lag-0 mini-batch from its own forward, compiled layers), but rounding moves a sampled
token now and then and the runs drift apart like different seeds. So the check is statistical:
every variant runs the same short training (configs/demo.yaml: xs Qwen3 on 2-digit addition,
VESPO, N = 8, warm start) on the same seeds, and the script prints each run's training reward
averaged over the first and the last fifth of its steps, then per variant the mean and the
spread over seeds. The variants agree when their means differ by about the seed-to-seed spread
or less. Runs go two at a time, one torch thread each.

Variants: ``base`` (the code in --base-src), ``eager`` (this checkout), ``compiled`` (this
checkout with run.compile=true).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run_command(src: Path, out: Path, seed: int, extra: list[str]) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "vespo.cli", "train", "--config", str(HERE / "configs/demo.yaml"),
           f"run.seed={seed}", f"run.out_dir={out}", "run.threads=1", "run.progress=false",
           "run.loggers=[jsonl]", "run.checkpoint_every=0", *extra]
    return cmd, env


def rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["reward/mean"] for r in rows]


def fifths(curve: list[float]) -> tuple[float, float]:
    k = max(1, len(curve) // 5)
    return statistics.fmean(curve[:k]), statistics.fmean(curve[-k:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-src", help="src/ folder of the version to compare against (variant 'base')")
    ap.add_argument("--variants", default="base,eager,compiled")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--work", default="/tmp/vespo-reward-curves")
    ap.add_argument("overrides", nargs="*", help="section.field=value overrides for every run (e.g. run.steps=60)")
    args = ap.parse_args()
    variants = {"base": (Path(args.base_src or "."), []), "eager": (HERE / "src", ["run.compile=false"]),
                "compiled": (HERE / "src", ["run.compile=true"])}
    chosen = args.variants.split(",")
    if "base" in chosen and not args.base_src:
        ap.error("variant 'base' needs --base-src")
    work, seeds = Path(args.work), [int(s) for s in args.seeds.split(",")]
    shared = [f"warmstart.cache_dir={work / 'warmstart'}", *args.overrides]
    jobs = [(v, s) for s in seeds for v in chosen]
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in chosen}
    work.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(jobs), 2):  # two runs at a time
        procs = []
        for variant, seed in jobs[i : i + 2]:
            src, extra = variants[variant]
            out = work / f"{variant}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            cmd, env = run_command(src, out, seed, shared + extra)
            log = open(work / f"{variant}-seed{seed}.log", "w")
            procs.append((variant, seed, out, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
        for variant, seed, out, proc in procs:
            if proc.wait() != 0:
                raise RuntimeError(f"{variant} seed {seed} failed; see {work / f'{variant}-seed{seed}.log'}")
            first, last = fifths(rewards(out))
            results[variant].append((first, last))
            print(f"{variant:<9} seed {seed}: training reward {first:.3f} (first fifth) -> {last:.3f} (last fifth)",
                  flush=True)
    print(f"\n{'variant':<9}{'last-fifth reward: mean':>26}{'sd over seeds':>15}{'gain over first fifth':>23}")
    for variant, rows in results.items():
        last = [b for _, b in rows]
        gain = [b - a for a, b in rows]
        sd = statistics.stdev(last) if len(last) > 1 else float("nan")
        print(f"{variant:<9}{statistics.fmean(last):26.3f}{sd:15.3f}{statistics.fmean(gain):23.3f}")


if __name__ == "__main__":
    main()
