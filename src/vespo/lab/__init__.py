"""The stability lab (docs/lab.md): analysis only; running a sweep is vespo.sweep. grid.py (sweep files). Judging:
runs.py (the table of runs), collapse.py, stats.py, claims.py, recommend.py. Showing: figures.py and report.py (the
tables, the reports and the results page, worded in page.md); the command `vespo report` is cli.py.
"""
