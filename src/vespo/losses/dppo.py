"""DPPO: a trust-region mask on an estimate of the policy divergence per token instead of ratio clipping.

Divergence Proximal Policy Optimization (Qi et al., arXiv 2602.04879, code sail-sg/Stable-RL; verl's
`dppo_tv` / `dppo_kl`, prime-rl's default loss). PPO clips the ratio of the sampled token, a noisy
one-sample estimate of how far the policy moved; DPPO masks a token when a direct estimate of the
divergence between mu(.|s_t) and pi(.|s_t) leaves the trust region, in the direction the advantage
pushes. Its "binary" estimates look at the sampled token against all others, p = pi(y_t), q = mu(y_t):

    tv   D_t = p - q                                   (signed; the binary total variation is |D_t|)
         outside_t = D_t > delta_high          if A_t > 0  (the token's probability rose too far)
                     D_t < -delta_low          if A_t <= 0 (it fell too far)
    kl   D_t = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))   (KL of the two Bernoullis)
         outside_t = not D_t <= delta_high and p > q   if A_t > 0
                     not D_t <= delta_low  and p < q   if A_t <= 0

    r_t = exp(clamp(logp - old_logp, +-20))
    l_t = -A_t * sg[min(r_t, C)] * (1 - outside_t) * logp_t      (C = ratio_cap; None: no cap)
    L   = agg(l)                                                  default token-mean

so the gradient weight is w_t = min(r_t, C) inside the trust region and 0 outside: the gradient of
PPO's unclipped surrogate -A r where the update is still trusted. The loss is written in verl's
REINFORCE form (a detached ratio times logp), so its value and gradient both equal verl's.

Defaults are the paper's (verl's example script): delta = 0.15 for tv, 0.05 for kl, and no ratio cap
(the script sets verl's clip_ratio_c to 1e4, i.e. off; the paper finds the truncation biases against
rare tokens). verl's functions truncate at `actor.clip_ratio_c` (3.0 in its actor.yaml). The
divergence is measured against old_logp, the behaviour policy mu this loss is given, which is the
rollout policy the paper recommends anchoring to when mu is the engine's log-probs.

prime-rl's default loss is binary-TV DPPO plus a penalty 1e-3 (log r)^2, which is not included here.

Rows: trust_mask_high / trust_mask_low count the A > 0 / A < 0 tokens outside the trust region
(loss/trust_mask_frac_high|low); with a cap, ratio_cap counts kept tokens with r > C (loss/ratio_cap_frac).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, check_choice, check_range, finish
from vespo.losses.diagnostics import token_counts
from vespo.losses.inputs import LossInputs
from vespo.losses.registry import LossSpec, register

DIVERGENCES: tuple[str, ...] = ("tv", "kl")
DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}  # the paper's thresholds (verl's examples/dppo_trainer)
BINARY_KL_EPS = 1e-8  # guards log(1 - p) at p = 1, as in verl and the authors' code


@dataclass
class DppoConfig(BaseLossConfig):
    """Which divergence estimate bounds the trust region, its thresholds per side, and an optional ratio cap."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    divergence: str = "tv"
    """tv (binary total variation, p - q) or kl (binary KL); p = pi(y_t), q = mu(y_t)."""
    delta_low: float | None = None
    """Threshold for A <= 0 tokens (probability falling); >= 0. None: 0.15 for tv, 0.05 for kl."""
    delta_high: float | None = None
    """Threshold for A > 0 tokens (probability rising); >= 0. None: 0.15 for tv, 0.05 for kl."""
    ratio_cap: float | None = None
    """C: the detached ratio is truncated at C (verl's clip_ratio_c); >= 1, or None for no cap (the paper)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("divergence", self.divergence, DIVERGENCES)
        for name in ("delta_low", "delta_high"):
            if getattr(self, name) is None:
                setattr(self, name, DEFAULT_DELTA[self.divergence])
            check_range(name, getattr(self, name), 0.0, None)
        if self.ratio_cap is not None:
            check_range("ratio_cap", self.ratio_cap, 1.0, None)


def dppo_loss(x: LossInputs, cfg: DppoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-A * sg[min(r, C)] * logp on the tokens inside the trust region, aggregated by ``cfg.agg``."""
    high, low = outside_trust_region(x.logp, x.old_logp, cfg)  # [B, T] bool each
    outside = torch.where(x.adv > 0, high, low)  # [B, T]
    ratio = x.clamped_log_ratio.detach().exp()  # [B, T] r_t
    capped = ratio if cfg.ratio_cap is None else ratio.clamp(max=cfg.ratio_cap)
    weight = torch.where(outside, 0.0, capped)  # [B, T] w_t
    loss_mat = -x.adv * weight * x.logp
    rows = {"trust_mask_high": token_counts((x.adv > 0) & high, x.mask_f),
            "trust_mask_low": token_counts((x.adv < 0) & low, x.mask_f)}
    if cfg.ratio_cap is not None:
        rows["ratio_cap"] = token_counts(~outside & (ratio > cfg.ratio_cap), x.mask_f)
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


@torch.no_grad()
def outside_trust_region(logp: Tensor, old_logp: Tensor, cfg: DppoConfig) -> tuple[Tensor, Tensor]:
    """Per token, whether the update left the trust region upwards (``high``, judged for A > 0) and
    downwards (``low``, for A <= 0), by the binary divergence estimate of ``cfg``; float64.  # [B, T] x 2"""
    lp, lq = logp.double(), old_logp.double()  # [B, T]
    p, q = lp.exp(), lq.exp()
    if cfg.divergence == "tv":
        return p - q > cfg.delta_high, p - q < -cfg.delta_low
    d = binary_kl(lq, lp)  # NaN only where an input "probability" exceeds 1: then the direction decides
    return ~(d <= cfg.delta_high) & (p > q), ~(d <= cfg.delta_low) & (p < q)


def binary_kl(log_q: Tensor, log_p: Tensor) -> Tensor:
    """KL(Bernoulli(q) || Bernoulli(p)) from the log-probabilities of the sampled token, 1e-8 guarded."""
    q, p = log_q.exp(), log_p.exp()
    return q * (log_q - log_p) + (1 - q) * torch.log((1 - q + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS))


register(LossSpec("dppo", dppo_loss, DppoConfig))
