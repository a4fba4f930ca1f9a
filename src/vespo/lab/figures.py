"""The lab's figures from a sweep's table of runs (matplotlib, Agg; docs/lab.md, `vespo report`): the headline
(final accuracy against N per loss, each loss minus the reference paired by seed, the training curves), the lr
figure (final reward and collapse rate against the learning rate) and one panel per value of an axis of a
metric's curves. Curves run against optimizer steps, in windows of max(N, run / 32) updates; a loss has one
colour and one name in every figure (vespo.plot.color_of, display_name).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from vespo.lab.grid import Sweep
from vespo.lab.runs import LR_AXIS, by_seed, conditions, lr_of, lr_points, lr_text, select
from vespo.lab.stats import LEVEL, mean_ci, paired, rate_ci
from vespo.plot import color_of, display_name

BINS = 32  # windows per run for the curves
LOSS_AXES = ("loss", "method")  # axes whose values are losses (or a loss with a fix): coloured by loss
CURVES = [("reward", "reward/mean", "training reward", False),
          ("kl", "kl/k3", "stale KL k3 (behavior vs updated)", True),
          ("grad_norm", "optim/grad_norm_max", "max grad norm per logged step", True)]


def value_colors(axis: str, values: list[str]) -> dict[str, str]:
    """Colours of an axis's values: a loss's own colour on a loss axis, else evenly along a colormap."""
    if axis in LOSS_AXES:
        return {v: color_of(v) for v in values}
    cmap = matplotlib.colormaps["viridis"]
    return {v: matplotlib.colors.to_hex(cmap(i / max(1, len(values) - 1) * 0.9)) for i, v in enumerate(values)}


def label_of(axis: str, value: str) -> str:
    return display_name(value) if axis in LOSS_AXES else f"{axis}={value}"


def layout(sweep: Sweep, panel: str | None, curve: str | None) -> tuple[str | None, list[str]]:
    """(panel axis or None, curve axes). Defaults: panels by loss, curves by N, other axes joined."""
    axes = sweep.conditions
    for name, given in (("--panel", panel), ("--curve", curve)):
        if given is not None and given not in axes:
            raise ValueError(f"{name} {given!r} is not a grid axis of this sweep; axes: {axes}")
    if len(axes) <= 1 and panel is None:
        return None, axes
    panel = panel or ("loss" if "loss" in axes and curve != "loss" else next(a for a in axes if a != curve))
    rest = [a for a in axes if a != panel]
    first = curve or ("N" if "N" in rest else None)
    return panel, ([first] if first else []) + [a for a in rest if a != first]


def write_figures(sweep: Sweep, runs: pd.DataFrame, out: Path, panel: str | None = None,
                  curve: str | None = None) -> list[Path]:
    panel, curves = layout(sweep, panel, curve)
    figures = [headline_figure(sweep, runs, out / "headline.png")] if {"loss", "N"} <= set(sweep.conditions) else []
    figures += [lr_figure(sweep, runs, out / "lr.png")] if LR_AXIS in sweep.conditions else []
    return figures + [curve_figure(sweep, runs, panel, curves, metric, ylabel, logy, out / f"{stem}.png")
                      for stem, metric, ylabel, logy in CURVES]


def binned_curve(run, metric: str) -> pd.Series:
    """A run's metric against optimizer steps, averaged in windows of max(N, updates / BINS) updates."""
    x, y = run.series(metric)
    frame = pd.DataFrame({"x": x, "y": y})[np.isfinite(y)]
    return frame.groupby(frame.x // max(run.n, run.updates / BINS)).mean().set_index("x").y


def draw_seed_mean(ax, runs: pd.DataFrame, metric: str, label: str, color: str) -> None:
    """The mean over seeds of the binned curves, and their min-max band."""
    curves = [c for c in (binned_curve(r, metric) for r in runs.record if r.rows) if len(c)]
    if curves:
        table = pd.concat(curves, axis=1).sort_index()  # [x, runs]
        ax.plot(table.index, table.mean(axis=1), label=label, linewidth=1.3, color=color)
        if len(curves) > 1:
            ax.fill_between(table.index, table.min(axis=1), table.max(axis=1), color=color, alpha=0.12)


def curve_figure(sweep: Sweep, runs: pd.DataFrame, panel: str | None, curves: list[str], metric: str, ylabel: str,
                 logy: bool, out: Path) -> Path:
    """One panel per value of ``panel``; in each, the seed-mean curve (and min-max band) per curve value."""
    panels = conditions(sweep, runs, [panel] if panel else [])
    cols, rows = min(4, len(panels)), math.ceil(len(panels) / min(4, len(panels)))
    fig = Figure(figsize=(3.8 * cols, 3.0 * rows), constrained_layout=True)
    axs = fig.subplots(rows, cols, squeeze=False, sharey=True)
    colors = value_colors(curves[0], sweep.values[curves[0]]) if curves else {}
    for ax, (key, cell) in zip(axs.flat, panels):
        for ck, sub in conditions(sweep, cell, curves):
            draw_seed_mean(ax, sub, metric, ", ".join(label_of(a, v) for a, v in zip(curves, ck)),
                           colors.get(ck[0], "black") if ck else "black")
        ax.set_title(label_of(panel, key[0]) if panel else sweep.name, fontsize=10)
        ax.set_xlabel("optimizer steps")
        ax.grid(alpha=0.3)
        if logy:
            ax.set_yscale("symlog", linthresh=1e-4)  # log above 1e-4, linear through 0
    for ax in list(axs.flat)[len(panels):]:
        ax.set_visible(False)
    axs[0][0].set_ylabel(ylabel)
    axs[0][0].legend(fontsize=7)
    fig.suptitle(f"{sweep.name}: {metric} (seed mean, min-max band)", fontsize=11)
    fig.savefig(out, dpi=100)
    return out


def headline_figure(sweep: Sweep, runs: pd.DataFrame, out: Path, metric: str = "eval_sampled") -> Path:
    """Left, top: held-out accuracy against N per loss (seed mean, interval band, collapsed runs as x).
    Left, bottom: each loss minus the reference loss at each N, paired by seed, with its interval.
    Right: the training reward per N against optimizer steps."""
    losses, ns = ([v for v in sweep.values[a] if v in set(runs[a])] for a in ("loss", "N"))
    ref, xs = sweep.reference.get("loss"), [float(n) for n in ns]
    fig = Figure(figsize=(16, 7), constrained_layout=True)
    left, right = fig.subfigures(1, 2, width_ratios=[1, 2.1])
    top, bottom = left.subplots(2, 1, sharex=True)
    for loss in losses:
        _final_vs_x(top, [(x, select(runs, {"loss": loss, "N": n})) for x, n in zip(xs, ns)], metric,
                    display_name(loss), color_of(loss))
    top.set_title(f"held-out accuracy after training (seed mean, {LEVEL} band; x = collapsed run)", fontsize=9)
    for i, loss in enumerate(x for x in losses if x != ref and ref is not None):
        shift = 2 ** ((i - (len(losses) - 2) / 2) * 0.06)  # spread the bars a little around each N
        pts = [(x * shift, paired(by_seed(select(runs, {"loss": loss, "N": n}), metric),
                                  by_seed(select(runs, {"loss": ref, "N": n}), metric)).diff) for x, n in zip(xs, ns)]
        _bars(bottom, [(x, d) for x, d in pts if d.n], color_of(loss), display_name(loss))
    if ref is not None:
        bottom.axhline(0.0, color=color_of(ref), linewidth=1.2)
        bottom.set_title(f"each loss minus {display_name(ref)}, paired by seed ({LEVEL} interval)", fontsize=9)
        bottom.set_ylabel(f"Δ {metric}")
    for ax in (top, bottom):
        ax.set_xlim(min(xs) / 1.5, max(xs) * 1.5)  # also with nothing drawn
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, ns)
        ax.grid(alpha=0.3)
    bottom.set_xlabel("N (optimizer steps per rollout batch; mini-batch fixed)")
    top.legend(fontsize=7, ncol=2)
    axs = right.subplots(math.ceil(len(ns) / min(3, len(ns))), min(3, len(ns)), squeeze=False, sharex=True, sharey=True)
    for ax, n in zip(axs.flat, ns):
        for loss in losses:
            draw_seed_mean(ax, select(runs, {"loss": loss, "N": n}), "reward/mean", display_name(loss), color_of(loss))
        ax.set(title=f"N = {n}", xlabel="optimizer steps", ylabel="training reward")
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
    right.suptitle("training reward (seed mean, min-max band)", fontsize=10)
    fig.suptitle(f"{sweep.name}: final accuracy against staleness N, paired differences, and the curves behind them",
                 fontsize=12)
    fig.savefig(out, dpi=100)
    return out


def _final_vs_x(ax, cells: list[tuple[float, pd.DataFrame]], metric: str, name: str, color: str) -> None:
    """Seed mean with its interval at each x of ``cells`` [(x, runs)], and the collapsed runs as x markers."""
    for x, cell in cells:
        if len(cell):
            dead = cell[cell.usable & cell.collapsed][metric]
            ax.scatter([x] * len(dead), dead, marker="x", color=color, s=22, linewidths=1)
    pts = [(x, ci) for x, ci in ((x, mean_ci(by_seed(cell, metric))) for x, cell in cells) if math.isfinite(ci.mean)]
    if pts:
        ax.plot([x for x, _ in pts], [c.mean for _, c in pts], "o-", color=color, label=name, linewidth=1.4,
                markersize=3.5)
        band = [(x, c) for x, c in pts if c.resolved]
        ax.fill_between([x for x, _ in band], [c.low for _, c in band], [c.high for _, c in band], color=color,
                        alpha=0.15)


def _bars(ax, pts: list, color: str, label: str) -> None:
    """Means with their intervals (x, Interval) as error bars."""
    ax.errorbar([x for x, _ in pts], [d.mean for _, d in pts], fmt="o-", color=color, label=label, markersize=3.5,
                yerr=[[d.mean - d.low if math.isfinite(d.low) else 0 for _, d in pts],
                      [d.high - d.mean if math.isfinite(d.high) else 0 for _, d in pts]], linewidth=1.1, capsize=2.5)


def lr_figure(sweep: Sweep, runs: pd.DataFrame, out: Path, metric: str = "eval_sampled") -> Path:
    """Top: final reward against the learning rate per loss. Bottom: the collapse rate with its exact interval."""
    fig = Figure(figsize=(7.5, 7.5), constrained_layout=True)
    top, bottom = fig.subplots(2, 1, sharex=True)
    groups = conditions(sweep, runs, [a for a in sweep.conditions if a != LR_AXIS])
    for i, (key, cell) in enumerate(groups):
        name = ", ".join(key) or "all"
        points, cell_lr = lr_points(cell), lr_of(cell)
        _final_vs_x(top, [(x, cell[cell_lr == x]) for x in points.index], metric, display_name(name), color_of(name))
        _bars(bottom, [(lr * 2 ** ((i - (len(groups) - 1) / 2) * 0.03), rate_ci(int(p.collapsed), int(p.runs)))
                       for lr, p in points.iterrows() if p.runs], color_of(name), display_name(name))
    lrs = sorted(set(lr_of(runs)))
    for ax in (top, bottom):
        ax.set_xscale("log")
        ax.set_xticks(lrs, [lr_text(x) for x in lrs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    top.set_ylabel(metric)
    top.legend(fontsize=7, loc="lower left")
    top.set_title(f"{sweep.name}: final reward against the learning rate\n(seed mean, {LEVEL} band; x = collapsed "
                  "run)", fontsize=9)
    bottom.set(ylabel="collapse rate", ylim=(-0.05, 1.05), xlabel="learning rate")
    bottom.set_title(f"collapse rate against the learning rate ({LEVEL} exact interval)", fontsize=9)
    fig.savefig(out, dpi=100)
    return out
