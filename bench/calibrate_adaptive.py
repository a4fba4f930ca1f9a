"""Calibrate vespo_adaptive's defaults on the sequence log-weights of real N = 8 training runs.

    OMP_NUM_THREADS=1 python bench/calibrate_adaptive.py [--config configs/lab/staleness.yaml] [--n 8]
        [--seeds 0 1] [--steps 40] [--out runs/calibrate_adaptive]

Trains fixed VESPO (the config's `base` section, staleness.n = --n) once per seed, recording on
every loss call the log W its kernel used and the sign of each sequence's advantage. On the
stale calls (lag >= 1; at lag 0 W = 1 exactly and every kernel shape gives phi = 1) it prints:

  - per sign, the budget C for which the median lam (rule budget, k fixed) over the calls where the
    rule runs (>= 2 sequences of that sign, W not all equal) is the paper's lam (3 for A >= 0, 2 for
    A < 0), found by bisection on C (the median lam falls as C rises);
  - the quantiles of lam over the calls at the default budgets, and how often a bound binds;
  - the quantiles of the paper kernel's coefficient ESS per sign (what rule ess compares to its target).

docs/adaptive.md records the figures this printed for the defaults.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from vespo.losses import LossInputs, VespoAdaptiveConfig, VespoConfig, vespo_loss
from vespo.losses.diagnostics import effective_sample_size
from vespo.losses.kernel import sign_groups, sign_log_phi
from vespo.losses.registry import LossSpec, register
from vespo.losses.vespo import vespo_log_weight
from vespo.losses.vespo_adaptive import adapt_shape

PAPER = {0: (2.0, 3.0), 1: (3.0, 2.0)}  # row 0: A >= 0, row 1: A < 0
CALLS: list[tuple[torch.Tensor, torch.Tensor]] = []  # (log W [B], groups [2, B]) per loss call


def recorded_vespo(x: LossInputs, cfg: VespoConfig, normalizer=None):
    """VESPO, recording the log-weights its kernel uses (detached) before computing the loss."""
    valid = x.seq_valid
    groups = sign_groups(x.adv, x.mask, x.seq_valid)[:, valid]
    CALLS.append((vespo_log_weight(x, cfg)[valid, 0].double().cpu(), groups.cpu()))
    return vespo_loss(x, cfg, normalizer)


def record_run(config: Path, n: int, seed: int, steps: int, out: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from vespo.config import load_config
    from vespo.trainer import train

    base = yaml.safe_load(config.read_text())["base"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(base, f)
    cfg = load_config(f.name, [f"staleness.n={n}", f"run.seed={seed}", f"run.steps={steps}", "loss.name=vespo_recorded",
                               f"run.out_dir={out / f'n{n}_seed{seed}'}"])
    start = len(CALLS)
    train(cfg)
    return [call for j, call in enumerate(CALLS[start:]) if j % n != 0]  # lag 0 (W = 1) left out


def lambdas(calls, budget: list[float], cfg: VespoAdaptiveConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """lam per call and sign (rule budget) at ``budget``, and whether the rule ran there.  # [calls, 2] each"""
    cfg = replace(cfg, budget_pos=budget[0], budget_neg=budget[1])
    shapes = [adapt_shape(x, g, cfg) for x, g in calls]
    lam = torch.stack([lam for _, lam, _ in shapes])
    adapted = torch.stack([torch.stack([m["vespo/adapted_pos"], m["vespo/adapted_neg"]]) > 0 for _, _, m in shapes])
    return lam, adapted


def median_budget(calls, row: int, wide: VespoAdaptiveConfig) -> float:
    """The C for which the median lam of the calls where the rule ran (>= 2 sequences of that sign with
    unequal W) is the paper's lam."""
    lo, hi = 0.5, 2.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lam, adapted = lambdas(calls, [mid, mid], wide)
        lo, hi = (mid, hi) if lam[adapted[:, row], row].median() > PAPER[row][1] else (lo, mid)
    return (lo + hi) / 2


def quantiles(x: torch.Tensor) -> str:
    qs = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9)
    return " ".join(f"q{int(q * 100):02d} {x.quantile(q).item():.3f}" for q in qs)


def report(calls) -> None:
    wide = VespoAdaptiveConfig(lambda_min=1e-4, lambda_max=1e3)  # bounds that do not bind the calibration
    default = VespoAdaptiveConfig()
    print(f"{len(calls)} stale loss calls (lag >= 1)")
    for row, sign in enumerate(("A >= 0", "A < 0")):
        print(f"{sign}: budget giving the median call lam = {PAPER[row][1]}: C = {median_budget(calls, row, wide):.4f}")
    lam, adapted = lambdas(calls, [default.budget_pos, default.budget_neg], default)
    k0 = torch.tensor([PAPER[0][0], PAPER[1][0]], dtype=torch.float64)
    lam0 = torch.tensor([PAPER[0][1], PAPER[1][1]], dtype=torch.float64)
    ess = torch.stack([effective_sample_size(sign_log_phi(x, k0, lam0), g) for x, g in calls])  # [calls, 2]
    for row, sign in enumerate(("A >= 0", "A < 0")):
        ran = adapted[:, row]
        lr = lam[ran, row]
        at_min, at_max = (lr <= default.lambda_min).double().mean(), (lr >= default.lambda_max).double().mean()
        print(f"{sign}: the rule ran on {int(ran.sum())} calls; lam there: {quantiles(lr)}; "
              f"at lambda_min {at_min:.2f}, at lambda_max {at_max:.2f}")
        e = ess[ran, row]
        print(f"{sign}: paper kernel's coefficient ESS on those calls: {quantiles(e)}; below {default.ess_target}: "
              f"{(e < default.ess_target).double().mean():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/lab/staleness.yaml"),
                        help="a lab config (its base: section is trained)")
    parser.add_argument("--n", type=int, default=8, help="staleness N")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40, help="rollout steps per run")
    parser.add_argument("--out", type=Path, default=Path("runs/calibrate_adaptive"))
    args = parser.parse_args()
    register(LossSpec("vespo_recorded", recorded_vespo, VespoConfig))
    calls = [call for seed in args.seeds for call in record_run(args.config, args.n, seed, args.steps, args.out)]
    report(calls)


if __name__ == "__main__":
    main()
