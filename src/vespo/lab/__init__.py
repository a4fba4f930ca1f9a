"""The stability lab: run the paper's comparisons at small scale and report them.

    vespo sweep configs/lab/staleness.yaml --out runs/lab/staleness --jobs 2    a grid of runs (vespo.lab.sweep)
    vespo report runs/lab/* --claims configs/lab/claims.yaml --page docs/results.md   reports and the page

grid.py reads sweep files, sweep.py runs the grid as `vespo train` processes, results.py reads the
run directories back (what "final" means), collapse.py decides per run whether it collapsed,
stats.py holds the interval over seeds and its measured coverage, simulate.py the collapse rule's
simulated rates, lr_range.py the stable learning-rate range, claims.py the paper's claims and their
verdicts, recommend.py the recommendation, tables.py and figures.py what a report shows, report.py
the command, page.py the results page.
"""
