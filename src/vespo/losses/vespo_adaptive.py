"""Adaptive VESPO: the gamma kernel's shape (k, lam) chosen per loss call and per sign of A from the
batch's own detached sequence log-weights (docs/adaptive.md).

VESPO's phi is the density ratio dQ/dmu of the proposal Q ~ mu W^k exp(-lam W), normalized so that
phi(1) = 1; lam is the Lagrange multiplier of the weight budget E_Q[W] <= C. On the sequences S of
one sign of A (n = |S|), with W_i the weight the kernel uses (log W_i exactly as in `vespo`: token
clamp, rollout correction, length normalization, clamp to [log 1e-8, 20]):

    phi(W)      = W^k exp(lam (1 - W))
    E_Q[W]^     = sum_{i in S} phi(W_i) W_i / sum_{i in S} phi(W_i)           (self-normalized)
    ESS         = (sum_{i in S} phi(W_i))^2 / (n sum_{i in S} phi(W_i)^2)

Two rules (``rule``), each per sign, (k0, lam0) = the configured (k_pos, lambda_pos) or (k_neg, lambda_neg):

    budget   k = k0,  lam = lam_min                         if E_Q[W]^(lam_min) <= C
                      lam = lam_max                         if E_Q[W]^(lam_max) >  C
                      lam : E_Q[W]^(lam) = C                otherwise
             (d E_Q[W]^ / d lam = -Var_Q^(W) <= 0, so the root is unique; C = budget_pos / budget_neg)
    ess      (k, lam) = s (k0, lam0), i.e. phi_s = phi^s (same mode k0/lam0, flatter as s -> 0), with
             s = s_max                                  if ESS(s_max) >= target
             s = s_min                                  if ESS(s_min) <  target
             s : ESS(s) = target                        otherwise
             (d log ESS / d s = 2 (E_{p_s}[g] - E_{p_2s}[g]) <= 0 with g = log phi, p_s ~ phi^s:
             ESS only falls as the kernel sharpens, so s is the sharpest scale that keeps the target)

A sign with fewer than two sequences, or whose sequences all have the same W (at lag 0, W = 1
exactly; E_Q[W]^ and ESS then do not depend on the shape), keeps (k0, lam0). The roots
are found on detached float64 tensors by a fixed number of grid refinements (a 16-ary bisection:
8 passes of 16 points narrow the bracket by 15^8 = 2.6e9, then linear interpolation), vectorized
over both signs: no host sync, no extra forward pass, about a hundred small kernels on [2, 16, B].
The loss itself is then VESPO's with that shape:

    L = agg( -sg[phi(W_i)] * A_i * logp_it )

"Per call" means per batch the loss sees: a mini-batch, or each micro-batch when the trainer
splits one (``optim.micro_batch_size``), so adapt on batches large enough for the statistic. The
shape each sequence was trained with goes into the rows (``adaptive/k_pos``, ...), so the logged
``vespo/k_pos``, ``vespo/lambda_pos``, ``vespo/adapted_pos`` are means over the A >= 0 sequences of
the batch (``adapted``: the share of them whose kernel was adapted), whatever the micro-batching.
With W = 1 everywhere phi(1) = 1 for every shape, so the loss and gradient equal `vespo`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses.base import LossOutput, check_choice, check_range, rollout_correction
from vespo.losses.diagnostics import SIGN_NAMES, effective_sample_size, self_normalized_mean
from vespo.losses.inputs import LossInputs
from vespo.losses.kernel import sign_groups, sign_log_phi
from vespo.losses.registry import LossSpec, register
from vespo.losses.vespo import VespoConfig, kernel_loss, vespo_log_weight

RULES: tuple[str, ...] = ("budget", "ess")
MIN_SEQUENCES = 2  # a sign with fewer sequences (or no spread in W) keeps the configured kernel
SOLVER_POINTS = 16  # grid points per refinement pass
SOLVER_PASSES = 8  # refinement passes: the bracket shrinks by (SOLVER_POINTS - 1) ** SOLVER_PASSES = 2.6e9


@dataclass
class VespoAdaptiveConfig(VespoConfig):
    """VESPO whose (k, lam) per sign of A is set per call by a rule; k_pos ... lambda_neg are the base shape."""

    rule: str = "budget"
    """budget: lam solves E_Q[W]^ = C (k fixed); ess: (k, lam) scaled along the ray to the base shape
    to keep the coefficients' ESS >= ess_target."""
    budget_pos: float = 0.9985
    """C for A >= 0 (rule budget): bound on the self-normalized E_Q[W]; > 0. Calibrated so that the
    median stale batch of real N = 8 runs gets the paper's lam = 3 (docs/adaptive.md)."""
    budget_neg: float = 1.032
    """C for A < 0 (rule budget); > 0. Calibrated likewise to the paper's lam = 2."""
    lambda_min: float = 0.5
    """Lower bound of lam (rule budget), lam where the budget already holds; > 0 (mode k/lam <= 6)."""
    lambda_max: float = 10.0
    """Upper bound of lam (rule budget), lam where the budget cannot be met; >= lambda_min (mode >= 0.2)."""
    ess_target: float = 0.5
    """Target ESS fraction of the coefficients phi per sign (rule ess), in [0, 1]. The paper's kernel
    meets 0.5 on 99.8% of the stale batches of real N = 8 runs, so it is kept there (docs/adaptive.md)."""
    scale_min: float = 0.1
    """Smallest scale s of (k, lam) (rule ess): the flattest kernel allowed; > 0."""
    scale_max: float = 1.0
    """Largest scale s (rule ess): 1 never sharpens beyond the base shape; >= scale_min."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("rule", self.rule, RULES)
        for name in ("budget_pos", "budget_neg", "lambda_min", "scale_min"):
            check_range(name, getattr(self, name), 0.0, None, lo_open=True)
        check_range("lambda_max", self.lambda_max, self.lambda_min, None)
        check_range("scale_max", self.scale_max, self.scale_min, None)
        check_range("ess_target", self.ess_target, 0.0, 1.0)


def vespo_adaptive_loss(x: LossInputs, cfg: VespoAdaptiveConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """VESPO with the kernel shape per sign chosen by ``cfg.rule`` on this batch, aggregated by ``cfg.agg``."""
    correction = rollout_correction(x, cfg, log_space=True)  # once per call: its log w goes into log W
    log_w = vespo_log_weight(x, cfg, correction)  # [B, 1]
    groups = sign_groups(x.adv, x.mask, x.seq_valid)  # [2, B]
    k, lam, metrics = adapt_shape(log_w[:, 0], groups, cfg)  # [2], [2] float64
    rows = {f"adaptive/{name.removeprefix('vespo/')}": value.double().expand(len(log_w)).clone()
            for name, value in metrics.items()}  # the call's shape, on each of its rows
    return kernel_loss(x, cfg, normalizer, log_w, k.to(log_w.dtype), lam.to(log_w.dtype), correction, rows)


@torch.no_grad()
def adapt_shape(log_w: Tensor, groups: Tensor, cfg: VespoAdaptiveConfig) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The kernel shape ``k, lam [2]`` (pos, neg; float64) chosen by ``cfg.rule``, and its metrics.

    ``log_w [B]`` are the kernel's sequence log-weights, ``groups [2, B]`` the sequences of each sign.
    """
    x = log_w.detach().double()  # [B]
    k0 = x.new_tensor([cfg.k_pos, cfg.k_neg])  # [2]
    lam0 = x.new_tensor([cfg.lambda_pos, cfg.lambda_neg])  # [2]
    if cfg.rule == "budget":
        budget = x.new_tensor([cfg.budget_pos, cfg.budget_neg])  # [2]
        k, lam = k0, budget_lambda(x, groups, k0, budget, cfg)
        extra = {f"vespo/budget_{sign}": budget[row] for row, sign in enumerate(SIGN_NAMES)}
    else:
        scale = ess_scale(x, groups, k0, lam0, cfg)  # [2]
        k, lam = scale * k0, scale * lam0
        extra = {"vespo/phi_ess_target": x.new_tensor(cfg.ess_target)}
    adapted = (groups.sum(dim=-1) >= MIN_SEQUENCES) & has_spread(x, groups)  # [2]
    k, lam = torch.where(adapted, k, k0), torch.where(adapted, lam, lam0)
    metrics = dict(extra)
    for row, sign in enumerate(SIGN_NAMES):
        metrics[f"vespo/k_{sign}"] = k[row]
        metrics[f"vespo/lambda_{sign}"] = lam[row]
        metrics[f"vespo/adapted_{sign}"] = adapted[row].double()
        if cfg.rule == "ess":
            metrics[f"vespo/scale_{sign}"] = torch.where(adapted[row], scale[row], x.new_ones(()))
    return k, lam, {key: value.to(log_w.dtype) for key, value in metrics.items()}


def has_spread(x: Tensor, groups: Tensor) -> Tensor:
    """Whether the log-weights ``x [B]`` of each sign's sequences ``groups [2, B]`` are not all equal.  # [2]"""
    if x.numel() == 0:
        return groups.new_zeros(2)
    inf = x.new_tensor(float("inf"))
    hi = torch.where(groups, x, -inf).amax(dim=-1)  # [2]
    lo = torch.where(groups, x, inf).amin(dim=-1)
    return hi > lo


def budget_lambda(x: Tensor, groups: Tensor, k: Tensor, budget: Tensor, cfg: VespoAdaptiveConfig) -> Tensor:
    """lam per sign (rule budget): lam_min if E_Q[W]^ <= C there, lam_max if > C there, else the root.  # [2]"""
    w = x.exp()  # [B]

    def excess(log_lam: Tensor) -> Tensor:  # [2, P] -> E_Q[W]^ - C [2, P]
        log_phi = k[:, None, None] * x - log_lam.exp()[:, :, None] * w  # [2, P, B]; lam's e^lam cancels
        return self_normalized_mean(log_phi, w, groups[:, None, :]) - budget[:, None]

    lo, hi = x.new_full((2,), cfg.lambda_min), x.new_full((2,), cfg.lambda_max)
    root, at_lo, at_hi = decreasing_root(excess, lo.log(), hi.log())  # in log lam
    return torch.where(at_lo <= 0, lo, torch.where(at_hi > 0, hi, root.exp()))


def ess_scale(x: Tensor, groups: Tensor, k0: Tensor, lam0: Tensor, cfg: VespoAdaptiveConfig) -> Tensor:
    """s per sign (rule ess): s_max if ESS(s_max) >= target, s_min if ESS(s_min) < target, else the root.  # [2]"""
    log_phi = sign_log_phi(x, k0, lam0)  # [2, B], the base kernel; phi^s has log s * log_phi

    def excess(s: Tensor) -> Tensor:  # [2, P] -> ESS(s) - target [2, P]
        return effective_sample_size(s[:, :, None] * log_phi[:, None, :], groups[:, None, :]) - cfg.ess_target

    lo, hi = x.new_full((2,), cfg.scale_min), x.new_full((2,), cfg.scale_max)
    root, at_lo, at_hi = decreasing_root(excess, lo, hi)
    return torch.where(at_hi >= 0, hi, torch.where(at_lo < 0, lo, root))


def decreasing_root(fn: Callable[[Tensor], Tensor], lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where the decreasing ``fn`` crosses 0 in [lo, hi], per row; also fn(lo) and fn(hi).  # [R] each

    ``fn`` maps points [R, P] to values [R, P]. Each pass evaluates SOLVER_POINTS points spanning
    the bracket and keeps the interval between the last point with fn > 0 and the next one; the
    root is then interpolated linearly in that interval. Fixed work, no host sync. The root is
    only meaningful where fn(lo) > 0 >= fn(hi).
    """
    steps = torch.linspace(0.0, 1.0, SOLVER_POINTS, dtype=lo.dtype, device=lo.device)  # [P]
    a, b = lo, hi
    at_lo = at_hi = fa = fb = None
    for _ in range(SOLVER_PASSES):
        points = a[:, None] + (b - a)[:, None] * steps  # [R, P]
        values = fn(points)  # [R, P]
        if at_lo is None:
            at_lo, at_hi = values[:, 0], values[:, -1]
        last = ((values > 0).sum(dim=-1) - 1).clamp(0, SOLVER_POINTS - 2)[:, None]  # [R, 1]
        a, b = points.gather(1, last)[:, 0], points.gather(1, last + 1)[:, 0]
        fa, fb = values.gather(1, last)[:, 0], values.gather(1, last + 1)[:, 0]
    t = (fa / (fa - fb)).nan_to_num(nan=0.5).clamp(0.0, 1.0)  # fa > 0 >= fb inside a bracket
    return a + (b - a) * t, at_lo, at_hi


register(LossSpec("vespo_adaptive", vespo_adaptive_loss, VespoAdaptiveConfig, per_row=False))
