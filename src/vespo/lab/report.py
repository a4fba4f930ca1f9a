"""`vespo report`: the tables and figures of sweep directories, and the results page.

    vespo report runs/staleness                           -> runs/staleness/report/report.md + PNGs
    vespo report runs/staleness --out DIR --panel loss --curve N
    vespo report runs/lab/* --claims configs/lab/claims.yaml --page docs/results.md
                                                          -> docs/results/<sweep>/ + the page

A sweep's report.md holds, per condition (grid point without its seed), the mean over seeds with a
90% bootstrap interval of the held-out accuracy after training (sampled and greedy) and of the
training reward over the last quarter of the optimizer steps, the collapse count and diagnostics;
each condition's paired difference against the sweep's reference (VESPO by default) seed by seed;
with an lr axis, the stable learning-rate range per loss; then one row per run. Figures:
reward.png, kl.png, grad_norm.png (curves against optimizer steps), headline.png when the grid
has loss and N axes, lr.png when it has an lr axis. What "final" means: vespo.lab.results.
With --page, every sweep's report goes to results/<name>/ beside the page, and the page gets the
claims table (vespo.lab.claims), the headline figure, and each sweep's commands, commit and wall
time (vespo.lab.page).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

from vespo.lab.figures import curve_figure, headline_figure, lr_figure
from vespo.lab.lr_range import LR_AXIS, lr_ranges, lr_text
from vespo.lab.results import RunResult, by_seed, conditions, group, order, read_sweep
from vespo.lab.stats import Interval, mean_ci, paired_difference

FIGURES = [("reward", "reward/mean", "training reward", False),
           ("kl", "kl/k3", "stale KL k3 (behavior vs updated)", True),
           ("grad_norm", "optim/grad_norm_max", "max grad norm per logged step", True)]
DEFINITIONS = (
    "Mean over seeds with its 90% bootstrap interval in brackets. Held-out = accuracy on the task's held-out "
    "problems after the last update (one sample per problem, and greedy); train = training reward over the last "
    "quarter of the optimizer steps (the same samples at every N). Collapsed = reward below half its best, "
    "non-finite updates, or EOS rate below 0.5, lasting through the end of the run (at least its last 10%); a run "
    "stopped for non-finite updates counts as reward 0. KL k3 = mean(exp(d) - 1 - d) per token, between the "
    "behavior and the updated policy (stale) or rollout engine and trainer (engine), over the last quarter.")


# ---------------------------------------------------------------- tables


def condition_table(record: dict, results: list[RunResult]) -> str:
    axes = conditions(record)
    head = axes + ["runs", "held-out sampled", "held-out greedy", "train (last quarter)", "collapsed",
                   "max grad norm", "mean ESS", "log W range", "stale KL k3", "engine KL k3"]
    lines = [_row(head), _row(["---"] * len(head))]
    groups = group(results, axes)
    for key in sorted(groups, key=lambda k: order(record, axes, k)):
        lines.append(_row(list(key) + _condition_cells(groups[key])))
    return "\n".join(lines)


def _condition_cells(runs: list[RunResult]) -> list[str]:
    usable = [r for r in runs if r.usable]
    s = [r.stats for r in usable]
    missing = len(runs) - len(usable)
    reasons = sorted({r.collapse.reason for r in usable if r.collapse.collapsed})
    return [f"{len(usable)}" + (f" (+{missing} not finished)" if missing else ""),
            ci_text(mean_ci(list(by_seed(runs, "eval_sampled").values()))),
            ci_text(mean_ci(list(by_seed(runs, "eval_greedy").values()))),
            ci_text(mean_ci(list(by_seed(runs, "train_last").values()))),
            f"{sum(r.collapse.collapsed for r in usable)}/{len(usable)}" + (f" ({', '.join(reasons)})" if reasons else ""),
            num(_max(x["max_grad_norm"] for x in s)), num(_mean([x["ess"] for x in s])),
            _range(_min(x["log_w_min"] for x in s), _max(x["log_w_max"] for x in s)),
            num(_mean([x["final_kl"] for x in s]), sci=True), num(_mean([x["final_engine_kl"] for x in s]), sci=True)]


def paired_table(record: dict, results: list[RunResult]) -> str:
    """Each condition minus the reference condition with the same other labels, seed by seed."""
    ref = record.get("reference") or {}
    if not ref:
        return ""
    (axis, ref_value), = ref.items()
    axes = conditions(record)
    others = [a for a in axes if a != axis]
    head = others + [axis, "Δ held-out sampled", "Δ held-out greedy", "Δ train (last quarter)", "seeds",
                     "higher in"]
    lines = [_row(head), _row(["---"] * len(head))]
    groups = group(results, axes)
    for key in sorted(groups, key=lambda k: order(record, axes, k)):
        labels = dict(zip(axes, key))
        if labels[axis] == ref_value:
            continue
        partner = groups.get(tuple(ref_value if a == axis else labels[a] for a in axes), [])
        diffs = [paired_difference(by_seed(groups[key], m), by_seed(partner, m))
                 for m in ("eval_sampled", "eval_greedy", "train_last")]
        lines.append(_row([labels[a] for a in others] + [labels[axis]] + [ci_text(d.diff, signed=True) for d in diffs]
                          + [str(diffs[0].diff.n), f"{diffs[0].wins}/{diffs[0].diff.n}"]))
    return "\n".join(lines)


def lr_table(record: dict, results: list[RunResult]) -> str:
    if LR_AXIS not in conditions(record):
        return ""
    ranges = lr_ranges(record, results)
    names = list(ranges[0].condition) if ranges else []
    head = names + ["stable lr range", "width", "best held-out sampled in it", "per lr: collapsed/runs"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in ranges:
        span = "none" if r.low is None else f"{lr_text(r.low)} to {lr_text(r.high)}"
        best = "–" if r.best is None else f"{ci_text(r.best.reward)} at {lr_text(r.best.lr)}"
        per_lr = ", ".join(f"{lr_text(p.lr)}: {p.collapsed}/{p.runs}" + (f" (+{p.missing})" if p.missing else "")
                           for p in r.points)
        lines.append(_row(list(r.condition.values()) + [span, "–" if r.low is None else f"{r.width:.3g}x", best,
                                                         per_lr]))
    return "\n".join(lines)


def run_table(record: dict, results: list[RunResult]) -> str:
    head = ["run", "status", "logged steps", "held-out sampled", "held-out greedy", "train (last quarter)",
            "best train", "collapse", "max grad norm", "mean ESS", "final EOS rate", "seconds"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in results:
        s, c = r.stats, r.collapse
        collapse = f"{c.reason} at step {c.step}" if c.collapsed else "no"
        seconds = r.run.summary.get("seconds") if r.run is not None else None
        lines.append(_row([f"`{r.name}`", r.status, str(len(r.run.rows)) if r.run else "0",
                           num(s.get("eval_sampled")), num(s.get("eval_greedy")), num(s.get("train_last")),
                           num(s.get("best_reward")), collapse, num(s.get("max_grad_norm")), num(s.get("ess")),
                           num(s.get("final_eos")), num(seconds, digits=0)]))
    return "\n".join(lines)


def ci_text(ci: Interval, signed: bool = False) -> str:
    """"0.512 [0.470, 0.551]"; "+0.031 [-0.010, +0.070]" when signed; a lone value has no interval."""
    if ci.n == 0 or not math.isfinite(ci.mean):
        return "–"
    f = "{:+.3f}" if signed else "{:.3f}"
    if not ci.resolved:
        return f.format(ci.mean)
    return f"{f.format(ci.mean)} [{f.format(ci.low)}, {f.format(ci.high)}]"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def num(x: float | None, digits: int = 3, sci: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.2e}" if sci and x != 0 and abs(x) < 1e-2 else f"{x:.{digits}f}"


def _range(lo: float, hi: float) -> str:
    return "–" if not (math.isfinite(lo) and math.isfinite(hi)) else f"[{lo:.2f}, {hi:.2f}]"


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _mean(xs) -> float:
    xs = _finite(xs)
    return sum(xs) / len(xs) if xs else math.nan


def _max(xs) -> float:
    return max(_finite(xs), default=math.nan)


def _min(xs) -> float:
    return min(_finite(xs), default=math.nan)


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


def write_figures(record: dict, results: list[RunResult], out: Path, panel: str | None = None,
                  curve: str | None = None) -> list[Path]:
    panel, curves = layout(record, panel, curve)
    figures = []
    axes = conditions(record)
    if "loss" in axes and "N" in axes:
        figures.append(headline_figure(record, results, out / "headline.png"))
    if LR_AXIS in axes:
        figures.append(lr_figure(record, results, lr_ranges(record, results), out / "lr.png"))
    for stem, metric, ylabel, logy in FIGURES:
        figures.append(curve_figure(record, results, panel, curves, metric, ylabel, logy, out / f"{stem}.png",
                                    record["name"]))
    return figures


# ---------------------------------------------------------------- one sweep's report


def write_report(sweep_dir: Path, out: Path, panel: str | None = None, curve: str | None = None) -> Path:
    record, results = read_sweep(sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = write_figures(record, results, out, panel, curve)
    path = out / "report.md"
    path.write_text(markdown(record, results, figures))
    return path


def markdown(record: dict, results: list[RunResult], figures: list[Path]) -> str:
    seeds = sorted({r.seed for r in results} - {""}, key=lambda s: (len(s), s))
    lines = [f"## Sweep `{record['name']}`", "",
             f"{len(results)} runs" + (f", seeds {', '.join(seeds)}" if seeds else "") + ". " + DEFINITIONS, "",
             condition_table(record, results), ""]
    paired = paired_table(record, results)
    if paired:
        (axis, value), = record["reference"].items()
        lines += [f"Paired differences against {axis} = {value} (same seed: same warm start and prompt order; "
                  "a - reference, mean over seeds with its 90% bootstrap interval):", "", paired, ""]
    lr = lr_table(record, results)
    if lr:
        lines += ["Learning-rate range (stable: every run at that lr finished without collapse):", "", lr, ""]
    lines += ["Runs:", "", run_table(record, results), ""]
    lines += [f"![{f.stem}]({f.name})" for f in figures]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command line


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR", help="directories written by `vespo sweep`")
    p.add_argument("--out", help="folder for report.md and the PNGs (default: SWEEP_DIR/report; with --page: "
                                 "results/ beside the page, one folder per sweep)")
    p.add_argument("--panel", help="grid axis with one panel per value (default: loss)")
    p.add_argument("--curve", help="grid axis with one curve per value (default: N)")
    p.add_argument("--page", help="write the results page (markdown) over all the sweeps")
    p.add_argument("--claims", help="claims file for the page's claims table (configs/lab/claims.yaml)")
    args = p.parse_args(argv)
    if len(args.sweep_dirs) > 1 and not args.page:
        p.error("several sweep directories need --page (one report per sweep goes beside the page)")
    if args.claims and not args.page:
        p.error("--claims needs --page")
    try:
        if args.page:
            from vespo.lab.page import write_page

            path = write_page([Path(d) for d in args.sweep_dirs], Path(args.page),
                              Path(args.claims) if args.claims else None, Path(args.out) if args.out else None,
                              "vespo report " + shlex.join(argv))
            print(f"wrote {path} and the sweeps' reports")
            return 0
        out = Path(args.out) if args.out else Path(args.sweep_dirs[0]) / "report"
        path = write_report(Path(args.sweep_dirs[0]), out, args.panel, args.curve)
    except (FileNotFoundError, ValueError) as e:
        print(f"vespo report: {e}", file=sys.stderr)
        return 2
    print(path.read_text().split("Runs:")[0])
    print(f"wrote {path} and its figures")
    return 0
