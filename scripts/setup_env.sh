#!/usr/bin/env bash
# Build a virtual environment from its lock: exact versions, the ones the test suite passed on.
#
#   bash scripts/setup_env.sh main     # .venv        from locks/main.txt  (the package, its tests' extras)
#   bash scripts/setup_env.sh verl     # .venv-verl   from locks/verl.txt  (verl pins an older transformers)
#   bash scripts/setup_env.sh floor    # .venv-floor  from locks/floor.txt (pyproject's lower bounds)
#
# A lock (locks/NAME.txt) is a pip constraints file: one `name==version` a line, torch included, and
# header lines `# install: ARGS`, each one `pip install ARGS` run in order under the constraints. The
# build is idempotent: a stamp in the venv holds the lock's hash, and a venv built from the same lock
# returns at once (vespo is installed editable, so it stays current). PYTHON chooses the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:?usage: bash scripts/setup_env.sh NAME (a lock in locks/: $(cd locks && ls -- *.txt | sed 's/\.txt$//' | tr '\n' ' '))}
LOCK="locks/$NAME.txt"
[ -f "$LOCK" ] || { echo "setup_env: no lock $LOCK" >&2; exit 1; }
if [ "$NAME" = main ]; then VENV=.venv; else VENV=.venv-$NAME; fi
PY=${PYTHON:-python3}
STAMP="$VENV/.vespo-lock"
LOG="$VENV/setup.log"
HASH=$(sha256sum "$LOCK" | cut -d' ' -f1)

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$HASH" ]; then
  exit 0
fi
mapfile -t INSTALLS < <(sed -n 's/^# install: *//p' "$LOCK")
[ "${#INSTALLS[@]}" -gt 0 ] || { echo "setup_env: $LOCK has no '# install:' line" >&2; exit 1; }

echo "setup_env: building $VENV from $LOCK" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
rm -f "$STAMP"
: >"$LOG"
pip_install() {  # quiet: pip's output goes to $LOG and is shown only if it fails
  if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -c "$LOCK" "$@" >>"$LOG" 2>&1; then
    echo "setup_env: pip install $* (constraints $LOCK) failed; the last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}
pip_install pip      # the lock's pip
pip_install torch    # first and alone: the lock's CPU build, before anything could ask for another
set -f  # an install line is split into words, never globbed (.[test] is an extra, not a pattern)
for args in "${INSTALLS[@]}"; do
  # shellcheck disable=SC2086
  pip_install $args
done
set +f
echo "$HASH" >"$STAMP"
