"""The lab's figures, drawn from a sweep's RunResults (matplotlib, Agg backend).

    curve_figure(...)      one panel per value of an axis, one curve per value of another: a metric's
                           seed mean (min-max band) against optimizer steps
    headline_figure(...)   the paper's view of staleness: final reward against N per loss with 90%
                           interval bands, beside the training reward curves of every N
    lr_figure(...)         final reward against the learning rate per loss, collapsed runs marked

Every curve is plotted against optimizer steps, the axis comparable across N: row k of a run at N
is trained after (k - 1) x N updates. Curves are averaged in windows of max(N, run / 32) updates,
so a run at N = 1 (512 rows) and one at N = 64 (8 rows) are drawn at comparable resolution.
"""

from __future__ import annotations

import math
from pathlib import Path

from vespo.lab.lr_range import LrRange, lr_text
from vespo.lab.results import RunResult, by_seed, group, order, planned_updates, update_axis
from vespo.lab.stats import mean_ci

BINS = 32  # windows per run for the curves


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colors(values: list[str]) -> dict[str, str]:
    """One colour per value (e.g. per loss), the same in every figure of a report."""
    palette = ["tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
               "tab:olive", "tab:cyan"]
    return {v: palette[i % len(palette)] for i, v in enumerate(values)}


# ---------------------------------------------------------------- curves against optimizer steps


def binned_curve(r: RunResult, metric: str) -> tuple[list[float], list[float]]:
    """(optimizer steps, value) of a run's metric averaged in windows of max(N, updates / BINS) updates."""
    if r.run is None:
        return [], []
    width = max(r.run.updates_per_step, planned_updates(r.run) / BINS)
    bins: dict[int, list[tuple[int, float]]] = {}
    for x, row in zip(update_axis(r.run), r.run.rows):
        if metric in row and math.isfinite(float(row[metric])):
            bins.setdefault(int(x // width), []).append((x, float(row[metric])))
    xs = [sum(x for x, _ in pts) / len(pts) for _, pts in sorted(bins.items())]
    ys = [sum(y for _, y in pts) / len(pts) for _, pts in sorted(bins.items())]
    return xs, ys


def draw_seed_mean(ax, runs: list[RunResult], metric: str, label: str, color: str | None = None) -> None:
    """The mean over seeds of the binned curves, and their min-max band."""
    curves = [dict(zip(*binned_curve(r, metric))) for r in runs if r.run is not None]
    xs = sorted(set().union(*curves)) if curves else []
    if not xs:
        return
    values = [[c[x] for c in curves if x in c] for x in xs]
    line, = ax.plot(xs, [sum(v) / len(v) for v in values], label=label, linewidth=1.3, color=color)
    if len(curves) > 1:
        ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.12)


def curve_figure(record: dict, results: list[RunResult], panel: str | None, curves: list[str], metric: str,
                 ylabel: str, logy: bool, out: Path, title: str) -> Path:
    """One panel per value of ``panel``; in each, the seed-mean curve (and min-max band) per curve value."""
    plt = _plt()
    with_runs = [r for r in results if r.run is not None]
    panels = group(with_runs, [panel]) if panel else {(): with_runs}
    keys = sorted(panels, key=lambda k: order(record, [panel], k) if panel else ())
    cols = min(4, max(1, len(keys)))
    rows = max(1, math.ceil(len(keys) / cols))
    fig, axs = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.0 * rows), squeeze=False, sharey=True,
                            constrained_layout=True)
    for ax, key in zip(axs.flat, keys):
        by_curve = group(panels[key], curves)
        for ck in sorted(by_curve, key=lambda k: order(record, curves, k)):
            draw_seed_mean(ax, by_curve[ck], metric, ", ".join(f"{a}={v}" for a, v in zip(curves, ck)))
        ax.set_title(f"{panel}={key[0]}" if panel else title, fontsize=10)
        ax.set_xlabel("optimizer steps")
        ax.grid(alpha=0.3)
        if logy:
            ax.set_yscale("symlog", linthresh=1e-4)  # log above 1e-4, linear through 0
    for ax in list(axs.flat)[len(keys):]:
        ax.set_visible(False)
    axs[0][0].set_ylabel(ylabel)
    if keys:
        axs[0][0].legend(fontsize=7)
    fig.suptitle(f"{title}: {metric} (seed mean, min-max band)", fontsize=11)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- the headline figure


def headline_figure(record: dict, results: list[RunResult], out: Path, loss_axis: str = "loss",
                    n_axis: str = "N") -> Path:
    """Left: held-out accuracy and the last quarter's training reward against N per loss (seed mean,
    90% bootstrap band, collapsed runs as x). Right: the training reward per N against optimizer steps."""
    plt = _plt()
    values = {a["label"]: a["values"] for a in record["axes"]}
    losses = [v for v in values[loss_axis] if any(r.labels.get(loss_axis) == v for r in results)]
    ns = [v for v in values[n_axis] if any(r.labels.get(n_axis) == v for r in results)]
    color = colors(values[loss_axis])
    fig = plt.figure(figsize=(16, 6.5), constrained_layout=True)
    left, right = fig.subfigures(1, 2, width_ratios=[1, 2.1])
    top, bottom = left.subplots(2, 1, sharex=True)
    for ax, metric, name in ((top, "eval_sampled", "held-out accuracy after training (sampled)"),
                             (bottom, "train_last", "training reward, last quarter of updates")):
        for loss in losses:
            _final_vs_x(ax, [r for r in results if r.labels.get(loss_axis) == loss], n_axis, ns,
                        [float(n) for n in ns], metric, loss, color[loss])
        ax.set_xscale("log", base=2)
        ax.set_xticks([float(n) for n in ns], ns)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    bottom.set_xlabel("N (optimizer steps per rollout batch; mini-batch fixed)")
    top.legend(fontsize=8)
    cols = min(3, len(ns))
    axs = right.subplots(math.ceil(len(ns) / cols), cols, squeeze=False, sharex=True, sharey=True)
    for ax, n in zip(axs.flat, ns):
        for loss in losses:
            runs = [r for r in results if r.labels.get(loss_axis) == loss and r.labels.get(n_axis) == n]
            draw_seed_mean(ax, runs, "reward/mean", loss, color[loss])
        ax.set_title(f"N = {n}", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in list(axs.flat)[len(ns):]:
        ax.set_visible(False)
    for ax in axs[-1]:
        ax.set_xlabel("optimizer steps")
    for row in axs:
        row[0].set_ylabel("training reward")
    right.suptitle("training reward (seed mean, min-max band)", fontsize=10)
    fig.suptitle(f"{record['name']}: final reward against staleness N, and the curves behind it", fontsize=12)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _final_vs_x(ax, runs: list[RunResult], axis: str, labels: list[str], xs: list[float], metric: str,
                name: str, color: str) -> None:
    """Seed mean with its 90% interval at each x, and the collapsed runs as x markers."""
    pts = []
    for label, x in zip(labels, xs):
        cell = [r for r in runs if r.labels.get(axis) == label]
        if cell:
            ci = mean_ci(list(by_seed(cell, metric).values()))
            pts.append((x, ci))
            dead = [r.stats.get(metric, math.nan) for r in cell if r.usable and r.collapse.collapsed]
            ax.scatter([x] * len(dead), dead, marker="x", color=color, s=22, linewidths=1)
    pts = [(x, ci) for x, ci in pts if math.isfinite(ci.mean)]
    if not pts:
        return
    ax.plot([x for x, _ in pts], [c.mean for _, c in pts], "o-", color=color, label=name, linewidth=1.4,
            markersize=3.5)
    band = [(x, c) for x, c in pts if c.resolved]
    if band:
        ax.fill_between([x for x, _ in band], [c.low for _, c in band], [c.high for _, c in band], color=color,
                        alpha=0.15)


# ---------------------------------------------------------------- the learning-rate range


def lr_figure(record: dict, results: list[RunResult], ranges: list[LrRange], out: Path,
              metric: str = "eval_sampled", lr_axis: str = "lr") -> Path:
    """Final reward against the learning rate, one line per condition (loss), the stable range bold."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), constrained_layout=True)
    names = [", ".join(rng.condition.values()) or "all" for rng in ranges]
    color = colors(names)
    for rng, name in zip(ranges, names):
        runs = [r for r in results if all(r.labels.get(a) == v for a, v in rng.condition.items())]
        _final_vs_x(ax, runs, lr_axis, [p.label for p in rng.points], [p.lr for p in rng.points], metric, name,
                    color[name])
        if rng.low is not None:  # one thin bar per condition along the top
            i = names.index(name)
            ax.axvspan(rng.low, rng.high, ymin=0.985 - 0.025 * i, ymax=0.995 - 0.025 * i, color=color[name], alpha=0.8)
    ax.set_xscale("log")
    lrs = sorted({p.lr for rng in ranges for p in rng.points})
    ax.set_xticks(lrs, [lr_text(x) for x in lrs])
    ax.minorticks_off()
    ax.set_xlabel("learning rate (bars along the top: each loss's widest range with no collapsed run)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=-0.03, top=max(ax.get_ylim()[1], 0.1) * 1.15)  # room for the bars
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"{record['name']}: final reward against the learning rate (seed mean, 90% band; x = collapsed run)",
                 fontsize=10)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
