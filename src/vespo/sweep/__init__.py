"""Running the lab's sweeps (docs/lab.md): the command cli.py (`vespo sweep`), plan.py (each grid point's action,
the sweep's record, archive restore), launch.py (the `vespo train` processes, here or as Ray tasks) and
provenance.py (sessions.jsonl). The grid itself (`Sweep`, lab/grid.py) and the table of runs stay in the lab.
"""
