"""Settings for the whole suite."""

import os

# Ray starts its worker processes at niceness 15, so on a loaded 2-core machine (another test worker, a
# lab sweep) the rollout workers of an async test barely run and the test waits out its stall timeout.
# The tests' Ray workers run at the tests' own priority; what the workers compute does not change.
os.environ.setdefault("RAY_worker_niceness", "0")
