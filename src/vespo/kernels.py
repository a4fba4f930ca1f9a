"""The kernel view: each loss's effective coefficient on grad log pi as a function of the sequence weight W.

Every policy loss here has a per-token gradient of the form  -c(W) * A * grad log pi. This module
measures c by autograd on the loss functions themselves (so the picture cannot drift from the code):
for each W on a grid, one sequence of T tokens with a uniform per-token ratio r = W^(1/T), advantage
A = +1 or -1, aggregated as a plain token sum, and c = -(dL/dlogp) / A. For VESPO c = phi(W); for
REINFORCE with token IS c = r; for GRPO c drops to 0 where the clip binds.

    vespo kernels --out DIR [--T 16] [--w-min 1e-3] [--w-max 1e3] [--points 241]

writes DIR/kernels.png (A > 0 and A < 0 side by side) and DIR/kernels.csv (loss, adv_sign, T, W, coef).
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import replace
from pathlib import Path

import torch

KERNEL_AGG = "seq-mean-token-sum"  # with normalizer 1 the loss is the plain sum over tokens


def kernel_curves(T: int = 16, w_min: float = 1e-3, w_max: float = 1e3, points: int = 241) -> dict:
    """{(loss, sign): (W [points], coef [points])} for every registered loss and both advantage signs."""
    from vespo.losses import get_loss, loss_names

    W = torch.logspace(math.log10(w_min), math.log10(w_max), points, dtype=torch.float64)  # [P]
    curves = {}
    for name in loss_names():
        spec = get_loss(name)
        cfg = replace(spec.config_cls(), agg=KERNEL_AGG)
        for sign in (1.0, -1.0):
            curves[(name, sign)] = (W, _coefficient(spec.fn, cfg, W, T, sign))
    return curves


def _coefficient(fn, cfg, W: torch.Tensor, T: int, sign: float) -> torch.Tensor:
    """c(W) = -(dL/dlogp) / A at a uniform token log-ratio log(W) / T, from the loss's own autograd."""
    old_logp = torch.full((len(W), T), -1.0, dtype=torch.float64)  # [P, T]
    logp = (old_logp + (W.log() / T)[:, None]).requires_grad_(True)  # [P, T], r = W^(1/T) on every token
    adv = torch.full((len(W),), sign, dtype=torch.float64)  # [P]
    mask = torch.ones(len(W), T, dtype=torch.bool)
    out = fn(logp, old_logp, adv, mask, cfg, normalizer=1.0)
    (grad,) = torch.autograd.grad(out.loss, logp)
    return -grad.mean(dim=-1) / sign  # [P], the same on every token


def write_csv(curves: dict, T: int, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["loss", "adv_sign", "T", "W", "coef"])
        for (name, sign), (W, coef) in curves.items():
            for w, c in zip(W.tolist(), coef.tolist()):
                writer.writerow([name, "+" if sign > 0 else "-", T, f"{w:.6g}", f"{c:.6g}"])


def plot(curves: dict, T: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    names = sorted({name for name, _ in curves})
    colors = dict(zip(names, plt.get_cmap("tab10").colors))
    dashes = dict(zip(names, ["-", (0, (5, 2)), "-", (0, (1, 1.5)), (0, (6, 2, 1, 2)), "-"]))  # overlaps stay visible
    for ax, sign in zip(axes, (1.0, -1.0)):
        for name in names:
            W, coef = curves[(name, sign)]
            style = {"linewidth": 2.6} if name == "vespo" else {"linewidth": 1.5, "alpha": 0.85}
            ax.plot(W.numpy(), coef.numpy(), label=name, color=colors[name], linestyle=dashes[name], **style)
        ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("sequence importance weight W = π/μ")
        ax.set_title(f"A {'> 0' if sign > 0 else '< 0'}")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("effective coefficient on ∇log π")
    axes[0].legend(loc="upper left", fontsize=9)
    fig.suptitle(f"How each loss weights a sample by its staleness (token-level losses at r = W^(1/{T}))")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vespo kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for kernels.png and kernels.csv")
    parser.add_argument("--T", type=int, default=16, help="tokens per sequence for token-level losses (>= 1)")
    parser.add_argument("--w-min", type=float, default=1e-3, help="smallest W on the grid (> 0)")
    parser.add_argument("--w-max", type=float, default=1e3, help="largest W on the grid (> w-min)")
    parser.add_argument("--points", type=int, default=241, help="grid points (>= 2)")
    args = parser.parse_args(argv)
    if args.T < 1 or args.points < 2 or not (0 < args.w_min < args.w_max):
        parser.error("need --T >= 1, --points >= 2 and 0 < --w-min < --w-max")
    curves = kernel_curves(args.T, args.w_min, args.w_max, args.points)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(curves, args.T, args.out / "kernels.csv")
    plot(curves, args.T, args.out / "kernels.png")
    print(f"wrote {args.out / 'kernels.png'} and {args.out / 'kernels.csv'}")
    return 0
