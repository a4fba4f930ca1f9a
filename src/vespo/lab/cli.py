"""`vespo report`: the tables and figures of a sweep, or the results page over several (vespo.lab.report).

    vespo report runs/staleness                        runs/staleness/report/report.md and PNGs
    vespo report runs/staleness --out docs/results/staleness --panel loss --curve N
    vespo report runs/lab/* --claims configs/lab/claims.yaml --page docs/results.md

A SWEEP_DIR may also be a sweep's archive (runs.json.gz, or the report folder holding it). A report is
report.md (per condition and per run; docs/lab.md, `vespo report`), its figures and the sweep's archive. With
--page every sweep's report goes to results/<name>/ beside the page, the template page.md filled.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from vespo.lab import report
from vespo.lab.runs import ARCHIVE, read_lab


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR",
                   help=f"directories written by `vespo sweep`, or sweep archives ({ARCHIVE}, or a folder holding one)")
    p.add_argument("--out", type=Path, help="folder for report.md and the PNGs (default: SWEEP_DIR/report; with "
                                            "--page: results/ beside the page, one folder per sweep)")
    p.add_argument("--panel", help="grid axis with one panel per value (default: loss)")
    p.add_argument("--curve", help="grid axis with one curve per value (default: N)")
    p.add_argument("--page", type=Path, help="write the results page (markdown) over all the sweeps")
    p.add_argument("--claims", type=Path, help="claims file for the page's claims table (configs/lab/claims.yaml)")
    args = p.parse_args(argv)
    files = [d for d in args.sweep_dirs if Path(d).is_file() and not d.endswith(ARCHIVE)]  # a glob also matches logs
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
            path = report.write_page(list(map(Path, args.sweep_dirs)), args.page, args.claims, args.out,
                                     "vespo report " + shlex.join(argv))
            print(f"wrote {path} and the sweeps' reports")
            return 0
        sweeps, runs = read_lab(args.sweep_dirs)
        out = args.out or Path(args.sweep_dirs[0]) / "report"
        report.write_sweep(next(iter(sweeps.values())), runs, out, args.panel, args.curve)
    except (FileNotFoundError, ValueError) as e:
        print(f"vespo report: {e}", file=sys.stderr)
        return 2
    print((out / "report.md").read_text().split("Runs:")[0])
    print(f"wrote {out / 'report.md'} and its figures")
    return 0
