"""The stability lab: run the paper's comparisons at small scale and judge them.

    vespo sweep configs/lab/staleness.yaml --out runs/lab/staleness --jobs 2    a grid of runs
    vespo report docs/results/* --claims configs/lab/claims.yaml --page docs/results.md   reports and the page

Running: grid.py reads sweep files, plan.py decides what each grid point needs, launch.py runs them as
`vespo train` processes, provenance.py records each call, sweep.py is the command. Judging: runs.py
reads runs (directories or archives) into one table, collapse.py decides per run whether it collapsed,
stats.py holds the intervals and tests, simulate.py the collapse rule's simulated error rates,
claims.py the claims as typed judges, recommend.py the recommendation. Showing: tables.py, figures.py,
page.py and the command report.py.
"""
