"""`vespo kernels`: each loss's effective coefficient on grad log pi against W, drawn and tabled
(vespo.coefficients measures it; its docstring says how).

    vespo kernels --out DIR [--T 16] [--w-min 1e-3] [--w-max 1e3] [--points 241] [--stale-sigma 2] [--stale-n 16]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from vespo import coefficients


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vespo kernels", description=coefficients.__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for kernels.png and kernels.csv")
    parser.add_argument("--T", type=int, default=16, help="tokens per sequence for token-level losses (>= 1)")
    parser.add_argument("--w-min", type=float, default=1e-3, help="smallest W on the grid (> 0)")
    parser.add_argument("--w-max", type=float, default=1e3, help="largest W on the grid (> w-min)")
    parser.add_argument("--points", type=int, default=241, help="grid points (>= 2)")
    parser.add_argument("--stale-sigma", type=float, default=2.0,
                        help="std of log W in the stale batch vespo_adaptive adapts to (> 0)")
    parser.add_argument("--stale-n", type=int, default=16, help="sequences per advantage sign in that batch (>= 2)")
    args = parser.parse_args(argv)
    if args.T < 1 or args.points < 2 or not (0 < args.w_min < args.w_max):
        parser.error("need --T >= 1, --points >= 2 and 0 < --w-min < --w-max")
    if not (args.stale_sigma > 0 and math.isfinite(args.stale_sigma)) or args.stale_n < 2:
        parser.error("need --stale-sigma > 0 and --stale-n >= 2")
    curves = coefficients.kernel_curves(args.T, args.w_min, args.w_max, args.points, args.stale_sigma, args.stale_n)
    args.out.mkdir(parents=True, exist_ok=True)
    coefficients.write_csv(curves, args.T, args.out / "kernels.csv")
    coefficients.plot(curves, args.T, args.out / "kernels.png", args.stale_sigma, args.stale_n)
    print(f"wrote {args.out / 'kernels.png'} and {args.out / 'kernels.csv'}")
    return 0
