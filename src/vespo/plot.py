"""`vespo plot`: the training curves of one or more run directories on one figure.

    vespo plot runs/vespo32 runs/grpo32 --out curves.png
    vespo plot runs/sweep/loss=* --out all.png --kl engine --labels a b c

Four panels: reward (reward/mean), KL (kl/k3, the stale policy against the behavior policy, or
with --kl engine mismatch/k3, the rollout engine against the trainer), gradient norm
(optim/grad_norm, before clipping) and mean response length (rollout/response_len). The x axis is
optimizer steps by default (row k of a run at N was trained after (k - 1) x N updates: the axis
comparable across N), or with --x step the logged rollout step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vespo.metrics import read_jsonl

KL_KEYS = {"stale": "kl/k3", "engine": "mismatch/k3"}
PANELS = [("reward/mean", "reward", False), (None, "KL (k3)", True),
          ("optim/grad_norm", "grad norm", True), ("rollout/response_len", "response length", False)]


@dataclass
class Run:
    path: Path
    rows: list[dict]  # metrics.jsonl, one row per rollout step
    summary: dict  # summary.json ({} while the run is unfinished)
    config: dict = field(default_factory=dict)  # config.yaml ({} when absent)

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per logged row: staleness.n of the run's config (else its summary, else 1)."""
        return int((self.config.get("staleness") or {}).get("n") or self.summary.get("staleness_n") or 1)

    def curve(self, key: str, x: str = "step") -> tuple[list[int], list[float]]:
        """(x, values) of one metric, x the logged step or (x="updates") the optimizer steps taken
        before the row's samples were trained; rows where the metric is missing are left out."""
        if x not in ("step", "updates"):
            raise ValueError(f"x must be 'step' or 'updates', got {x!r}")
        n = self.updates_per_step if x == "updates" else 1
        pts = [((int(r["step"]) - 1) * n if x == "updates" else int(r["step"]), float(r[key]))
               for r in self.rows if key in r]
        return [s for s, _ in pts], [v for _, v in pts]


def load_run(path: str | Path) -> Run:
    """Read a run directory's metrics.jsonl (and summary.json when present)."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{path} is not a run directory: no metrics.jsonl")
    rows = read_jsonl(metrics)
    for i, row in enumerate(rows):
        if "step" not in row:
            raise ValueError(f"{metrics}: row {i + 1} has no 'step'")
    summary, config = path / "summary.json", path / "config.yaml"
    return Run(path, rows, json.loads(summary.read_text()) if summary.is_file() else {},
               (yaml.safe_load(config.read_text()) or {}) if config.is_file() else {})


def plot_runs(runs: list[Run], labels: list[str], out: str | Path, kl: str = "stale", title: str = "",
              x: str = "updates") -> Path:
    """Draw the four panels for every run and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (key, name, logy) in zip(axes.flat, PANELS):
        key = key or KL_KEYS[kl]
        for run, label in zip(runs, labels):
            steps, values = run.curve(key, x)
            ax.plot(steps, values, label=label, linewidth=1.4)
        _style(ax, f"{name} [{key}]", logy, "optimizer steps" if x == "updates" else "rollout step")
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _style(ax, title: str, logy: bool, xlabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    if logy and any(v > 0 and math.isfinite(v) for line in ax.get_lines() for v in line.get_ydata()):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (each with a metrics.jsonl)")
    p.add_argument("--out", default="curves.png", help="PNG to write (default curves.png)")
    p.add_argument("--labels", nargs="+", help="one legend label per run (default: the directory names)")
    p.add_argument("--kl", choices=sorted(KL_KEYS), default="stale",
                   help="stale: kl/k3 between the updated and the behavior policy; engine: mismatch/k3")
    p.add_argument("--title", default="", help="figure title")
    p.add_argument("--x", choices=["updates", "step"], default="updates",
                   help="x axis: optimizer steps (default; comparable across N) or logged rollout step")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        p.error(f"--labels has {len(args.labels)} labels for {len(args.runs)} runs")
    try:
        runs = [load_run(r) for r in args.runs]
    except (FileNotFoundError, ValueError) as e:
        print(f"vespo plot: {e}", file=sys.stderr)
        return 2
    out = plot_runs(runs, args.labels or [Path(r).name for r in args.runs], args.out, args.kl, args.title, args.x)
    print(f"wrote {out}")
    return 0
