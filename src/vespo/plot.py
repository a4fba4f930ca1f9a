"""The training curves of one or more run directories on one figure (the command `vespo plot`: plot_cli.py).

    vespo plot runs/vespo32 runs/grpo32 --out curves.png
    vespo plot runs/sweep/loss=* --out all.png --kl engine --labels a b c

Four panels: reward (reward/mean), KL (kl/k3, the stale policy against the behavior policy, or
with --kl engine mismatch/k3, the rollout engine against the trainer), gradient norm
(optim/grad_norm, before clipping) and mean response length (rollout/response_len). The x axis is
optimizer steps by default (row k of a run at N was trained after (k - 1) x N updates: the axis
comparable across N), or with --x step the logged rollout step.

One colour per loss and one display name per loss, the same in every figure and table of the
project (`vespo plot` and the lab's reports): `color_of("grpo")`, `display_name("dppo_tv")`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from vespo.rundir import METRICS, RunFiles, read_run_files

KL_KEYS = {"stale": "kl/k3", "engine": "mismatch/k3"}

# name -> (display name, colour): the losses, their variants, and the lab's method labels
LOSSES: dict[str, tuple[str, str]] = {
    "vespo": ("VESPO", "#1f77b4"),
    "vespo_ess_lr": ("VESPO + ESS step", "#17becf"),
    "vespo_adaptive": ("VESPO adaptive (budget)", "#6baed6"),
    "vespo_adaptive_ess": ("VESPO adaptive (ESS)", "#08306b"),
    "grpo": ("GRPO", "#d62728"),
    "grpo_ess_lr": ("GRPO + ESS step", "#ff9896"),
    "gspo": ("GSPO", "#2ca02c"),
    "sapo": ("SAPO", "#ff7f0e"),
    "dppo_tv": ("DPPO-TV", "#9467bd"),
    "dppo_kl": ("DPPO-KL", "#c5b0d5"),
    "m2po": ("M2PO", "#8c564b"),
    "cispo": ("CISPO", "#e377c2"),
    "reinforce": ("REINFORCE", "#7f7f7f"),
    "prime_rl": ("prime-rl", "#b8860b"),
    "luspo": ("LUSPO", "#006d2c"),
    "gmpo": ("GMPO", "#4d004b"),
    "topr": ("TOPR", "#e6550d"),
    "dro": ("DRO", "#636363"),
    "ipo": ("IPO (prime-rl)", "#7a0177"),
    "clip_cov": ("Clip-Cov", "#31a354"),
    "kl_cov": ("KL-Cov", "#3182bd"),
    "decoupled_ppo": ("decoupled PPO", "#a63603"),
}
METHOD_PARTS = {"tis": "TIS", "geo": "geo mask", "r2": "R2", "r3": "R3", "fp32": "fp32 engine", "bf16": "bf16 engine",
                "opsm": "OPSM", "icepop": "IcePop", "bypass": "bypass"}
FALLBACK_COLORS = ["#bcbd22", "#aec7e8", "#98df8a", "#ffbb78", "#f7b6d2", "#c49c94", "#dbdb8d", "#9edae5"]


def display_name(name: str) -> str:
    """"dppo_tv" -> "DPPO-TV", "grpo_tis" -> "GRPO + TIS", "vespo_r2" -> "VESPO + R2"; other names as given."""
    if name in LOSSES:
        return LOSSES[name][0]
    head = max((k for k in LOSSES if name.startswith(k + "_")), key=len, default=None)
    if head is None:
        return name
    parts = name[len(head) + 1:].split("_")
    return " + ".join([LOSSES[head][0]] + [METHOD_PARTS.get(x, x) for x in parts])


def color_of(name: str) -> str:
    """The loss's colour (a method label takes its loss's: "grpo_tis" is GRPO's red); an unknown name
    gets a fixed colour of its own, from its characters, so it too is the same in every figure."""
    if name in LOSSES:
        return LOSSES[name][1]
    head = max((k for k in LOSSES if name.startswith(k + "_")), key=len, default=None)
    if head is not None:
        return LOSSES[head][1]
    return FALLBACK_COLORS[sum(map(ord, name)) % len(FALLBACK_COLORS)]
PANELS = [("reward/mean", "reward", False), (None, "KL (k3)", True),
          ("optim/grad_norm", "grad norm", True), ("rollout/response_len", "response length", False)]


@dataclass
class Run(RunFiles):
    """A run directory's files (vespo.rundir) with its path; its rows are one per rollout step."""

    path: Path

    def curve(self, key: str, x: str = "step") -> tuple[list[int], list[float]]:
        """(x, values) of one metric, x the logged step or (x="updates") the optimizer steps taken
        before the row's samples were trained; rows where the metric is missing are left out."""
        if x not in ("step", "updates"):
            raise ValueError(f"x must be 'step' or 'updates', got {x!r}")
        n = self.n if x == "updates" else 1
        pts = [((int(r["step"]) - 1) * n if x == "updates" else int(r["step"]), float(r[key]))
               for r in self.rows if key in r]
        return [s for s, _ in pts], [v for _, v in pts]


def load_run(path: str | Path) -> Run:
    """Read a run directory's metrics (and its summary and config when present)."""
    path = Path(path)
    if not (path / METRICS).is_file():
        raise FileNotFoundError(f"{path} is not a run directory: no {METRICS}")
    run = Run(**vars(read_run_files(path)), path=path)
    for i, row in enumerate(run.rows):
        if "step" not in row:
            raise ValueError(f"{path / METRICS}: row {i + 1} has no 'step'")
    return run


def plot_runs(runs: list[Run], labels: list[str], out: str | Path, kl: str = "stale", title: str = "",
              x: str = "updates") -> Path:
    """Draw the four panels for every run and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    losses = [(run.config.get("loss") or {}).get("name") for run in runs]
    distinct = all(losses) and len(set(losses)) == len(losses)  # one run per loss: each in its loss's colour
    for ax, (key, name, logy) in zip(axes.flat, PANELS):
        key = key or KL_KEYS[kl]
        for run, label, loss in zip(runs, labels, losses):
            steps, values = run.curve(key, x)
            ax.plot(steps, values, label=label, linewidth=1.4, color=color_of(loss) if distinct else None)
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
