"""The kernel view: each loss's effective coefficient on grad log pi as a function of the sequence weight W.

Every policy loss here has a per-token gradient of the form  -c(W) * A * grad log pi. This module
measures c by autograd on the loss functions themselves (so the picture cannot drift from the code):
for each W on a grid, one sequence of T tokens with a uniform per-token ratio r = W^(1/T), advantage
A = +1 or -1, aggregated as a plain token sum, and c = -(dL/dlogp) / A. For VESPO c = phi(W); for
REINFORCE with token IS c = r; for GRPO c drops to 0 where the clip binds.

m2po masks on a statistic of the batch it sees, so each W is drawn as a batch of its own (one
sequence of T tokens: every token masked but one once (log W / T)^2 >= tau). vespo_adaptive chooses
its kernel from the batch it sees, so it is drawn for a stale batch: n
sequences per sign with log W ~ N(-sigma^2/2, sigma^2) (E[W] = 1; sigma = --stale-sigma, seeded).
Each rule's loss runs on that batch, and the (k, lambda) it reports is then measured like the
others through VESPO's loss: curves `vespo_adaptive:budget` and `vespo_adaptive:ess`.

    vespo kernels --out DIR [--T 16] [--w-min 1e-3] [--w-max 1e3] [--points 241] [--stale-sigma 2] [--stale-n 16]

writes DIR/kernels.png (A > 0 and A < 0 side by side) and DIR/kernels.csv (loss, adv_sign, T, W, coef).
"""

from __future__ import annotations

import csv
import math
from dataclasses import replace
from pathlib import Path

import torch

KERNEL_AGG = "seq-mean-token-sum"  # with normalizer 1 the loss is the plain sum over tokens


ADAPTIVE = "vespo_adaptive"  # drawn per rule for a stale batch, not on the grid itself


def kernel_curves(T: int = 16, w_min: float = 1e-3, w_max: float = 1e3, points: int = 241,
                  stale_sigma: float = 2.0, stale_n: int = 16) -> dict:
    """{(loss, sign): (W [points], coef [points])} for every registered loss and both advantage signs.

    vespo_adaptive appears once per rule, as ("vespo_adaptive:<rule>", sign), adapted to the stale
    batch of :func:`stale_batch`.
    """
    from vespo.losses import get_loss, loss_names

    W = torch.logspace(math.log10(w_min), math.log10(w_max), points, dtype=torch.float64)  # [P]
    curves = {}
    for name in loss_names():
        if name == ADAPTIVE:
            continue
        spec = get_loss(name)
        cfg = replace(spec.config_cls(), agg=KERNEL_AGG)
        for sign in (1.0, -1.0):
            coef = _coefficient(spec.fn, cfg, W, T, sign) if spec.per_row else \
                torch.cat([_coefficient(spec.fn, cfg, w[None], T, sign) for w in W])  # one W per call
            curves[(name, sign)] = (W, coef)
    for rule, cfg in adapted_configs(stale_batch(stale_sigma, stale_n, T)).items():
        for sign in (1.0, -1.0):
            curves[(f"{ADAPTIVE}:{rule}", sign)] = (W, _coefficient(get_loss("vespo").fn, cfg, W, T, sign))
    return curves


def stale_batch(sigma: float, n: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Loss inputs of n sequences per sign (A = +1, then -1) of T tokens, log W ~ N(-sigma^2/2, sigma^2)."""
    g = torch.Generator().manual_seed(seed)
    log_w = -sigma**2 / 2 + sigma * torch.randn(2 * n, generator=g, dtype=torch.float64)  # [2n]
    old_logp = torch.full((2 * n, T), -1.0, dtype=torch.float64)  # [2n, T]
    return {"logp": old_logp + (log_w / T)[:, None], "old_logp": old_logp,
            "advantages": torch.cat([torch.ones(n), -torch.ones(n)]).double(),
            "mask": torch.ones(2 * n, T, dtype=torch.bool)}


def adapted_configs(batch: dict[str, torch.Tensor]) -> dict:
    """{rule: VespoConfig with the (k, lambda) vespo_adaptive's rule chose on ``batch``, aggregated as a token sum}."""
    from vespo.losses import get_loss, prepare_inputs
    from vespo.losses.vespo_adaptive import RULES

    spec, vespo = get_loss(ADAPTIVE), get_loss("vespo")
    configs = {}
    for rule in RULES:
        m = spec.fn(prepare_inputs(**batch), spec.config_cls(rule=rule)).metrics
        shape = {f"{p}_{sign}": float(m[f"vespo/{p}_{sign}"]) for p in ("k", "lambda") for sign in ("pos", "neg")}
        configs[rule] = vespo.config_cls(agg=KERNEL_AGG, **shape)
    return configs


def _coefficient(fn, cfg, W: torch.Tensor, T: int, sign: float) -> torch.Tensor:
    """c(W) = -(dL/dlogp) / A at a uniform token log-ratio log(W) / T, from the loss's own autograd."""
    from vespo.losses import prepare_inputs

    old_logp = torch.full((len(W), T), -1.0, dtype=torch.float64)  # [P, T]
    logp = (old_logp + (W.log() / T)[:, None]).requires_grad_(True)  # [P, T], r = W^(1/T) on every token
    adv = torch.full((len(W),), sign, dtype=torch.float64)  # [P]
    mask = torch.ones(len(W), T, dtype=torch.bool)
    out = fn(prepare_inputs(logp, old_logp, adv, mask), cfg, normalizer=1.0)
    (grad,) = torch.autograd.grad(out.loss, logp)
    return -grad.mean(dim=-1) / sign  # [P], the same on every token


def write_csv(curves: dict, T: int, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["loss", "adv_sign", "T", "W", "coef"])
        for (name, sign), (W, coef) in curves.items():
            for w, c in zip(W.tolist(), coef.tolist()):
                writer.writerow([name, "+" if sign > 0 else "-", T, f"{w:.6g}", f"{c:.6g}"])


def plot(curves: dict, T: int, path: Path, stale_sigma: float = 2.0, stale_n: int = 16) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    from vespo.plot import color_of

    names = sorted({name for name, _ in curves})
    # each loss in its colour of every figure (a variant "loss:option" in its loss's); dashes keep overlaps
    # visible, repeating when there are more curves than patterns (registered user losses included)
    colors = {name: color_of(name.partition(":")[0]) for name in names}
    patterns = ["-", (0, (5, 2)), "-", (0, (1, 1.5)), (0, (6, 2, 1, 2)), "-", (0, (3, 1)), (0, (1, 1)),
                (0, (4, 1, 1, 1)), (0, (2, 2)), (0, (8, 2))]
    dashes = {name: patterns[i % len(patterns)] for i, name in enumerate(names)}
    for ax, sign in zip(axes, (1.0, -1.0)):
        for name in names:
            W, coef = curves[(name, sign)]
            style = {"linewidth": 2.6} if name.startswith("vespo") else {"linewidth": 1.5, "alpha": 0.85}
            ax.plot(W.numpy(), coef.numpy(), label=name, color=colors[name], linestyle=dashes[name], **style)
        ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("sequence importance weight W = π/μ")
        ax.set_title(f"A {'> 0' if sign > 0 else '< 0'}")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("effective coefficient on ∇log π")
    axes[0].legend(loc="upper left", fontsize=9)
    fig.suptitle(f"How each loss weights a sample by its staleness (token-level losses at r = W^(1/{T}));\n"
                 f"vespo_adaptive as adapted to a stale batch of {stale_n} sequences per sign, "
                 f"log W ~ N(-σ²/2, σ²), σ = {stale_sigma:g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
