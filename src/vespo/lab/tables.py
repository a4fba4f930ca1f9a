"""The tables of a sweep, in markdown: one home for what the report and the results page print.

    condition_table(record, results)    per condition: the finals with their intervals, time to the
                                        target reward, collapses and diagnostics
    paired_table(record, results)       each condition minus the reference condition, seed by seed
    lr_table(record, results)           per loss: the stable lr range and the collapse rate per lr
    run_table(record, results)          one row per run
    sweep_markdown(record, results, figures)   a sweep's whole report.md

The prose beside them (`definitions`) is written from the objects that decide it: the interval's
method and level (vespo.lab.stats), the collapse rule (vespo.lab.collapse.RULE) and the time-to-
accuracy target (vespo.lab.results.TARGET_REWARD).
"""

from __future__ import annotations

import math
from pathlib import Path

from vespo.lab import collapse, stats
from vespo.lab.lr_range import LR_AXIS, lr_ranges, lr_text
from vespo.lab.results import TARGET_REWARD, TARGET_WINDOW, RunResult, by_seed, conditions, group, order
from vespo.lab.stats import Interval, mean_ci, paired_difference, rate_ci


def definitions() -> str:
    level = f"{stats.CONFIDENCE:.0%}"
    return (
        f"Mean over seeds with its {level} interval in brackets ({stats.METHOD}). Held-out = accuracy on the "
        "task's held-out problems after the last update (one sample per problem, and greedy); train = training "
        "reward over the last quarter of the optimizer steps (the same samples at every N). Updates / seconds to "
        f"{TARGET_REWARD:g} = optimizer steps and training wall time until the training reward over a window of "
        f"{TARGET_WINDOW} updates first reaches {TARGET_REWARD:g}, over the runs that reach it (how many, in "
        f"parentheses, when not all). {collapse.describe()}; a run stopped for non-finite updates counts "
        "as reward 0. KL k3 = mean(exp(d) - 1 - d) per token, between the behavior and the updated policy (stale) or "
        "rollout engine and trainer (engine), over the last quarter.")


# ---------------------------------------------------------------- per condition


def condition_table(record: dict, results: list[RunResult]) -> str:
    axes = conditions(record)
    head = axes + ["runs", "held-out sampled", "held-out greedy", "train (last quarter)",
                   f"updates to {TARGET_REWARD:g}", f"seconds to {TARGET_REWARD:g}", "collapsed", "max grad norm",
                   "mean ESS", "log W range", "stale KL k3", "engine KL k3"]
    lines = [row(head), row(["---"] * len(head))]
    groups = group(results, axes)
    for key in sorted(groups, key=lambda k: order(record, axes, k)):
        lines.append(row(list(key) + _condition_cells(groups[key])))
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
            reached_text(runs, "updates_to_target", digits=0), reached_text(runs, "seconds_to_target", digits=0),
            f"{sum(r.collapse.collapsed for r in usable)}/{len(usable)}" + (f" ({', '.join(reasons)})" if reasons else ""),
            num(_max(x["max_grad_norm"] for x in s)), num(_mean([x["ess"] for x in s])),
            _range(_min(x["log_w_min"] for x in s), _max(x["log_w_max"] for x in s)),
            num(_mean([x["final_kl"] for x in s]), sci=True), num(_mean([x["final_engine_kl"] for x in s]), sci=True)]


def reached_text(runs: list[RunResult], metric: str, digits: int = 0) -> str:
    """Mean [interval] over the runs that reached the target, "(k/n)" when not all did; "never (0/n)"."""
    values = list(by_seed(runs, metric).values())
    reached = [v for v in values if math.isfinite(v)]
    if not values:
        return "–"
    if not reached:
        return f"never (0/{len(values)})"
    text = ci_text(mean_ci(reached), digits=digits)
    return text + (f" ({len(reached)}/{len(values)})" if len(reached) < len(values) else "")


# ---------------------------------------------------------------- paired against the reference


def paired_table(record: dict, results: list[RunResult]) -> str:
    """Each condition minus the reference condition with the same other labels, seed by seed."""
    ref = record.get("reference") or {}
    if not ref:
        return ""
    (axis, ref_value), = ref.items()
    axes = conditions(record)
    others = [a for a in axes if a != axis]
    head = others + [axis, "Δ held-out sampled", "Δ held-out greedy", "Δ train (last quarter)", "seeds", "higher in"]
    lines = [row(head), row(["---"] * len(head))]
    groups = group(results, axes)
    for key in sorted(groups, key=lambda k: order(record, axes, k)):
        labels = dict(zip(axes, key))
        if labels[axis] == ref_value:
            continue
        partner = groups.get(tuple(ref_value if a == axis else labels[a] for a in axes), [])
        diffs = [paired_difference(by_seed(groups[key], m), by_seed(partner, m))
                 for m in ("eval_sampled", "eval_greedy", "train_last")]
        lines.append(row([labels[a] for a in others] + [labels[axis]] + [ci_text(d.diff, signed=True) for d in diffs]
                         + [str(diffs[0].diff.n), f"{diffs[0].wins}/{diffs[0].diff.n}"]))
    return "\n".join(lines)


# ---------------------------------------------------------------- the learning-rate range


def lr_table(record: dict, results: list[RunResult]) -> str:
    if LR_AXIS not in conditions(record):
        return ""
    ranges = lr_ranges(record, results)
    names = list(ranges[0].condition) if ranges else []
    level = f"{stats.CONFIDENCE:.0%}"
    head = names + ["stable lr range", "width", "best held-out sampled in it",
                    f"per lr: collapsed/runs, rate [{level} exact interval]"]
    lines = [row(head), row(["---"] * len(head))]
    for r in ranges:
        span = "none" if r.low is None else f"{lr_text(r.low)} to {lr_text(r.high)}"
        best = "–" if r.best is None else f"{ci_text(r.best.reward)} at {lr_text(r.best.lr)}"
        per_lr = ", ".join(f"{lr_text(p.lr)}: {p.collapsed}/{p.runs} {_rate(p.collapsed, p.runs)}"
                           + (f" (+{p.missing})" if p.missing else "") for p in r.points)
        lines.append(row(list(r.condition.values()) + [span, "–" if r.low is None else f"{r.width:.3g}x", best, per_lr]))
    return "\n".join(lines)


def _rate(k: int, n: int) -> str:
    r = rate_ci(k, n)
    return "" if r.n == 0 else f"[{r.low:.2f}, {r.high:.2f}]"


# ---------------------------------------------------------------- per run


def run_table(record: dict, results: list[RunResult]) -> str:
    head = ["run", "status", "logged steps", "held-out sampled", "held-out greedy", "train (last quarter)",
            "best train", f"updates to {TARGET_REWARD:g}", "collapse", "max grad norm", "mean ESS", "final EOS rate",
            "seconds"]
    lines = [row(head), row(["---"] * len(head))]
    for r in results:
        s = r.stats
        seconds = r.run.summary.get("seconds") if r.run is not None else None
        lines.append(row([f"`{r.name}`", r.status, str(len(r.run.rows)) if r.run else "0",
                          num(s.get("eval_sampled")), num(s.get("eval_greedy")), num(s.get("train_last")),
                          num(s.get("best_reward")), num(s.get("updates_to_target"), digits=0), run_collapse_text(r),
                          num(s.get("max_grad_norm")), num(s.get("ess")), num(s.get("final_eos")),
                          num(seconds, digits=0)]))
    return "\n".join(lines)


def run_collapse_text(r: RunResult) -> str:
    c = r.collapse
    if not c.collapsed:
        return "no"
    where = f"update {c.update}" if c.update is not None else f"point {c.step}"
    return f"{c.reason} at {where}" + (f" ({c.evidence})" if c.evidence else "")


# ---------------------------------------------------------------- a sweep's tables and report


def sweep_tables(record: dict, results: list[RunResult]) -> list[str]:
    """The condition table, the paired differences and the lr range: the lines both the report and
    the results page print for a sweep, below the sweep file's description when it has one."""
    lines = [record["description"], ""] if record.get("description") else []
    lines += [condition_table(record, results), ""]
    paired = paired_table(record, results)
    if paired:
        (axis, value), = record["reference"].items()
        lines += [f"Paired differences against {axis} = {value} (same seed: same warm start and prompt order; "
                  f"a - reference, mean over seeds with its {stats.CONFIDENCE:.0%} interval):", "", paired, ""]
    lr = lr_table(record, results)
    if lr:
        lines += ["Learning-rate range (stable: every run at that lr finished without collapse):", "", lr, ""]
    return lines


def sweep_markdown(record: dict, results: list[RunResult], figures: list[Path]) -> str:
    seeds = sorted({r.seed for r in results} - {""}, key=lambda s: (len(s), s))
    lines = [f"## Sweep `{record['name']}`", "",
             f"{len(results)} runs" + (f", seeds {', '.join(seeds)}" if seeds else "") + ". " + definitions(), ""]
    lines += sweep_tables(record, results)
    lines += ["Runs:", "", run_table(record, results), ""]
    lines += [f"![{f.stem}]({f.name})" for f in figures]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- cells


def ci_text(ci: Interval, signed: bool = False, digits: int = 3) -> str:
    """"0.512 [0.470, 0.551]"; "+0.031 [-0.010, +0.070]" when signed; a lone value has no interval."""
    if ci.n == 0 or not math.isfinite(ci.mean):
        return "–"
    f = ("{:+." if signed else "{:.") + f"{digits}f}}"
    if not ci.resolved:
        return f.format(ci.mean)
    return f"{f.format(ci.mean)} [{f.format(ci.low)}, {f.format(ci.high)}]"


def row(cells: list[str]) -> str:
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
