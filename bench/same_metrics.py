"""Do two versions of vespo give the same numbers? Compares the runs of two sweep directories made
from one sweep file by two checkouts (same grid points, same config), metric by metric.

    PYTHONPATH=/path/to/old/src python -m vespo.cli sweep SWEEP.yaml --out /tmp/cells/old --only seed=0 --only N=8
    python -m vespo.cli sweep SWEEP.yaml --out /tmp/cells/new --only seed=0 --only N=8
    python bench/same_metrics.py /tmp/cells/old /tmp/cells/new

For each run present in both: whether the trajectory is the same (training reward, sampled tokens and
gradient norm equal bit for bit on every row: the same samples and the same updates), how many of
the metrics both log are equal on every row, the first logged step where one differs and each
differing metric's largest relative difference over the run; then the final held-out accuracy. Rounding differences (another
summation order) are expected to grow chaotically over stale updates, so the first differing row
and its size say more than the final numbers.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def rel(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


TRAJECTORY = ("reward/mean", "rollout/n_tokens", "optim/grad_norm")  # the same samples and updates


def compare(old: Path, new: Path) -> dict:
    ra, rb = rows(old), rows(new)
    skip = {k for r in ra + rb for k in r if k.startswith("perf/") or k.startswith("mem/")}  # timings differ
    first, worst = None, {}
    for a, b in zip(ra, rb):
        for k in sorted((set(a) & set(b)) - skip):
            d = rel(float(a[k]), float(b[k]))
            if d > 0:
                worst[k] = max(worst.get(k, 0.0), d)
                first = int(a["step"]) if first is None else first
    common = set().union(*(set(a) & set(b) for a, b in zip(ra, rb))) - skip
    summary = {}
    for name, run in (("old", old), ("new", new)):
        path = run / "summary.json"
        after = json.loads(path.read_text()).get("eval_after", {}) if path.is_file() else {}
        summary[name] = after.get("reward_sampled", math.nan)
    return {"rows": (len(ra), len(rb)), "first_diff_step": first, "differ": worst,
            "identical": len(common) - len(worst), "trajectory": not any(k in worst for k in TRAJECTORY),
            "held_out": (summary["old"], summary["new"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args()
    names = sorted(d.name for d in args.old.iterdir() if (d / "metrics.jsonl").is_file()
                   and (args.new / d.name / "metrics.jsonl").is_file())
    print("| run | rows old / new | same samples and updates | metrics equal on every row | first step that "
          "differs | metrics that differ (largest relative difference over all rows) | held-out old / new |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        c = compare(args.old / name, args.new / name)
        where = "none (bit for bit)" if c["first_diff_step"] is None else str(c["first_diff_step"])
        differ = ", ".join(f"{k} {v:.1e}" for k, v in sorted(c["differ"].items(), key=lambda kv: -kv[1])) or "-"
        print(f"| {name} | {c['rows'][0]} / {c['rows'][1]} | {'yes' if c['trajectory'] else 'no'} | "
              f"{c['identical']} | {where} | {differ} | {c['held_out'][0]:.3f} / {c['held_out'][1]:.3f} |")

if __name__ == "__main__":
    main()
