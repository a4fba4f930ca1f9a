"""The tables of a sweep in markdown (pandas' to_markdown), one home for what the report and the page print:
condition_table (per condition: the finals with their intervals, time to the target reward, collapses,
diagnostics), paired_table (each condition minus the reference, seed by seed), settle_table (do the curves
settle), lr_table (the collapse rate at each learning rate), run_table.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from vespo.lab import collapse, stats
from vespo.lab.claims import SETTLED_BAND, settling
from vespo.lab.grid import Sweep
from vespo.lab.runs import TARGET_REWARD, TARGET_WINDOW, by_seed
from vespo.lab.stats import ci_text, mean_ci, paired, rate_ci

LR_AXIS = "lr"
FINALS = {"eval_sampled": "held-out sampled", "eval_greedy": "held-out greedy", "train_last": "train (last quarter)"}


def markdown(rows: list[dict]) -> str:
    return pd.DataFrame(rows).to_markdown(index=False, tablefmt="github", disable_numparse=True) if rows else ""


def num(x: float | None, digits: int = 3, sci: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.2e}" if sci and x != 0 and abs(x) < 1e-2 else f"{x:.{digits}f}"


def conditions(sweep: Sweep, runs: pd.DataFrame, axes: list[str] | None = None,
               grid: bool = False) -> list[tuple[tuple, pd.DataFrame]]:
    """(labels, runs) per condition (the sweep's axes but the seed, or ``axes``), in grid order; ``grid``: the
    grid's conditions without runs too (no rows)."""
    axes = sweep.conditions if axes is None else axes
    if not axes:
        return [((), runs)]
    order = [{v: i for i, v in enumerate(sweep.values.get(a, []))} for a in axes]
    groups = {k if isinstance(k, tuple) else (k,): g for k, g in runs.groupby(axes, sort=False)}
    for key in (tuple(p.labels[a] for a in axes) for p in sweep.points()) if grid else []:
        groups.setdefault(key, runs.iloc[:0])
    return sorted(groups.items(), key=lambda kg: tuple(o.get(v, len(o)) for o, v in zip(order, kg[0])))


def _agg(values: pd.Series, how: str) -> float:
    finite = values[np.isfinite(values.to_numpy(dtype=float))]
    return float(getattr(finite, how)()) if len(finite) else math.nan


def condition_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    """Per condition of the grid; "3 of 5 (+1 not finished)": usable runs of the grid's, and the runs still going."""
    planned, rows = Counter(tuple(p.labels[a] for a in sweep.conditions) for p in sweep.points()), []
    for key, cell in conditions(sweep, runs, grid=True):
        u = cell[cell.usable]
        reasons = ", ".join(sorted(set(u[u.collapsed].reason)))
        lo, hi = _agg(u.log_w_min, "min"), _agg(u.log_w_max, "max")
        rows.append({**dict(zip(sweep.conditions, key)),
                     "runs": f"{len(u)}" + (f" of {planned[key]}" if len(u) < planned[key] else "")
                     + (f" (+{len(cell) - len(u)} not finished)" if len(cell) > len(u) else ""),
                     **{name: ci_text(mean_ci(by_seed(cell, m))) for m, name in FINALS.items()},
                     **{f"{what} to {TARGET_REWARD:g}": reached_text(cell, f"{what}_to_target")
                        for what in ("updates", "seconds")},
                     "collapsed": f"{int(u.collapsed.sum())}/{len(u)}" + (f" ({reasons})" if reasons else ""),
                     "max grad norm": num(_agg(u.max_grad_norm, "max")), "mean ESS": num(_agg(u.ess, "mean")),
                     "log W range": f"[{lo:.2f}, {hi:.2f}]" if math.isfinite(lo + hi) else "–",
                     "stale KL k3": num(_agg(u.final_kl, "mean"), sci=True),
                     "engine KL k3": num(_agg(u.final_engine_kl, "mean"), sci=True)})
    return markdown(rows)


def reached_text(runs: pd.DataFrame, metric: str) -> str:
    """Mean [interval] over the runs that reached the target, "(k/n)" when not all did; "never (0/n)"."""
    values = by_seed(runs, metric)
    reached = values[np.isfinite(values)]
    if not len(reached):
        return f"never (0/{len(values)})" if len(values) else "–"
    some = f" ({len(reached)}/{len(values)})" if len(reached) < len(values) else ""
    return ci_text(mean_ci(reached), digits=0) + some


def reference_pairs(sweep: Sweep, runs: pd.DataFrame):
    """(labels, runs, the reference condition's runs with the same other labels) per non-reference condition."""
    (axis, ref), = sweep.reference.items()
    cells = dict(conditions(sweep, runs))
    for key, cell in cells.items():
        labels = dict(zip(sweep.conditions, key))
        if labels[axis] != ref:
            partner = tuple(ref if a == axis else labels[a] for a in sweep.conditions)
            yield labels, cell, cells.get(partner, runs.iloc[:0])


def paired_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    """Each condition minus the reference condition with the same other labels, seed by seed."""
    if not sweep.reference:
        return ""
    (axis, _), rows = next(iter(sweep.reference.items())), []
    for labels, cell, partner in reference_pairs(sweep, runs):
        d = {m: paired(by_seed(cell, m), by_seed(partner, m)) for m in FINALS}
        rows.append({**{a: v for a, v in labels.items() if a != axis}, axis: labels[axis],
                     **{f"Δ {name}": ci_text(d[m].diff, signed=True) for m, name in FINALS.items()},
                     "seeds": str(d["eval_sampled"].diff.n),
                     "higher in": f"{d['eval_sampled'].wins}/{d['eval_sampled'].diff.n}"})
    return markdown(rows)


def settle_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    rows = [{**dict(zip(sweep.conditions, key)), "last quarter minus the quarter before": ci_text(ci, signed=True),
             "curves": word} for key, cell in conditions(sweep, runs) for ci, word in [settling(cell)]]
    return markdown(rows) if any(r["curves"] != "–" for r in rows) else ""


def lr_text(lr: float) -> str:
    """5e-05 -> "5e-5", 0.00025 -> "2.5e-4"."""
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def lr_of(runs: pd.DataFrame) -> pd.Series:
    """Each run's learning rate: its config's optim.lr, else its lr label."""
    lr = runs.record.map(lambda r: float((r.config.get("optim") or {}).get("lr", math.nan)))
    return lr.fillna(pd.to_numeric(runs[LR_AXIS], errors="coerce"))


def lr_points(runs: pd.DataFrame) -> pd.DataFrame:
    """Per learning rate (ascending): usable runs, runs not finished, collapsed runs."""
    out = runs.assign(lr_value=lr_of(runs), dead=runs.collapsed & runs.usable).groupby("lr_value").agg(
        runs=("usable", "sum"), total=("usable", "size"), collapsed=("dead", "sum"))
    return out.assign(missing=out.total - out.runs)


def lr_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    """Per condition but the lr, the collapse rate at each lr with its exact interval."""
    if LR_AXIS not in sweep.conditions:
        return ""
    others = [a for a in sweep.conditions if a != LR_AXIS]
    return markdown([{**dict(zip(others, key)), **{lr_text(lr): f"{p.collapsed}/{p.runs}: "
                                                   f"{ci_text(rate_ci(int(p.collapsed), int(p.runs)), digits=2)}"
                                                   + (f" (+{p.missing})" if p.missing else "")
                                                   for lr, p in lr_points(cell).iterrows()}}
                     for key, cell in conditions(sweep, runs, others)])


def run_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    return markdown([{"run": f"`{r.run}`", "status": r.status, "logged steps": str(len(r.record.rows or [])),
                      **{name: num(getattr(r, m)) for m, name in FINALS.items()}, "best train": num(r.best_reward),
                      f"updates to {TARGET_REWARD:g}": num(r.updates_to_target, digits=0),
                      "collapse": f"{r.reason} at update {r.collapse_update} ({r.evidence})" if r.collapsed else "no",
                      "max grad norm": num(r.max_grad_norm), "mean ESS": num(r.ess), "final EOS rate": num(r.final_eos),
                      "seconds": num(r.seconds, digits=0)} for r in runs.itertuples()])


def sweep_tables(sweep: Sweep, runs: pd.DataFrame) -> list[str]:
    """The tables the report and the page print for a sweep, below the sweep file's description."""
    level = f"{stats.CONFIDENCE:.0%}"
    parts = [("", condition_table(sweep, runs)),
             (f"Paired differences against {' = '.join(next(iter(sweep.reference.items()), ''))} (same seed: same warm "
              f"start and prompt order; a - reference, mean over seeds with its {level} interval):",
              paired_table(sweep, runs)),
             (f"Do the curves settle? The mean held-out evaluation (during training) of the last quarter of the "
              f"updates minus that of the quarter before, with its {level} interval: *settled* where the interval lies "
              f"within ±{SETTLED_BAND:g}, *still rising* where it lies above 0:", settle_table(sweep, runs)),
             (f"Collapsed runs at each learning rate, with the rate's exact {level} interval (+ runs not finished):",
              lr_table(sweep, runs))]
    return ([sweep.description, ""] if sweep.description else []) + [
        line for head, table in parts if table for line in ([head, ""] if head else []) + [table, ""]]


def sweep_markdown(sweep: Sweep, runs: pd.DataFrame, figures: list[Path]) -> str:
    """report.md: the sweep's tables, every run, its figures."""
    seeds = sorted(set(runs.get("seed", pd.Series(dtype=str))) - {""}, key=lambda s: (len(s), s))
    definitions = (
        f"Mean over seeds with its {stats.CONFIDENCE:.0%} interval in brackets ({stats.METHOD}). Held-out = accuracy "
        "on the task's held-out problems after the last update (one sample per problem, and greedy); train = "
        "training reward over the last quarter of the optimizer steps (the same samples at every N). Updates / "
        f"seconds to {TARGET_REWARD:g} = optimizer steps and training wall time until the training reward over a "
        f"window of {TARGET_WINDOW} updates first reaches {TARGET_REWARD:g}, over the runs that reach it (how many, "
        f"in parentheses, when not all). {collapse.describe()}; a run stopped for non-finite updates counts as "
        "reward 0. KL k3 = mean(exp(d) - 1 - d) per token, between the behavior and the updated policy (stale) or "
        "rollout engine and trainer (engine), over the last quarter.")
    lines = [f"## Sweep `{sweep.name}`", "", f"{len(runs)} runs" + (f", seeds {', '.join(seeds)}" if seeds else "")
             + ". " + definitions, "", *sweep_tables(sweep, runs), "Runs:", "", run_table(sweep, runs), ""]
    return "\n".join(lines + [f"![{f.stem}]({f.name})" for f in figures]) + "\n"
