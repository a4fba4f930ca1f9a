"""The lab's figures, drawn from a sweep's RunResults (matplotlib, Agg backend).

    write_figures(record, results, out)   every figure a sweep gets; returns their paths
    curve_figure(...)      one panel per value of an axis, one curve per value of another: a metric's
                           seed mean (min-max band) against optimizer steps
    headline_figure(...)   the paper's view of staleness: final held-out accuracy against N per loss
                           (the levels), beside each loss minus the reference loss per N, paired by
                           seed, with its interval, and the training curves of every N
    lr_figure(...)         final reward and collapse rate (exact interval) against the learning rate

Every curve is plotted against optimizer steps, the axis comparable across N: row k of a run at N
is trained after (k - 1) x N updates. Curves are averaged in windows of max(N, run / 32) updates,
so a run at N = 1 (512 rows) and one at N = 64 (8 rows) are drawn at comparable resolution. A loss
has one colour and one name in every figure (vespo.plot.color_of, display_name).
"""

from __future__ import annotations

import math
from pathlib import Path

from vespo.lab.lr_range import LR_AXIS, LrRange, lr_ranges, lr_text
from vespo.lab.results import RunResult, by_seed, conditions, group, order, planned_updates, update_axis
from vespo.lab.stats import CONFIDENCE, mean_ci, paired_difference, rate_ci
from vespo.plot import color_of, display_name

BINS = 32  # windows per run for the curves
LOSS_AXES = ("loss", "method")  # axes whose values are losses (or a loss with a fix): coloured by loss
CURVES = [("reward", "reward/mean", "training reward", False),
          ("kl", "kl/k3", "stale KL k3 (behavior vs updated)", True),
          ("grad_norm", "optim/grad_norm_max", "max grad norm per logged step", True)]
LEVEL = f"{CONFIDENCE:.0%}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def value_colors(axis: str, values: list[str]) -> dict[str, str]:
    """Colours of an axis's values: a loss's own colour on a loss axis, else evenly along a colormap."""
    if axis in LOSS_AXES:
        return {v: color_of(v) for v in values}
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    return {v: matplotlib.colors.to_hex(cmap(i / max(1, len(values) - 1) * 0.9)) for i, v in enumerate(values)}


def label_of(axis: str, value: str) -> str:
    return display_name(value) if axis in LOSS_AXES else f"{axis}={value}"


# ---------------------------------------------------------------- every figure of a sweep


def layout(record: dict, panel: str | None, curve: str | None) -> tuple[str | None, list[str]]:
    """(panel axis or None, curve axes). Defaults: panels by loss, curves by N, other axes joined."""
    axes = conditions(record)
    for name, given in (("--panel", panel), ("--curve", curve)):
        if given is not None and given not in axes:
            raise ValueError(f"{name} {given!r} is not a grid axis of this sweep; axes: {axes}")
    if len(axes) <= 1 and panel is None:
        return None, axes
    panel = panel or ("loss" if "loss" in axes and curve != "loss" else next(a for a in axes if a != curve))
    rest = [a for a in axes if a != panel]
    if curve is not None:
        rest = [curve] + [a for a in rest if a != curve]
    elif "N" in rest:
        rest = ["N"] + [a for a in rest if a != "N"]
    return panel, rest


def write_figures(record: dict, results: list[RunResult], out: Path, panel: str | None = None,
                  curve: str | None = None) -> list[Path]:
    panel, curves = layout(record, panel, curve)
    figures = []
    axes = conditions(record)
    if "loss" in axes and "N" in axes:
        figures.append(headline_figure(record, results, out / "headline.png"))
    if LR_AXIS in axes:
        figures.append(lr_figure(record, results, lr_ranges(record, results), out / "lr.png"))
    for stem, metric, ylabel, logy in CURVES:
        figures.append(curve_figure(record, results, panel, curves, metric, ylabel, logy, out / f"{stem}.png",
                                    record["name"]))
    return figures


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


def draw_seed_mean(ax, runs: list[RunResult], metric: str, label: str, color: str) -> None:
    """The mean over seeds of the binned curves, and their min-max band."""
    curves = [dict(zip(*binned_curve(r, metric))) for r in runs if r.run is not None]
    xs = sorted(set().union(*curves)) if curves else []
    if not xs:
        return
    values = [[c[x] for c in curves if x in c] for x in xs]
    ax.plot(xs, [sum(v) / len(v) for v in values], label=label, linewidth=1.3, color=color)
    if len(curves) > 1:
        ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.12)


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
    values = {a["label"]: a["values"] for a in record["axes"]}
    first = curves[0] if curves else None
    colors = value_colors(first, values[first]) if first else {}
    for ax, key in zip(axs.flat, keys):
        by_curve = group(panels[key], curves)
        for ck in sorted(by_curve, key=lambda k: order(record, curves, k)):
            label = ", ".join(label_of(a, v) for a, v in zip(curves, ck))
            draw_seed_mean(ax, by_curve[ck], metric, label, colors.get(ck[0], "black") if ck else "black")
        ax.set_title(label_of(panel, key[0]) if panel else title, fontsize=10)
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
                    n_axis: str = "N", metric: str = "eval_sampled") -> Path:
    """Left, top: held-out accuracy against N per loss (seed mean, interval band, collapsed runs as x).
    Left, bottom: each loss minus the reference loss at each N, paired by seed, with its interval.
    Right: the training reward per N against optimizer steps."""
    plt = _plt()
    values = {a["label"]: a["values"] for a in record["axes"]}
    losses = [v for v in values[loss_axis] if any(r.labels.get(loss_axis) == v for r in results)]
    ns = [v for v in values[n_axis] if any(r.labels.get(n_axis) == v for r in results)]
    ref = (record.get("reference") or {}).get(loss_axis)
    fig = plt.figure(figsize=(16, 7), constrained_layout=True)
    left, right = fig.subfigures(1, 2, width_ratios=[1, 2.1])
    top, bottom = left.subplots(2, 1, sharex=True)
    for loss in losses:
        _final_vs_x(top, [r for r in results if r.labels.get(loss_axis) == loss], n_axis, ns,
                    [float(n) for n in ns], metric, display_name(loss), color_of(loss))
    top.set_title(f"held-out accuracy after training (seed mean, {LEVEL} band; x = collapsed run)", fontsize=9)
    if ref is not None:
        _paired_vs_n(bottom, record, results, losses, ref, ns, loss_axis, n_axis, metric)
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.set_xticks([float(n) for n in ns], ns)
        ax.grid(alpha=0.3)
    bottom.set_xlabel("N (optimizer steps per rollout batch; mini-batch fixed)")
    top.legend(fontsize=7, ncol=2)
    _curves_per_n(right, results, losses, ns, loss_axis, n_axis)
    fig.suptitle(f"{record['name']}: final accuracy against staleness N, paired differences, and the curves behind "
                 "them", fontsize=12)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _curves_per_n(right, results: list[RunResult], losses: list[str], ns: list[str], loss_axis: str,
                  n_axis: str) -> None:
    """One panel per N: the training reward of every loss against optimizer steps."""
    cols = min(3, len(ns))
    axs = right.subplots(math.ceil(len(ns) / cols), cols, squeeze=False, sharex=True, sharey=True)
    for ax, n in zip(axs.flat, ns):
        for loss in losses:
            runs = [r for r in results if r.labels.get(loss_axis) == loss and r.labels.get(n_axis) == n]
            draw_seed_mean(ax, runs, "reward/mean", display_name(loss), color_of(loss))
        ax.set_title(f"N = {n}", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in list(axs.flat)[len(ns):]:
        ax.set_visible(False)
    for ax in axs[-1]:
        ax.set_xlabel("optimizer steps")
    for r in axs:
        r[0].set_ylabel("training reward")
    right.suptitle("training reward (seed mean, min-max band)", fontsize=10)


def _paired_vs_n(ax, record: dict, results: list[RunResult], losses: list[str], ref: str, ns: list[str],
                 loss_axis: str, n_axis: str, metric: str) -> None:
    """Each loss minus ``ref`` at each N, paired by seed: the mean and its interval as an error bar,
    the losses side by side around each N."""
    cells = group(results, [loss_axis, n_axis])
    others = [x for x in losses if x != ref]
    for i, loss in enumerate(others):
        shift = 2 ** ((i - (len(others) - 1) / 2) * 0.06)  # spread the bars a little around each N
        pts = []
        for n in ns:
            p = paired_difference(by_seed(cells.get((loss, n), []), metric), by_seed(cells.get((ref, n), []), metric))
            if p.diff.n:
                pts.append((float(n) * shift, p.diff))
        if not pts:
            continue
        xs, ds = [x for x, _ in pts], [d for _, d in pts]
        err = [[d.mean - d.low if d.resolved else 0 for d in ds], [d.high - d.mean if d.resolved else 0 for d in ds]]
        ax.errorbar(xs, [d.mean for d in ds], yerr=err, fmt="o-", color=color_of(loss), label=display_name(loss),
                    markersize=3.5, linewidth=1.1, capsize=2.5)
    ax.axhline(0.0, color=color_of(ref), linewidth=1.2)
    ax.set_title(f"each loss minus {display_name(ref)}, paired by seed ({LEVEL} interval)", fontsize=9)
    ax.set_ylabel(f"Δ {metric}")


def _final_vs_x(ax, runs: list[RunResult], axis: str, labels: list[str], xs: list[float], metric: str,
                name: str, color: str) -> None:
    """Seed mean with its interval at each x, and the collapsed runs as x markers."""
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


def _rate_vs_lr(ax, rng: LrRange, shift: float, label: str, color: str) -> None:
    """The collapse rate at each learning rate with its exact interval (x nudged by ``shift``)."""
    rates = [(p.lr * shift, rate_ci(p.collapsed, p.runs)) for p in rng.points if p.runs]
    if rates:
        ax.errorbar([x for x, _ in rates], [r.mean for _, r in rates],
                    yerr=[[r.mean - r.low for _, r in rates], [r.high - r.mean for _, r in rates]],
                    fmt="o-", color=color, label=label, markersize=3.5, linewidth=1.1, capsize=2.5)


def lr_figure(record: dict, results: list[RunResult], ranges: list[LrRange], out: Path,
              metric: str = "eval_sampled", lr_axis: str = LR_AXIS) -> Path:
    """Top: final reward against the learning rate per loss, the stable range as a bar. Bottom: the
    collapse rate against the learning rate with its exact interval."""
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 7.5), sharex=True, constrained_layout=True)
    names = [", ".join(rng.condition.values()) or "all" for rng in ranges]
    for i, (rng, name) in enumerate(zip(ranges, names)):
        color, label = color_of(name), display_name(name)
        runs = [r for r in results if all(r.labels.get(a) == v for a, v in rng.condition.items())]
        _final_vs_x(top, runs, lr_axis, [p.label for p in rng.points], [p.lr for p in rng.points], metric, label,
                    color)
        if rng.low is not None:  # one thin bar per condition along the top
            top.axvspan(rng.low, rng.high, ymin=0.985 - 0.025 * i, ymax=0.995 - 0.025 * i, color=color, alpha=0.8)
        _rate_vs_lr(bottom, rng, 2 ** ((i - (len(ranges) - 1) / 2) * 0.03), label, color)
    lrs = sorted({p.lr for rng in ranges for p in rng.points})
    for ax in (top, bottom):
        ax.set_xscale("log")
        ax.set_xticks(lrs, [lr_text(x) for x in lrs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    top.set_ylabel(metric)
    top.set_ylim(bottom=-0.03, top=max(top.get_ylim()[1], 0.1) * 1.15)  # room for the bars
    top.legend(fontsize=7, loc="lower left")
    top.set_title(f"{record['name']}: final reward against the learning rate\n(seed mean, {LEVEL} band; x = collapsed "
                  "run; bars: the widest range with no collapsed run)", fontsize=9)
    bottom.set_ylabel("collapse rate")
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_xlabel("learning rate")
    bottom.set_title(f"collapse rate against the learning rate ({LEVEL} exact interval)", fontsize=9)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
