"""The tables and figures of a sweep (write_sweep), and the results page over several (write_page), worded by the
template page.md, whose sections are bound by name; the command `vespo report` is vespo.lab.cli.

A report is report.md (per condition and per run; docs/lab.md, `vespo report`), its figures and the sweep's
archive. The page puts every sweep's report in results/<name>/ beside it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd

from vespo.lab import claims as cl
from vespo.lab import collapse, stats
from vespo.lab.claims import SETTLED_BAND, settling
from vespo.lab.figures import write_figures
from vespo.lab.grid import Sweep
from vespo.lab.recommend import recommend, recommendation_markdown
from vespo.lab.runs import (ARCHIVE, EVAL, LR_AXIS, SEED_AXIS, TARGET_REWARD, TARGET_WINDOW, by_seed, conditions,
                            lr_points, lr_text, read_lab, write_archive)
from vespo.lab.stats import LEVEL, ci_text, mean_ci, paired, rate_ci

FINALS = {"eval_sampled": "held-out sampled", "eval_greedy": "held-out greedy", "train_last": "train (last quarter)"}
HEADLINE = "eval_sampled"  # the metric the report leads with, the claims' default and the one a sweep is sized on
IN_PROGRESS = "in_progress"  # results/in_progress/<sweep>: a sweep's report and archive while it still runs


def template(text: str) -> dict[str, str]:
    """The template's sections by name: "page" (before the first marker), then each ``<!-- the NAME section -->``."""
    page, *named = re.split(r"\n<!-- the (\w+) section -->\n", text.rstrip("\n"))
    return {"page": page, **dict(zip(named[::2], named[1::2]))}


# the words of the page and the reports, one string per section of the template
TEMPLATE = template(Path(__file__).with_name("page.md").read_text())
WORDS = {"level": LEVEL, "method": stats.METHOD, "reps": stats.COVERAGE_REPS, "min_seeds": stats.MIN_SEEDS,
         "alpha": stats.FAMILY_ERROR, "robust_share": cl.ROBUST_SHARE, "robust_seeds": cl.ROBUST_SEEDS,
         "band": SETTLED_BAND, "target": TARGET_REWARD, "window": TARGET_WINDOW,
         "rule": collapse.describe()}  # the constants the template's words name, given to every section


def write_page(paths: list[Path], page: Path, claims_path: Path | None, out_root: Path | None, command: str,
               draw: bool = True) -> Path:
    """The page (the template page.md, filled) and every sweep's report; ``draw=False`` leaves the figures out."""
    sweeps, runs = read_lab(paths)
    root = out_root or page.parent / "results"
    figures = {name: write_sweep(sweep, runs[runs.sweep == name], root / name, draw=draw)
               for name, sweep in sweeps.items()}
    for name in sweeps:
        shutil.rmtree(root / IN_PROGRESS / name, ignore_errors=True)
    claims = cl.load_claims(claims_path) if claims_path else None
    verdicts = cl.evaluate(claims, sweeps, runs) if claims else []
    rel = lambda path: os.path.relpath(path, page.parent)  # noqa: E731
    heads = {name: f for name, fs in figures.items() for f in fs if f.stem == "headline"}
    headline = (claims.headline if claims else None) or next(iter(heads), None)
    fig = heads.get(headline)
    text = TEMPLATE["page"].format(
        command=command, **WORDS, **judged(verdicts), **noise(sweeps, runs), **collapse_check(sweeps, runs),
        recommendation="" if claims is None else TEMPLATE["recommendation"].format(
            lines=recommendation_markdown(recommend(claims.recommend, sweeps, runs)), **WORDS),
        claims="" if claims is None else TEMPLATE["claims"].format(
            table=claims_table(verdicts, runs), **WORDS, together="\n\n".join(
                t for t in (together_text(verdicts, n, runs) for n in claims.read_together) if t)),
        headline="" if fig is None else TEMPLATE["headline"].format(figure=rel(fig), sweep=headline),
        sweeps=sweeps_table(sweeps, runs, root, page.parent),
        sections="\n\n".join(sweep_section(sweep, runs[runs.sweep == name], figures[name], rel,
                                           root / name / "report.md") for name, sweep in sweeps.items()))
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n")
    return page


def write_sweep(sweep: Sweep, runs: pd.DataFrame, out: Path, panel: str | None = None, curve: str | None = None,
                draw: bool = True) -> list[Path]:
    """A sweep's figures, report.md (the template's report section: its tables, every run, its figures) and
    archive in ``out``; files there that this did not write are removed."""
    out.mkdir(parents=True, exist_ok=True)
    figures = write_figures(sweep, runs, out, panel, curve) if draw else []
    seeds = sorted(set(runs.get("seed", pd.Series(dtype=str))) - {""}, key=lambda s: (len(s), s))
    (out / "report.md").write_text(TEMPLATE["report"].format(
        name=sweep.name, runs=len(runs), seeds=f", seeds {', '.join(seeds)}" if seeds else "", **WORDS,
        tables=sweep_tables(sweep, runs), run_table=run_table(sweep, runs),
        figures="".join(f"![{f.stem}]({f.name})\n" for f in figures)))
    made = {out / "report.md", write_archive(sweep, list(runs.record), out / ARCHIVE), *figures}
    for stale in sorted(p for p in out.iterdir() if p.is_file() and p not in made):
        stale.unlink()
    return figures


# ---------------------------------------------------------------- a sweep's tables


def markdown(rows: list[dict]) -> str:
    return pd.DataFrame(rows).to_markdown(index=False, tablefmt="github", disable_numparse=True) if rows else ""


def num(x: float | None, digits: int = 3, sci: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.2e}" if sci and x != 0 and abs(x) < 1e-2 else f"{x:.{digits}f}"


def _agg(values: pd.Series, how: str) -> float:  # over the finite values (nan for none)
    return float(values[np.isfinite(values.to_numpy(dtype=float))].agg(how))


def condition_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    """Per condition of the grid; runs "3 of 5 (1 not finished)": usable runs of the grid's, and those not done."""
    planned, rows = Counter(tuple(p.labels[a] for a in sweep.conditions) for p in sweep.points()), []
    for key, cell in conditions(sweep, runs, grid=True):
        u = cell[cell.usable]
        reasons = ", ".join(sorted(collapse.REASONS[x] for x in set(u[u.collapsed].reason)))
        lo, hi = _agg(u.log_w_min, "min"), _agg(u.log_w_max, "max")
        rows.append({**dict(zip(sweep.conditions, key)),
                     "runs": f"{len(u)}" + (f" of {planned[key]}" if len(u) < planned[key] else "")
                     + (f" ({len(cell) - len(u)} not finished)" if len(cell) > len(u) else ""),
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


def _reference_cells(sweep: Sweep, runs: pd.DataFrame):
    """(labels, runs, the reference condition's runs with the same other labels) per non-reference condition."""
    cells = dict(conditions(sweep, runs))
    for axis, ref in sweep.reference.items():  # one axis, or none
        for key, cell in cells.items():
            labels = dict(zip(sweep.conditions, key))
            if labels[axis] != ref:
                partner = tuple(ref if a == axis else labels[a] for a in sweep.conditions)
                yield labels, cell, cells.get(partner, runs.iloc[:0])


def reference_pairs(sweep: Sweep, runs: pd.DataFrame):
    """_reference_cells, where a seed whose two runs record different shared starts (runs.start_of) is left out of
    both: not a pair."""
    for labels, cell, partner in _reference_cells(sweep, runs):
        split = set(unpaired_starts(cell, partner))
        yield labels, cell[~cell[SEED_AXIS].isin(split)], partner[~partner[SEED_AXIS].isin(split)]


def unpaired_starts(cell: pd.DataFrame, partner: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """{seed: (its start in cell, in partner)} where both runs record a shared start and the two differ."""
    a, b = (dict(zip(c[SEED_AXIS], c.start)) if "start" in c else {} for c in (cell, partner))
    return {seed: (a[seed], b[seed]) for seed in a.keys() & b.keys() if a[seed] and b[seed] and a[seed] != b[seed]}


def start_note(sweep: Sweep, runs: pd.DataFrame) -> str:
    """A line per comparison that left seeds out because their runs trained from different starts."""
    axis, ref = next(iter(sweep.reference.items()), ("", ""))
    return "\n".join(TEMPLATE["unpaired_start"].format(
        condition=", ".join(f"{a} = {v}" for a, v in labels.items()), reference=f"{axis} = {ref}", seed=seed,
        mine=mine, theirs=theirs)
        for labels, cell, partner in _reference_cells(sweep, runs)
        for seed, (mine, theirs) in sorted(unpaired_starts(cell, partner).items()))


def paired_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    """Each condition minus the reference condition with the same other labels, seed by seed."""
    axis, rows = next(iter(sweep.reference), None), []
    for labels, cell, partner in reference_pairs(sweep, runs):
        d = {m: paired(by_seed(cell, m), by_seed(partner, m)) for m in FINALS}
        rows.append({**{a: v for a, v in labels.items() if a != axis}, axis: labels[axis],
                     **{f"Δ {name}": ci_text(d[m].diff, signed=True) for m, name in FINALS.items()},
                     "seeds": str(d["eval_sampled"].diff.n),
                     "higher in": f"{d['eval_sampled'].wins}/{d['eval_sampled'].diff.n}"})
    return markdown(rows)


def sizing_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    """Where the sweep file has `sizing`: per comparison with the reference, on HEADLINE, its shared seeds, mean
    paired difference and paired SD, and the seeds a paired t-test needs to detect |difference| = delta (the
    normal approximation and the exact noncentral t); then what delta is, beside the evaluation's own noise."""
    if (z := sweep.sizing) is None:
        return ""
    axis, name, rows = next(iter(sweep.reference), None), FINALS[HEADLINE], []
    for labels, cell, partner in reference_pairs(sweep, runs):
        d = paired(by_seed(cell, HEADLINE), by_seed(partner, HEADLINE)).values  # [shared seeds]
        sd = float(d.std(ddof=1)) if len(d) >= stats.MIN_SEEDS else math.nan
        need = stats.seeds_needed(sd, z.delta, z.power, z.alpha) if math.isfinite(sd) else None
        few = f"needs >= {stats.MIN_SEEDS} shared seeds"
        rows.append({**{a: v for a, v in labels.items() if a != axis}, axis: labels[axis], "shared seeds": str(len(d)),
                     f"mean Δ {name}": f"{d.mean():+.3f}" if len(d) else "–",
                     "paired SD": num(sd), "seeds needed (normal approximation)": str(need.normal) if need else few,
                     "seeds needed (exact, noncentral t)": str(need.exact) if need else few,
                     "resolves on these seeds": (f"{stats.detectable(len(d), sd, z.power, z.alpha):.3f}"
                                                 if need else few)})
    problems, p = evaluation(runs)
    se = math.sqrt(p * (1 - p) / problems) if problems and 0 < p < 1 else math.nan
    noise = TEMPLATE["sizing_noise"].format(problems=problems, p=p, se=se, ratio=z.delta / se, floor=math.sqrt(2) * se)
    return markdown(rows) + "\n\n" + TEMPLATE["sizing"].format(
        delta=z.delta, power=z.power, two_sided=z.alpha, metric=name, noise=noise if se > 0 else "", **WORDS)


def evaluation(runs: pd.DataFrame) -> tuple[int, float]:
    """(problems, mean accuracy) of the usable runs' final held-out evaluations: the task's eval_size most runs
    have (0 where none names it) and the mean of HEADLINE."""
    usable = runs[runs.usable & np.isfinite(runs[HEADLINE])]
    sizes = Counter(int((r.config.get("task") or {}).get("eval_size") or 0) for r in usable.record)
    return (sizes.most_common(1)[0][0] if sizes else 0), float(usable[HEADLINE].mean()) if len(usable) else math.nan


def settle_table(sweep: Sweep, runs: pd.DataFrame) -> str:
    rows = [{**dict(zip(sweep.conditions, key)), "last quarter minus the quarter before": ci_text(ci, signed=True),
             "curves": word} for key, cell in conditions(sweep, runs) for ci, word in [settling(cell)]]
    return markdown(rows) if any(r["curves"] != "–" for r in rows) else ""


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
                      "collapse": (f"{collapse.REASONS[r.reason]} at update {int(r.collapse_update)} ({r.evidence})"
                                   if r.collapsed else "no"),
                      "max grad norm": num(r.max_grad_norm), "mean ESS": num(r.ess), "final EOS rate": num(r.final_eos),
                      "seconds": num(r.seconds, digits=0)} for r in runs.itertuples()])


def sweep_tables(sweep: Sweep, runs: pd.DataFrame) -> str:
    """The tables the report and the page print for a sweep, below the sweep file's description."""
    reference = " = ".join(next(iter(sweep.reference.items()), ""))
    heads = TEMPLATE["tables"].format(reference=reference, metric=FINALS[HEADLINE], **WORDS).splitlines()
    tables = [paired_table(sweep, runs), sizing_table(sweep, runs), settle_table(sweep, runs), lr_table(sweep, runs)]
    tables[0] = "\n\n".join(filter(None, [tables[0], start_note(sweep, runs)])) if tables[0] else ""
    return "\n\n".join([*filter(None, [sweep.description, condition_table(sweep, runs)]),
                        *(f"{head}\n\n{table}" for head, table in zip(heads, tables) if table)])


# ---------------------------------------------------------------- how numbers are judged


def judged(verdicts: list[cl.Verdict]) -> dict:
    """The interval's simulated coverage, and the size of the page's Holm family."""
    table = stats.coverage_table()
    rows = [{"data": case, **{f"{c.seeds} seeds": f"{c.covered:.1%} (wholly above: {c.above:.1%})"
                              for c in table if c.case == case}} for case in stats.COVERAGE_CASES]
    first = {i: next(iter(v.readings.values()), []) for i, v in enumerate(verdicts, 1)}
    tests = [t for ts in first.values() for t in ts if t.verdict and t.n >= stats.MIN_SEEDS]
    listed = lambda numbers: ", ".join(map(str, numbers)) or "none"  # noqa: E731
    return {"coverage": markdown(rows), "tests": len(tests), "in_family": sum(any(t.verdict for t in ts) for ts in
                                                                         first.values()),
            "collapse_claims": listed([i for i, v in enumerate(verdicts, 1) if isinstance(v.claim, cl.Collapses)]),
            "stabler_claims": listed([i for i, v in enumerate(verdicts, 1) if isinstance(v.claim, cl.Stabler)]),
            "three": min(1.0, 3 * stats.FAMILY_ERROR),
            "collapsing": listed([i for i, ts in first.items() if any(t.verdict and t.collapsed for t in ts)]),
            "mix": next(c for c in table if c.case == list(stats.COVERAGE_CASES)[-1])}


def noise(sweeps: dict[str, Sweep], runs: pd.DataFrame) -> dict:
    """The binomial noise of one final evaluation, beside the paired differences the sweeps report: on the sweeps
    whose runs evaluate on the problem count most runs have (the others, fewer problems, named with theirs)."""
    usable = runs[runs.usable & np.isfinite(runs.eval_sampled)]
    size = pd.Series([int((r.config.get("task") or {}).get("eval_size") or 0) for r in usable.record],
                     index=usable.index)
    if usable.empty or not size.mode()[0]:
        return {"noise": "", "problems": "its held-out problems"}
    problems = int(size.mode()[0])
    of_sweep = size.groupby(usable.sweep).agg(lambda s: int(s.mode()[0]))
    others = of_sweep[of_sweep != problems]
    apart = "; ".join(f"{n} in {', '.join(f'`{w}`' for w in ws)}" for n, ws in
                      others.groupby(others).groups.items())
    usable = usable[usable.sweep.map(of_sweep) == problems]
    p = float(usable.eval_sampled.mean())
    sd = math.sqrt(2 * p * (1 - p) / problems)  # of a difference of two evaluations
    diffs = np.array([abs(paired(by_seed(a, "eval_sampled"), by_seed(b, "eval_sampled")).diff.mean)
                      for name, s in sweeps.items() if of_sweep.get(name) == problems
                      for _, a, b in reference_pairs(s, runs[runs.sweep == name])])
    diffs = diffs[np.isfinite(diffs)]
    fewer = TEMPLATE["noise_fewer"].format(apart=apart) if apart else ""
    return {"problems": f"its sweep's held-out problems ({problems}" + (f"; {apart}" if apart else "") + ")",
            "noise": TEMPLATE["noise"].format(
                problems=problems, sd=sd / math.sqrt(2), p=p, most=0.5 / math.sqrt(problems), sd2=sd,
                small=int((diffs < 2 * sd).sum()), diffs=len(diffs), two=2 * sd, median=np.median(diffs),
                fewer=fewer)}


def collapse_check(sweeps: dict[str, Sweep], runs: pd.DataFrame) -> dict:
    """The rule's simulated rates (and the previous rule's), and the rule against an independent criterion on the
    sweeps' own runs: the final evaluation below half the warm start's."""
    now, before = collapse.rates(collapse.RULE), collapse.rates(collapse.PREVIOUS)
    previous = ("the same collapse, flagged by the previous rule (half the best, 2 evaluations)",
                list(collapse.SCENARIOS)[-1], before)
    rows = [{"simulated run": name, **{f"flagged, {r.points} evaluations": f"{r.flagged:.1%}" for r in rates
                                       if r.scenario == scenario}}
            for name, scenario, rates in [(s, s, now) for s in collapse.SCENARIOS] + [previous]]
    usable = runs[runs.usable & np.isfinite(runs.warm_start) & np.isfinite(runs.eval_sampled)]
    fell = usable.eval_sampled < 0.5 * usable.warm_start
    missed, extra = usable[fell & ~usable.collapsed], usable[~fell & usable.collapsed]
    healthy = usable[usable.eval_sampled >= usable.warm_start]
    fired = [f"`{name}` {', '.join(k)}: {int(c.collapsed.sum())}/{len(c)}" for name, sweep in sweeps.items()
             for k, c in conditions(sweep, runs[(runs.sweep == name) & runs.usable])
             if 2 * c.collapsed.sum() >= len(c) > 0 and c.collapsed.any()]
    names = lambda frame: "; ".join(f"`{r.sweep}` `{r.run}` (final {r.eval_sampled:.3f}, warm start "  # noqa: E731
                                    f"{r.warm_start:.3f})" for r in frame.itertuples()) or "none"
    return {"sim_runs": now[0].runs, "simulated": markdown(rows), "checked": len(usable),
            "fell": int(fell.sum()), "missed": len(missed), "miss_rate": ci_text(rate_ci(len(missed), int(fell.sum()))),
            "missed_runs": names(missed), "healthy": len(healthy), "healthy_flagged": int(healthy.collapsed.sum()),
            "healthy_rate": ci_text(rate_ci(int(healthy.collapsed.sum()), len(healthy))), "extra": len(extra),
            "extra_runs": names(extra), "fired": len(fired), "controls": "; ".join(fired) or "nowhere yet",
            **partial_collapses(usable[~fell & (usable.eval_sampled < usable.warm_start)])}


def partial_collapses(partial: pd.DataFrame) -> dict:
    """The rule against the runs that ended below their warm start but not below half of it: how many it flags,
    and each it misses with its last and lowest evaluation during training over its best so far."""
    missed = partial[~partial.collapsed]
    slips = pd.DataFrame([fall_of(r) for r in missed.itertuples()], columns=["last", "lowest"])
    return {"partial": len(partial), "partial_flagged": int(partial.collapsed.sum()),
            "partial_missed": len(missed), "fraction": collapse.RULE.fraction,
            "partial_rate": ci_text(rate_ci(len(missed), len(partial))),
            "last_range": f"{slips['last'].min():.2f} to {slips['last'].max():.2f}" if len(slips) else "–",
            "dipped": int((slips.lowest < collapse.RULE.fraction).sum()),
            "partial_runs": "; ".join(f"`{r.sweep}` `{r.run}` (final {r.eval_sampled:.3f}, warm start "
                                      f"{r.warm_start:.3f}; last evaluation {s.last:.2f} of its best, lowest "
                                      f"{s.lowest:.2f})" for r, s in zip(missed.itertuples(), slips.itertuples()))
            or "none"}


def fall_of(run) -> tuple[float, float]:
    """A run's last and lowest held-out evaluation during training, each over its best so far (the warm start
    included): what the collapse rule compares with its fraction."""
    _, y = run.record.series(EVAL)
    if not len(y):
        return math.nan, math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = y / np.fmax.accumulate(np.r_[run.record.before, y])[1:]
    return float(ratio[-1]), float(np.nanmin(ratio))


# ---------------------------------------------------------------- claims and sweeps


def measured(v: cl.Verdict) -> str:
    """What a verdict rests on, in words: each test with its Holm-adjusted p, and the readings that differ: those
    on the other side of the line (they disagree in sign) apart from those that only fail to resolve."""
    if not v.readings:
        return v.text
    (metric, tests), *others = v.readings.items()
    text = ("collapses" if metric == "collapsed" else f"{metric} difference") + ": " + "; ".join(
        f"{t.name}: {t.text}" + (f" (Holm p {t.adjusted:.3f})" if math.isfinite(t.adjusted) else "") for t in tests)
    by = {m: cl.combine([t.outcome for t in ts]) for m, ts in v.readings.items()}
    if len(set(by.values())) > 1 and v.verdict not in (cl.NO_VERDICT, by[metric]):
        flipped = cl.other_side(v)
        text += f"; {by[metric]} on {cl.READINGS[metric]}, but " + "; ".join(
            f"{by[m]} on {cl.READINGS[m]} (" + "; ".join(f"{t.name} {ci_text(t.ci, signed=True)}" for t in ts) + ")"
            + (f", on the other side of the line in {', '.join(flipped[m])}" if flipped[m] else
               ", on the same side of the line" + ("" if by[m] in (cl.AGREES, cl.DISAGREES) else
                                                  ": it only fails to resolve"))
            for m, ts in others if by[m] != by[metric])
        if by[metric] not in (cl.AGREES, cl.DISAGREES) and not any(flipped.values()):
            text += f"; {cl.READINGS[metric]} only fails to resolve"
    return text


def budget(v: cl.Verdict, runs: pd.DataFrame) -> int:
    """The optimizer steps of the claim's sweep (0 where it has not run)."""
    return int(runs[runs.sweep == v.claim.sweep].updates.max()) if (runs.sweep == v.claim.sweep).any() else 0


def together_text(verdicts: list[cl.Verdict], numbers: list[int], runs: pd.DataFrame) -> str:
    """Claims that make the same comparison at different budgets (optimizer steps), read side by side, the shorter
    budget also on the longer one's seeds (the pair compared: same seeds, two budgets)."""
    vs = {i: verdicts[i - 1] for i in numbers if budget(verdicts[i - 1], runs)}
    updates = {i: budget(v, runs) for i, v in vs.items()}
    lines = []
    for name in dict.fromkeys(t.name for v in vs.values() for t in next(iter(v.readings.values()), [])):
        seen = sorted(((i, t) for i, v in vs.items() for t in next(iter(v.readings.values())) if t.name == name),
                      key=lambda x: updates[x[0]])
        if len(seen) < 2:
            continue
        lines.append(f"{name}: " + "; ".join(f"after {updates[i]} updates {t.text} (claim {i}: {vs[i].verdict})"
                                            for i, t in seen) + ".")
        (i1, t1), (i2, t2) = seen[0], seen[-1]
        if t1.values is not None and t2.values is not None and len(t2.values) < len(t1.values):
            t1 = cl.Test(t1.name, "", t1.p, t1.side, 0, 0.0, ci=mean_ci(t1.values[t1.values.index.isin(
                t2.values.index)]))  # the shorter budget on the longer one's seeds
            lines.append(f"On the {t1.ci.n} seeds both budgets ran, after {updates[i1]} updates: "
                         f"{ci_text(t1.ci, signed=True)}.")
        if t1.ci and t2.ci and t1.ci.resolved and t2.ci.resolved:
            has0 = [ci.low <= 0 <= ci.high for ci in (t1.ci, t2.ci)]
            apart = t1.ci.high < t2.ci.low or t2.ci.high < t1.ci.low or has0[0] != has0[1]
            lines.append(f"So on {t2.ci.n} paired seeds it lies between {t1.ci.low:+.3f} and {t1.ci.high:+.3f} after "
                         f"{updates[i1]} updates and between {t2.ci.low:+.3f} and {t2.ci.high:+.3f} after "
                         f"{updates[i2]}" + (": what the shorter runs measure does not hold for the longer ones."
                                             if apart else ": the two budgets agree within their intervals."))
    return (f"**Claims {', '.join(map(str, numbers))} read together** (the same comparison at different budgets): "
            + " ".join(lines)) if lines else ""


def claims_table(verdicts: list[cl.Verdict], runs: pd.DataFrame) -> str:
    return markdown([{"#": str(i), "the paper says": v.claim.paper, "sweep": v.claim.sweep,
                      "updates": str(budget(v, runs) or "–"), "we measured": measured(v).replace("|", "\\|"),
                      "agrees?": f"**{v.verdict}**", "robustness": v.robustness or "–"}
                     for i, v in enumerate(verdicts, 1)])


def sweeps_table(sweeps: dict[str, Sweep], runs: pd.DataFrame, root: Path, page_dir: Path) -> str:
    return markdown([{"sweep": f"`{name}`", "file": f"`{sweep.source}`", "runs finished / in grid":
                      f"{int((runs[runs.sweep == name].status == 'done').sum())} / {len(sweep.points())}",
                      "wall time": wall_text(sweep.sessions, runs[runs.sweep == name]),
                      "commit": commit_text(sweep.sessions), "machine": "; ".join(dict.fromkeys(
                          f"{m.get('node', '?')} ({m.get('cpus', '?')} CPUs, torch {m.get('torch', '?')})"
                          for m in (x.get("machine") or {} for x in sweep.sessions))) or "not recorded",
                      "report": f"[report]({os.path.relpath(root / name / 'report.md', page_dir)})"}
                     for name, sweep in sweeps.items()])


def wall_text(sessions: list[dict], runs: pd.DataFrame) -> str:
    runs_min = f"runs {sum(float(r.summary.get('seconds') or 0) for r in runs.record) / 60:.0f} min in all"
    if not sessions:
        return f"not recorded ({runs_min})"
    killed = sum(x.get("end") is None for x in sessions)
    return (f"{sum(float(x.get('seconds') or 0) for x in sessions) / 60:.0f} min"
            + (f", {len(sessions)} calls" if len(sessions) > 1 else "")
            + (f", {killed} killed (counted to the last time seen alive)" if killed else "") + f" ({runs_min})")


def commit_text(sessions: list[dict]) -> str:
    seen = dict.fromkeys((x.get("commit") or "unknown")[:9] + (" (dirty)" if x.get("dirty") else "") for x in sessions)
    return ", ".join(f"`{c}`" for c in seen) or "not recorded"


def sweep_section(sweep: Sweep, runs: pd.DataFrame, figures: list[Path], rel, report: Path) -> str:
    """The sweep's section of the page (the template's sweep section): how it ran, its tables, its figures."""
    ran = "No sessions.jsonl: commands, commit and wall time were not recorded for this sweep."
    if s := sweep.sessions:
        commands = "\n".join(f"    {c}" for c in dict.fromkeys(x["command"] for x in s))
        ran = TEMPLATE["sessions"].format(commands=commands, start=_when(s[0].get("start", "?")),
                                          wall=wall_text(s, runs), commit=commit_text(s),
                                          end=_when(s[-1].get("end") or s[-1].get("last_seen") or "?"))
    return TEMPLATE["sweep"].format(name=sweep.name, ran=ran, tables=sweep_tables(sweep, runs), report=rel(report),
                                    lr="".join(f"![lr]({rel(f)})" for f in figures if f.stem == "lr"),
                                    figures=", ".join(f"[{f.stem}]({rel(f)})" for f in figures))


def _when(iso: str) -> str:
    try:
        return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        return iso
