"""The stability lab (docs/lab.md). Running: grid.py (sweep files), plan.py, launch.py, provenance.py and the
command sweep.py. Judging: runs.py (the table of runs), collapse.py, stats.py, claims.py, recommend.py.
Showing: tables.py, figures.py, page.py and the command report.py.
"""
