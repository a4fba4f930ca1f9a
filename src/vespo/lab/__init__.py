"""The stability lab: run the paper's comparisons at small scale and report them.

    vespo sweep configs/lab/staleness.yaml --out runs/staleness --jobs 2   a grid of runs (vespo.lab.sweep)
    vespo report runs/staleness --out docs/results/staleness               table and figures (vespo.lab.report)

grid.py reads sweep files, collapse.py decides per run whether it collapsed, sweep.py runs the
grid as `vespo train` processes, report.py aggregates the run directories over seeds.
"""
