"""`vespo plot`: the training curves of run directories on one figure (vespo.plot draws them; its
docstring says what each panel shows).

    vespo plot runs/vespo32 runs/grpo32 --out curves.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vespo import plot


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo plot", description=plot.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (each with a metrics.jsonl)")
    p.add_argument("--out", default="curves.png", help="PNG to write (default curves.png)")
    p.add_argument("--labels", nargs="+", help="one legend label per run (default: the directory names)")
    p.add_argument("--kl", choices=sorted(plot.KL_KEYS), default="stale",
                   help="stale: kl/k3 between the updated and the behavior policy; engine: mismatch/k3")
    p.add_argument("--title", default="", help="figure title")
    p.add_argument("--x", choices=["updates", "step"], default="updates",
                   help="x axis: optimizer steps (default; comparable across N) or logged rollout step")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        p.error(f"--labels has {len(args.labels)} labels for {len(args.runs)} runs")
    try:
        runs = [plot.load_run(r) for r in args.runs]
    except (FileNotFoundError, ValueError) as e:
        print(f"vespo plot: {e}", file=sys.stderr)
        return 2
    out = plot.plot_runs(runs, args.labels or [Path(r).name for r in args.runs], args.out, args.kl, args.title, args.x)
    print(f"wrote {out}")
    return 0
