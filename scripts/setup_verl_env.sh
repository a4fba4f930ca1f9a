#!/usr/bin/env bash
# Build the separate virtual environment that vespo's verl integration is tested in: `.venv-verl/`, from
# locks/verl.txt (verl pins an older transformers than vespo's main environment runs). Idempotent.
#
# Usage: bash scripts/setup_verl_env.sh        (PYTHON=python3.11 to choose the interpreter)
exec bash "$(dirname "$0")/setup_env.sh" verl "$@"
