"""The results page: the paper's claims against the lab's sweeps, regenerated from the sweep directories.

    vespo report runs/lab/* --claims configs/lab/claims.yaml --page docs/results.md

writes every sweep's report (tables and figures) and its archive (runs.json.gz, which a later
`vespo report` reads in place of the sweep directory) into results/<sweep name>/ beside the page,
removing files there that it no longer makes (and results/in_progress/<sweep name>/, the report and
archive of a sweep committed while it was still running, which its place on the page supersedes), and
the page itself: the recommendation
(vespo.lab.recommend), how numbers are judged (the interval with its simulated coverage, the
collapse rule with its simulated false-positive rate, where it fired and which flagged runs look
suspect), the claims table (vespo.lab.claims), the headline figure, and per sweep its commands,
the git commit of the code that ran it, its wall time (from the sweep's sessions.jsonl) and the
same tables as its report (vespo.lab.tables).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
from datetime import datetime
from pathlib import Path

from vespo.lab import claims as claims_mod
from vespo.lab import collapse, simulate, stats
from vespo.lab.figures import write_figures
from vespo.lab.grid import planned
from vespo.lab.recommend import recommend, recommendation_markdown
from vespo.lab.results import ARCHIVE, RunResult, conditions, group, read_sweep, write_archive
from vespo.lab.tables import ci_text, row, sweep_markdown, sweep_tables

IN_PROGRESS = "in_progress"  # results/in_progress/<sweep>: a sweep's report and archive while it still runs

SIM_RUNS = 500  # simulated runs per scenario for the collapse rule's rates ...
SIM_NS = (1, 64)  # ... and the N of the training-reward evidence


def machine_note() -> str:
    return (
        "**Single runs are not results.** The same run gives different numbers on different machines: float "
        "rounding (another CPU, thread count or library build sums in another order) changes the last bits of a "
        "log-prob, and under stale updates such differences grow chaotically, so one seed can collapse on one "
        "machine and finish well on another. Every claim below therefore rests on the distribution over seeds: "
        f"the mean with a {stats.CONFIDENCE:.0%} interval, differences paired by seed (one seed = the same "
        "warm-started weights and the same prompt order in every condition), and collapse counts. \"Not resolved\" "
        "means the seeds do not settle the question, not that the effect is absent.")


FINAL_NOTE = (
    "**Final** means the same at every N: *held-out sampled* is the accuracy on the task's held-out problems "
    "(task.eval_size of them, one sample each at the training temperature) after the run's last update, and "
    "every run of a sweep takes the same number of optimizer steps; *held-out greedy* the same with greedy "
    "decoding; *train* is the training reward over the last quarter of the optimizer steps, the same number "
    "of samples at every N. Beside it, *updates / seconds to* a training reward say how fast a run got there. "
    "Claims use held-out sampled unless the row says otherwise.")


def write_page(sweep_dirs: list[Path], page: Path, claims_path: Path | None, out_root: Path | None,
               command: str) -> Path:
    sweeps: dict[str, tuple[dict, list[RunResult]]] = {}
    for d in sweep_dirs:
        record, results = read_sweep(d)
        if record["name"] in sweeps:
            raise ValueError(f"two sweep directories are named {record['name']!r}: {sweeps[record['name']][0]['dir']} "
                             f"and {d}")
        sweeps[record["name"]] = (record, results)
    root = out_root or page.parent / "results"
    figures = {name: write_sweep(record, results, root / name) for name, (record, results) in sweeps.items()}
    for name in sweeps:
        if (root / IN_PROGRESS / name).is_dir():
            shutil.rmtree(root / IN_PROGRESS / name)
    claims = claims_mod.load_claims(claims_path) if claims_path else None
    verdicts = claims_mod.evaluate(claims, sweeps) if claims else []
    picks = recommend(claims.recommend, sweeps) if claims else []
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(page_markdown(sweeps, figures, claims, verdicts, picks, page.parent, root, command))
    return page


def write_sweep(record: dict, results: list[RunResult], out: Path) -> list[Path]:
    """A sweep's figures, report.md and archive (runs.json.gz) in ``out``; files there that this did not
    write are removed."""
    out.mkdir(parents=True, exist_ok=True)
    figures = write_figures(record, results, out)
    report = out / "report.md"
    report.write_text(sweep_markdown(record, results, figures))
    made = {report, write_archive(record, results, out / ARCHIVE), *figures}
    for stale in sorted(p for p in out.iterdir() if p.is_file() and p not in made):
        stale.unlink()
    return figures


def page_markdown(sweeps: dict, figures: dict[str, list[Path]], claims, verdicts, picks, page_dir: Path, root: Path,
                  command: str) -> str:
    def rel(path: Path) -> str:
        return os.path.relpath(path, page_dir)

    lines = ["# Results: the paper's claims at small scale", "",
             f"Generated by `{command}` from the sweep directories below; edit the sweep files or the claims "
             "file and regenerate rather than editing this page. How the lab works: [lab.md](lab.md).", ""]
    if claims is not None:
        lines += ["## Recommendation", "", recommendation_markdown(picks), ""]
    lines += [machine_note(), "", FINAL_NOTE, ""]
    lines += ["## How the numbers are judged", "", *statistics_section(), *collapse_section(sweeps)]
    if claims is not None:
        lines += ["## The paper's claims", "", claims_table(verdicts), "", claims_mod.rules_text(), ""]
    headline = (claims.headline if claims else None) or next(
        (n for n, figs in figures.items() if any(f.stem == "headline" for f in figs)), None)
    fig = next((f for f in figures.get(headline, []) if f.stem == "headline"), None)
    if fig is not None:
        lines += ["## Headline: final accuracy against staleness", "", f"![headline]({rel(fig)})", "",
                  f"Sweep `{headline}`. Left, top: held-out accuracy after training against N, per loss: seed mean "
                  f"with its {stats.CONFIDENCE:.0%} band, collapsed runs as x. Left, bottom: each loss minus the "
                  "reference loss at each N, paired by seed, with its interval (the comparison the claims rest on: "
                  "levels whose bands overlap can still differ clearly seed by seed). Right: the training reward per "
                  "N against optimizer steps (the same steps and samples at every N), seed mean with its min-max "
                  "band.", ""]
    lines += ["## Sweeps", "", sweeps_table(sweeps, root, page_dir), ""]
    for name, (record, results) in sweeps.items():
        lines += sweep_section(record, results, figures[name], rel, root / name / "report.md")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- how numbers are judged


def statistics_section() -> list[str]:
    """The interval's method and its coverage, simulated now by the code that computes the intervals."""
    table = stats.coverage_table()
    level = f"{stats.CONFIDENCE:.0%}"
    head = ["data"] + [f"{n} seeds" for n in stats.COVERAGE_SEEDS]
    lines = [row(head), row(["---"] * len(head))]
    for case in stats.COVERAGE_CASES:
        cells = [c for c in table if c.case == case]
        lines.append(row([case] + [f"{c.covered:.1%} (wholly above: {c.above:.1%})" for c in cells]))
    return [f"**Intervals.** Every interval on this page is a {stats.METHOD} at {level} (vespo.lab.stats). Its "
            f"coverage at the lab's seed counts, simulated with {stats.COVERAGE_REPS:,} experiments per cell (the share "
            "of intervals that hold the true mean; in parentheses the share wholly above it, i.e. a false \"greater\"):",
            "", "\n".join(lines), "",
            "On normal and moderately skewed data it covers close to its nominal level at 3 seeds already; on strongly "
            "skewed data it covers less, and the misses fall mostly below the mean (a false \"less\", not a false "
            f"\"greater\"). Fewer than {stats.MIN_SEEDS} seeds give no interval: such a claim reads \"too few seeds\".",
            ""]


def collapse_section(sweeps: dict) -> list[str]:
    rates = simulate.collapse_rates(SIM_RUNS, ns=SIM_NS)
    evidence = list(dict.fromkeys(r.evidence for r in rates))
    head = ["simulated run"] + [f"flagged ({e})" for e in evidence]
    lines = [row(head), row(["---"] * len(head))]
    for scenario in simulate.SCENARIOS:
        lines.append(row([scenario] + [f"{r.flagged:.1%}" for e in evidence for r in rates
                                       if r.scenario == scenario and r.evidence == e]))
    return [f"**Collapse.** {collapse.describe()}. The evidence is taken after the same optimizer steps in every run "
            "(the lab evaluates every "
            f"{collapse.RULE.every} updates on {simulate.EVAL_PROBLEMS} held-out problems), so the rule is the same at "
            f"every N. Simulated ({SIM_RUNS} runs per row, vespo.lab.simulate): on stable runs the share flagged is "
            "the rule's false-positive rate; on collapsing runs, its power.", "", "\n".join(lines), "",
            *fired_section(sweeps)]


def fired_section(sweeps: dict) -> list[str]:
    """Where the rule fired in the sweeps (the positive controls), flagged runs that ended as well as
    their condition's unflagged runs (suspect false positives), and the measured false-positive rate:
    of the runs that ended at least as well as the median unflagged run of their condition, the share
    flagged."""
    fired, suspects, flagged, total, ended_well = [], [], 0, 0, 0
    for name, (record, results) in sweeps.items():
        for key, runs in group(results, conditions(record)).items():
            usable = [r for r in runs if r.usable]
            dead = [r for r in usable if r.collapse.collapsed]
            flagged, total = flagged + len(dead), total + len(usable)
            if usable and 2 * len(dead) >= len(usable) and dead:
                fired.append(f"`{name}` {', '.join(key)}: {len(dead)}/{len(usable)}")
            alive = [r.stats.get("eval_sampled", math.nan) for r in usable if not r.collapse.collapsed]
            alive = [x for x in alive if math.isfinite(x)]
            if not alive:
                continue
            bar = statistics.median(alive)
            ended_well += sum(r.stats.get("eval_sampled", -math.inf) >= bar for r in usable)
            for r in dead:
                if r.stats.get("eval_sampled", -math.inf) >= bar:
                    suspects.append(f"`{name}` `{r.name}` (held-out {r.stats['eval_sampled']:.3f})")
    out = [f"In the sweeps below the rule flagged {flagged} of {total} finished runs. Where it fired in at least half "
           "the runs of a condition (the positive controls): " + ("; ".join(fired) or "nowhere yet") + "."]
    out.append("Flagged runs whose final held-out accuracy is at least the median of their condition's unflagged runs "
               "(suspect false positives): " + ("; ".join(suspects) or "none") + ".")
    if ended_well:
        fp = stats.rate_ci(len(suspects), ended_well)
        out.append(f"Measured false-positive rate: of the {ended_well} runs that ended at least as well as their "
                   f"condition's median unflagged run, the rule flagged {len(suspects)}, {ci_text(fp)} "
                   "(exact 90% interval).")
    return [" ".join(out), ""]


# ---------------------------------------------------------------- claims and sweeps


def claims_table(verdicts: list) -> str:
    lines = ["| # | the paper says | sweep | we measured | agrees? | robustness |",
             "| --- | --- | --- | --- | --- | --- |"]
    for i, v in enumerate(verdicts, 1):
        lines.append(f"| {i} | {_cell(v.claim.paper)} | {v.claim.sweep} | {_cell(v.measured)} | **{v.verdict}** | "
                     f"{v.robustness or '–'} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sweeps_table(sweeps: dict, root: Path, page_dir: Path) -> str:
    lines = ["| sweep | file | runs finished / in grid | wall time | commit | machine | report |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, (record, results) in sweeps.items():
        done = sum(r.status == "done" for r in results)
        s = record.get("sessions", [])
        report = os.path.relpath(root / name / "report.md", page_dir)
        lines.append(f"| `{name}` | `{record.get('source', '')}` | {done} / {planned(record)} | {wall_text(s, results)} | "
                     f"{commit_text(s)} | {machine_text(s)} | [report]({report}) |")
    return "\n".join(lines)


def wall_text(sessions: list[dict], results: list[RunResult]) -> str:
    run_s = sum(float(r.run.summary.get("seconds") or 0) for r in results if r.run is not None)
    runs = f"runs {run_s / 60:.0f} min in all"
    if not sessions:
        return f"not recorded ({runs})"
    wall = sum(float(x.get("seconds") or 0) for x in sessions)
    calls = f", {len(sessions)} calls" if len(sessions) > 1 else ""
    killed = sum(x.get("end") is None for x in sessions)
    killed = f", {killed} killed (counted to the last time seen alive)" if killed else ""
    return f"{wall / 60:.0f} min{calls}{killed} ({runs})"


def commit_text(sessions: list[dict]) -> str:
    seen = []
    for x in sessions:
        c = (x.get("commit") or "unknown")[:9] + (" (dirty)" if x.get("dirty") else "")
        if c not in seen:
            seen.append(c)
    return ", ".join(f"`{c}`" for c in seen) or "not recorded"


def machine_text(sessions: list[dict]) -> str:
    seen = []
    for x in sessions:
        m = x.get("machine") or {}
        text = f"{m.get('node', '?')} ({m.get('cpus', '?')} CPUs, torch {m.get('torch', '?')})"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen) or "not recorded"


def sweep_section(record: dict, results: list[RunResult], figures: list[Path], rel, report: Path) -> list[str]:
    lines = [f"### `{record['name']}`", ""]
    sessions = record.get("sessions", [])
    if sessions:
        lines += ["Commands (as run; a later call resumes the sweep and skips finished runs):", ""]
        for command in dict.fromkeys(x["command"] for x in sessions):
            lines.append(f"    {command}")
        first = sessions[0].get("start", "?")
        last = sessions[-1].get("end") or sessions[-1].get("last_seen") or "?"
        lines += ["", f"Ran from {_when(first)} to {_when(last)}; wall time {wall_text(sessions, results)}; "
                      f"commit {commit_text(sessions)}.", ""]
    else:
        lines += ["No sessions.jsonl: commands, commit and wall time were not recorded for this sweep.", ""]
    lines += sweep_tables(record, results)
    lines += [f"![{f.stem}]({rel(f)})" for f in figures if f.stem == "lr"]
    lines += ["", "Figures: " + ", ".join(f"[{f.stem}]({rel(f)})" for f in figures)
              + f"; [the full report, every run]({rel(report)}).", ""]
    return lines


def _when(iso: str) -> str:
    try:
        return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        return iso
