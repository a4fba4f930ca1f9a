#!/usr/bin/env bash
# The whole lab in one command: every sweep of docs/lab.md's budget table in order of importance,
# then the results page. Resumable: run it again and finished runs are skipped, interrupted ones
# resume from their checkpoints (vespo sweep). About 8 hours on 2 cores. Sessions on different
# machines add up: a sweep with a committed archive (docs/results/<sweep>/runs.json.gz) first gets
# back the finished runs it holds (vespo sweep --from-archive) and runs only the rest, and a sweep
# whose run directories this machine lacks enters the page from that archive. A session that stops
# before a sweep finishes commits its report and archive to docs/results/in_progress/<sweep>/
# (`vespo report runs/lab/<sweep> --out docs/results/in_progress/<sweep>`), which the next session
# starts from and the page removes once it shows the sweep.
#
# Usage: bash scripts/lab.sh [SWEEP ...]     (default: all but the optional *_peers sweeps, in the order
# below; the venv active)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${LAB_OUT:-runs/lab}
SWEEPS=("$@")
[ ${#SWEEPS[@]} -gt 0 ] || SWEEPS=(staleness async lr_range endpoint mismatch mismatch_dense length_norm asymmetry lr_range_async)
jobs_of() { case "$1" in async|lr_range_async|*_peers) echo 1 ;; *) echo 2 ;; esac; }
status=0
for sweep in "${SWEEPS[@]}"; do
  echo "== $(date -u +%FT%TZ) $sweep"
  # the finished runs an earlier session committed: of a sweep still running (results/in_progress/), else
  # of the sweep on the page
  archive=()
  for a in "docs/results/in_progress/$sweep/runs.json.gz" "docs/results/$sweep/runs.json.gz"; do
    if [ -f "$a" ]; then archive=(--from-archive "$a"); break; fi
  done
  vespo sweep "configs/lab/$sweep.yaml" --out "$OUT/$sweep" --jobs "$(jobs_of "$sweep")" "${archive[@]}" || status=1
done
echo "== $(date -u +%FT%TZ) results page"
dirs=()
# the optional *_peers and real-model sweeps (docs/lab.md) join the page when they have run here or have an archive
# (the order of the page's sections; tests/lab/test_results_page.py holds it to the page's own command)
for sweep in staleness async lr_range lr_range_async endpoint length_norm asymmetry mismatch mismatch_dense \
    staleness_peers async_peers mismatch_peers staleness_newer async_newer real_staleness real_mismatch \
    real_mismatch_bf16 real_stability; do
  # the run directories when this machine has them, else the archive an earlier session committed; the
  # optional sweeps (the real model's runs take hours) also part-way, from their in-progress archives
  # (an in-progress archive is newer than the copy an earlier page wrote under docs/results/)
  if [ -f "$OUT/$sweep/sweep.json" ]; then dirs+=("$OUT/$sweep")
  elif [[ "$sweep" == *_peers || "$sweep" == real_staleness ]] && [ -f "docs/results/in_progress/$sweep/runs.json.gz" ]; then
    dirs+=("docs/results/in_progress/$sweep/runs.json.gz")
  elif [ -f "docs/results/$sweep/runs.json.gz" ]; then dirs+=("docs/results/$sweep/runs.json.gz")
  fi
done
vespo report "${dirs[@]}" --claims configs/lab/claims.yaml --page docs/results.md || status=1
exit $status
