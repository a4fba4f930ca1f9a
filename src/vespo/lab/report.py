"""`vespo report`: the tables and figures of sweep directories, and the results page.

    vespo report runs/staleness                           -> runs/staleness/report/report.md + PNGs
    vespo report runs/staleness --out DIR --panel loss --curve N
    vespo report runs/lab/* --claims configs/lab/claims.yaml --page docs/results.md
                                                          -> docs/results/<sweep>/ + the page
    vespo report docs/results/staleness runs/lab/async ... --page docs/results.md
                                                          (a committed archive in place of a sweep directory)

A sweep's report.md holds, per condition (grid point without its seed), the mean over seeds with
its interval of the held-out accuracy after training (sampled and greedy), of the training reward
over the last quarter of the optimizer steps, and the optimizer steps and wall time to a training
reward, the collapse count and diagnostics; each condition's paired difference against the sweep's
reference (VESPO by default) seed by seed; with an lr axis, the stable learning-rate range and the
collapse rate per lr; then one row per run (vespo.lab.tables). Figures (vespo.lab.figures):
reward.png, kl.png, grad_norm.png (curves against optimizer steps), headline.png when the grid has
loss and N axes, lr.png when it has an lr axis. Beside them runs.json.gz, the sweep's archive: what
the report reads of every run (vespo.lab.results), so that it can be regenerated without the run
directories. What "final" means: vespo.lab.results. With --page,
every sweep's report goes to results/<name>/ beside the page, and the page gets the recommendation,
the claims table and the rest (vespo.lab.page).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from vespo.lab.figures import write_figures
from vespo.lab.page import write_page
from vespo.lab.results import ARCHIVE, read_sweep, write_archive
from vespo.lab.tables import sweep_markdown


def write_report(sweep_dir: Path, out: Path, panel: str | None = None, curve: str | None = None) -> Path:
    record, results = read_sweep(sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = write_figures(record, results, out, panel, curve)
    path = out / "report.md"
    path.write_text(sweep_markdown(record, results, figures))
    write_archive(record, results, out / ARCHIVE)
    return path


# ---------------------------------------------------------------- command line


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR",
                   help=f"directories written by `vespo sweep`, or sweep archives ({ARCHIVE}, or a report folder "
                        "holding one)")
    p.add_argument("--out", help="folder for report.md and the PNGs (default: SWEEP_DIR/report; with --page: "
                                 "results/ beside the page, one folder per sweep)")
    p.add_argument("--panel", help="grid axis with one panel per value (default: loss)")
    p.add_argument("--curve", help="grid axis with one curve per value (default: N)")
    p.add_argument("--page", help="write the results page (markdown) over all the sweeps")
    p.add_argument("--claims", help="claims file for the page's claims table (configs/lab/claims.yaml)")
    args = p.parse_args(argv)
    # a glob such as runs/lab/* also matches logs
    files = [d for d in args.sweep_dirs if Path(d).is_file() and not d.endswith(ARCHIVE)]
    if files and len(files) < len(args.sweep_dirs):
        print(f"vespo report: skipping {len(files)} file(s) that are not sweep directories: {', '.join(files)}",
              file=sys.stderr)
        args.sweep_dirs = [d for d in args.sweep_dirs if d not in files]
    if len(args.sweep_dirs) > 1 and not args.page:
        p.error("several sweep directories need --page (one report per sweep goes beside the page)")
    if args.claims and not args.page:
        p.error("--claims needs --page")
    try:
        if args.page:
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
