"""`vespo report`: the table and figures of a sweep directory written by `vespo sweep`.

    vespo report runs/staleness --out docs/results/staleness
    vespo report runs/staleness --out DIR --panel loss --curve N

Writes into DIR:

    report.md            one row per condition (grid point without its seed), aggregated over seeds:
                         final reward mean ± std, best reward, collapses, final KL, max grad norm,
                         ESS and the sequence log-weight range; then one row per run
    reward.png kl.png grad_norm.png    one panel per value of --panel (default: the loss), one curve per
                         value of --curve (default: N), the mean over seeds with its min-max band
    reward_equal_curve.png             the same reward curves with panel and curve swapped (equal N
                         side by side: at a fixed number of rollouts a larger N is also more updates)

"Final" means the mean over the last 20% of rollout steps (at least one step).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from vespo.lab.collapse import Collapse, collapse_of_rows
from vespo.lab.grid import SEED_AXIS
from vespo.plot import Run, load_run

FIGURES = [("reward", "reward/mean", "reward", False), ("kl", "kl/k3", "stale KL k3 (behavior vs updated)", True),
           ("grad_norm", "optim/grad_norm_max", "max grad norm per rollout step", True)]


@dataclass
class RunResult:
    name: str
    labels: dict[str, str]
    status: str  # done, interrupted, failed, unfinished
    run: Run | None  # None when the run wrote no metrics
    collapse: Collapse
    stats: dict[str, float]


# ---------------------------------------------------------------- reading


def read_sweep(sweep_dir: str | Path) -> tuple[dict, list[RunResult]]:
    """sweep.json and one RunResult per grid point directory."""
    sweep_dir = Path(sweep_dir)
    record_path = sweep_dir / "sweep.json"
    if not record_path.is_file():
        raise FileNotFoundError(f"{sweep_dir} is not a sweep directory: no sweep.json (run `vespo sweep` first)")
    record = json.loads(record_path.read_text())
    results = [read_run(d) for d in sorted(sweep_dir.iterdir()) if (d / "lab.json").is_file()]
    if not results:
        raise FileNotFoundError(f"{sweep_dir}: no run directories yet")
    axes = [a["label"] for a in record["axes"]]
    return record, sorted(results, key=lambda r: _order(record, axes, tuple(r.labels.get(a) for a in axes)))


def read_run(run_dir: Path) -> RunResult:
    lab = json.loads((run_dir / "lab.json").read_text())
    run = load_run(run_dir) if (run_dir / "metrics.jsonl").is_file() else None
    stopped = bool(lab.get("stopped_nonfinite"))
    status = _status(lab, run)
    if run is None or not run.rows:
        collapse = Collapse(True, "nonfinite", 1) if stopped else Collapse(False)
        return RunResult(run_dir.name, lab["labels"], status, None, collapse, {})
    return RunResult(run_dir.name, lab["labels"], status, run, collapse_of_rows(run.rows, stopped), run_stats(run.rows))


def _status(lab: dict, run: Run | None) -> str:
    if lab.get("returncode", 0) != 0:
        return "failed"
    if run is not None and run.summary.get("status") in ("done", "interrupted"):
        return run.summary["status"]
    return "unfinished"


def run_stats(rows: list[dict]) -> dict[str, float]:
    """Per-run numbers of the table, from the metrics rows."""
    return {
        "final_reward": final_mean(rows, "reward/mean"),
        "best_reward": max(float(r["reward/mean"]) for r in rows),
        "final_kl": final_mean(rows, "kl/k3"),
        "final_engine_kl": final_mean(rows, "mismatch/k3"),
        "max_grad_norm": max((float(r.get("optim/grad_norm_max", r.get("optim/grad_norm", math.nan))) for r in rows),
                             default=math.nan),
        "ess": _mean([float(r["is/ess"]) for r in rows if "is/ess" in r]),
        "log_w_min": min((float(r["is/log_w_min"]) for r in rows if "is/log_w_min" in r), default=math.nan),
        "log_w_max": max((float(r["is/log_w_max"]) for r in rows if "is/log_w_max" in r), default=math.nan),
        "final_eos": final_mean(rows, "rollout/eos_rate"),
        "steps": float(len(rows)),
    }


def final_mean(rows: list[dict], key: str) -> float:
    """Mean of a metric over the last 20% of the steps (at least one); nan if the metric is absent."""
    values = [float(r[key]) for r in rows if key in r]
    return _mean(values[-max(1, len(values) // 5):]) if values else math.nan


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


# ---------------------------------------------------------------- grouping


def conditions(record: dict) -> list[str]:
    """The axes that define a condition: every grid axis except the seed."""
    return [a["label"] for a in record["axes"] if a["label"] != SEED_AXIS]


def group(results: list[RunResult], axes: list[str]) -> dict[tuple, list[RunResult]]:
    """Runs by condition (their labels on ``axes``), in the order the grid lists the values."""
    out: dict[tuple, list[RunResult]] = {}
    for r in results:
        out.setdefault(tuple(r.labels[a] for a in axes), []).append(r)
    return out


def _order(record: dict, axes: list[str], key: tuple) -> tuple:
    values = {a["label"]: a["values"] for a in record["axes"]}
    return tuple(values[a].index(k) if k in values[a] else len(values[a]) for a, k in zip(axes, key))


# ---------------------------------------------------------------- table


def condition_table(record: dict, results: list[RunResult]) -> str:
    axes = conditions(record)
    head = axes + ["runs", "final reward", "best reward", "collapsed", "final KL k3", "engine KL k3",
                   "max grad norm", "mean ESS", "log W range"]
    lines = [_row(head), _row(["---"] * len(head))]
    groups = group(results, axes)
    for key in sorted(groups, key=lambda k: _order(record, axes, k)):
        lines.append(_row(list(key) + _condition_cells(groups[key])))
    return "\n".join(lines)


def _condition_cells(runs: list[RunResult]) -> list[str]:
    s = [r.stats for r in runs if r.stats]
    finals = [x["final_reward"] for x in s]
    done = sum(r.status == "done" for r in runs)
    reasons = sorted({r.collapse.reason for r in runs if r.collapse.collapsed})
    return [f"{len(runs)}" + ("" if done == len(runs) else f" ({done} done)"),
            _pm(finals), _num(_mean([x["best_reward"] for x in s])),
            f"{sum(r.collapse.collapsed for r in runs)}/{len(runs)}" + (f" ({', '.join(reasons)})" if reasons else ""),
            _num(_mean([x["final_kl"] for x in s]), sci=True), _num(_mean([x["final_engine_kl"] for x in s]), sci=True),
            _num(max((x["max_grad_norm"] for x in s), default=math.nan)), _num(_mean([x["ess"] for x in s])),
            _range(min((x["log_w_min"] for x in s), default=math.nan), max((x["log_w_max"] for x in s), default=math.nan))]


def run_table(record: dict, results: list[RunResult]) -> str:
    head = ["run", "status", "steps", "final reward", "best reward", "collapse", "final KL k3", "max grad norm",
            "mean ESS", "final EOS rate"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in results:
        s, c = r.stats, r.collapse
        collapse = f"{c.reason} at step {c.step}" if c.collapsed else "no"
        lines.append(_row([f"`{r.name}`", r.status, _num(s.get("steps", 0), digits=0), _num(s.get("final_reward")),
                           _num(s.get("best_reward")), collapse, _num(s.get("final_kl"), sci=True),
                           _num(s.get("max_grad_norm")), _num(s.get("ess")), _num(s.get("final_eos"))]))
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _num(x: float | None, digits: int = 3, sci: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.2e}" if sci and x != 0 and abs(x) < 1e-2 else f"{x:.{digits}f}"


def _pm(values: list[float]) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "–"
    if len(values) == 1:
        return _num(values[0])
    return f"{_num(statistics.mean(values))} ± {_num(statistics.stdev(values))}"


def _range(lo: float, hi: float) -> str:
    return "–" if not (math.isfinite(lo) and math.isfinite(hi)) else f"[{lo:.2f}, {hi:.2f}]"


# ---------------------------------------------------------------- figures


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


def curve_figure(record: dict, results: list[RunResult], panel: str | None, curves: list[str], metric: str,
                 ylabel: str, logy: bool, out: Path, title: str) -> Path:
    """One panel per value of ``panel``; in each, the seed-mean curve (and min-max band) per curve value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_runs = [r for r in results if r.run is not None]
    panels = group(with_runs, [panel]) if panel else {(): with_runs}
    keys = sorted(panels, key=lambda k: _order(record, [panel], k) if panel else ())
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axs = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False, sharey=True,
                            constrained_layout=True)
    for ax, key in zip(axs.flat, keys):
        by_curve = group(panels[key], curves)
        for ck in sorted(by_curve, key=lambda k: _order(record, curves, k)):
            _draw_mean(ax, by_curve[ck], metric, ", ".join(f"{a}={v}" for a, v in zip(curves, ck)))
        ax.set_title(f"{panel}={key[0]}" if panel else title, fontsize=10)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
        if logy:
            ax.set_yscale("symlog", linthresh=1e-4)  # log above 1e-4, linear through 0
    for ax in list(axs.flat)[len(keys):]:
        ax.set_visible(False)
    axs[0][0].set_ylabel(ylabel)
    axs[0][0].legend(fontsize=7)
    fig.suptitle(f"{title}: {metric}" if panel else metric, fontsize=11)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _draw_mean(ax, runs: list[RunResult], metric: str, label: str) -> None:
    curves = [dict(zip(*r.run.curve(metric))) for r in runs]
    steps = sorted(set.union(*(set(c) for c in curves))) if curves else []
    if not steps:
        return
    values = [[c[s] for c in curves if s in c] for s in steps]
    line, = ax.plot(steps, [_mean(v) for v in values], label=label, linewidth=1.4)
    if len(runs) > 1:
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.15)


# ---------------------------------------------------------------- the report


def write_report(sweep_dir: Path, out: Path, panel: str | None = None, curve: str | None = None) -> Path:
    record, results = read_sweep(sweep_dir)
    panel, curves = layout(record, panel, curve)
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for stem, metric, ylabel, logy in FIGURES:
        figures.append(curve_figure(record, results, panel, curves, metric, ylabel, logy, out / f"{stem}.png",
                                    record["name"]))
    if panel and curves:  # equal-N view: panels by the first curve axis, curves by the panel axis
        figures.append(curve_figure(record, results, curves[0], [panel] + curves[1:], "reward/mean", "reward", False,
                                    out / "reward_equal_curve.png", record["name"]))
    path = out / "report.md"
    path.write_text(markdown(record, results, figures))
    return path


def markdown(record: dict, results: list[RunResult], figures: list[Path]) -> str:
    seeds = sorted({r.labels.get(SEED_AXIS) for r in results} - {None})
    lines = [f"## Sweep `{record['name']}`", "",
             f"{len(results)} runs" + (f", seeds {', '.join(seeds)}" if seeds else "") + "; the runs column counts "
             "each condition's runs (seeds). Final = mean over the last 20% of rollout steps; "
             "KL k3 = mean(exp(d) - 1 - d) per token between the behavior and the updated policy; engine KL = the "
             "same between rollout engine and trainer; collapsed = reward below half its best until the end, "
             "non-finite updates, or EOS rate below 0.5 until the end (at least 3 steps).", "",
             condition_table(record, results), "", "Runs:", "", run_table(record, results), ""]
    lines += [f"![{f.stem}]({f.name})" for f in figures]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir", help="a directory written by `vespo sweep`")
    p.add_argument("--out", help="folder for report.md and the PNGs (default: SWEEP_DIR/report)")
    p.add_argument("--panel", help="grid axis with one panel per value (default: loss)")
    p.add_argument("--curve", help="grid axis with one curve per value (default: N)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.sweep_dir) / "report"
    try:
        path = write_report(Path(args.sweep_dir), out, args.panel, args.curve)
    except (FileNotFoundError, ValueError) as e:
        print(f"vespo report: {e}", file=sys.stderr)
        return 2
    print(path.read_text().split("Runs:")[0])
    print(f"wrote {path} and its figures")
    return 0
