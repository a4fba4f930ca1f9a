#!/usr/bin/env bash
# Refresh every lock in locks/ to what the package index serves now, then run CI on the new locks.
#
#   bash scripts/lock.sh               # every locks/*.txt
#   bash scripts/lock.sh main floor    # only these
#   NO_TEST=1 bash scripts/lock.sh     # resolve only (then run bash .ci/run before committing)
#
# Each lock is re-resolved in a fresh temporary venv: its `# install:` lines run as they read, with no
# constraint but torch (kept at the lock's version: TORCH=2.14.0 to move it) and, for a lock with a
# `# floors:` line, each package named there pinned at pyproject's lower bound for it. The venv's
# `pip freeze` (local version labels such as +cpu dropped, the editable vespo left out) replaces the
# lock's pins; its comment lines are kept. Then .ci/run rebuilds the environments from the new locks
# and runs the suite on them: commit the locks only if it passes (git diff locks/ shows what moved).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ $# -gt 0 ]; then NAMES=("$@"); else mapfile -t NAMES < <(cd locks && ls -- *.txt | sed 's/\.txt$//'); fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

floor_pins() {  # "name==lower bound" for each name in the lock's `# floors:` line, read from pyproject
  "$PY" - "$1" <<'EOF'
import re, sys, tomllib
names = " ".join(l.split(":", 1)[1] for l in open(sys.argv[1]) if l.startswith("# floors:")).split()
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
for name in names:
    bounds = [m.group(1) for r in reqs if (m := re.match(rf"{re.escape(name)}\s*>=\s*([^,;\s]+)", r, re.I))]
    if not bounds:
        sys.exit(f"lock.sh: {sys.argv[1]} names {name} under '# floors:', but pyproject gives it no lower bound")
    print(f"{name}=={bounds[0]}")
EOF
}

refresh() {
  local name=$1 lock="locks/$1.txt" venv="$WORK/$1" torch
  torch=${TORCH:-$(sed -n 's/^torch==//p' "$lock")}
  [ -n "$torch" ] || { echo "lock.sh: $lock pins no torch: give one as TORCH=VERSION" >&2; exit 1; }
  echo "lock.sh: resolving $lock (torch $torch)" >&2
  "$PY" -m venv "$venv"
  { echo "torch==$torch"; floor_pins "$lock"; } >"$WORK/$name.constraints"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$WORK/$name.constraints")
  "${pip[@]}" --upgrade pip
  "${pip[@]}" "torch==$torch"
  local args
  set -f
  while IFS= read -r args; do
    # shellcheck disable=SC2086
    "${pip[@]}" $args
  done < <(sed -n 's/^# install: *//p' "$lock")
  set +f
  { grep '^#' "$lock"
    "$venv/bin/python" -m pip freeze --all --exclude-editable --disable-pip-version-check | sed 's/+[^ ]*$//' | sort -f
  } >"$WORK/$name.txt"
  mv "$WORK/$name.txt" "$lock"
}

for name in "${NAMES[@]}"; do
  [ -f "locks/$name.txt" ] || { echo "lock.sh: no lock locks/$name.txt" >&2; exit 1; }
  refresh "$name"
done
git --no-pager diff --stat -- locks/ || true
[ -n "${NO_TEST:-}" ] || bash .ci/run
