#!/usr/bin/env bash
# Build the separate virtual environment that vespo's verl integration is tested in.
#
# verl 0.9.1 pins transformers < 5.11 while vespo's main environment runs a newer one, so verl lives
# in its own venv, `.venv-verl/` at the repository root (gitignored). The script is idempotent:
# when the venv already imports verl 0.9.1 and vespo it returns at once.
#
# torch is pinned (2.13.0, the CPU build this machine carries) in every pip command through a
# constraint file, so resolving verl's dependencies can never swap in another torch build.
#
# Usage: bash scripts/setup_verl_env.sh        (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV="$REPO/.venv-verl"
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VERL_VERSION=0.9.1
# verl's actor worker (verl.workers.engine_workers) imports its rollout server's web stack at load time, which
# verl's own dependency list leaves out; tests/integrations/verl_actor_check.py runs that worker.
EXTRAS="uvicorn fastapi"

STAMP="$VENV/.vespo-ready"  # written after a successful build; holds the versions it was built with
WANT="verl==$VERL_VERSION torch==$TORCH_VERSION extras=$EXTRAS"
LOG="$VENV/setup.log"

ready() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<EOF >/dev/null 2>&1
import importlib.metadata as md
import verl.trainer.ppo.core_algos, verl.workers.engine_workers, vespo.losses
assert md.version("verl") == "$VERL_VERSION"
assert md.version("torch").split("+")[0] == "$TORCH_VERSION"
EOF
}

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0  # built before; vespo is installed editable, so it stays current
fi

echo "setup_verl_env: building $VENV (verl $VERL_VERSION, torch $TORCH_VERSION)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
CONSTRAINTS="$VENV/torch-constraint.txt"
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
: >"$LOG"

pip_install() {  # quiet: pip's output goes to $LOG and is shown only if it fails
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@" >>"$LOG" 2>&1; then
    echo "setup_verl_env: pip install $* failed; the last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}

pip_install --upgrade pip
pip_install "torch==$TORCH_VERSION"
pip_install "verl==$VERL_VERSION"
# vespo itself without its dependency list (which would ask for the main env's transformers);
# the light packages it imports at load time are installed explicitly.
pip_install --no-deps -e "$REPO"
pip_install pyyaml numpy safetensors
# shellcheck disable=SC2086
pip_install $EXTRAS

if ! ready; then
  echo "setup_verl_env: $VENV was built but does not import verl $VERL_VERSION (with its actor worker) and vespo.losses" >&2
  exit 1
fi
echo "$WANT" >"$STAMP"
