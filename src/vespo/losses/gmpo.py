"""GMPO: the geometric mean of the token ratios, each clipped in log space before the mean.

Geometric-Mean Policy Optimization (arXiv 2507.20673, code callsys/GMPO; verl 0.9.1 `geo_mean`,
verl/trainer/ppo/core_algos.py `compute_policy_loss_geo_mean`). Per sequence i, with d_it = logp_it - old_logp_it
clamped to +-20 and A_i = (1/T_i) sum_t m_it A_it:

    c_it   = min(d_it, eps_high)   if A_it > 0        (verl: sgn(A) min(sgn(A) d, sgn(A) clip(d, -eps_low, eps_high)))
             max(d_it, -eps_low)   if A_it < 0
             0                     if A_it = 0
    rho_i  = exp((1/T_i) sum_t m_it c_it)
    l_it   = -A_i rho_it,   rho_it = value rho_i, gradient rho_i grad c_it      (the token form)
    L      = agg(l)                                 default seq-mean-token-mean: (1/N_seqs) sum_i -A_i rho_i

so d L / d logp_it = -A_i rho_i / (T_i N_seqs) where the token's clip does not bind, as verl's. Gradient weight:
w_it = rho_i A_i / A_it on an unclipped token (rho_i for a sequence advantage), 0 on a clipped one.
Defaults: eps_low = eps_high = 0.4, the paper's clip range (e^-0.4, e^0.4) (verl reads its PPO clip_ratio, 0.2).
Where it differs from verl: verl ignores loss_agg_mode and takes torch.mean over all rows (rows without valid
tokens included); here agg applies (its default is verl's mean over the rows with a valid token). verl's token
log-ratio is not clamped (its clamp line is commented out). With a rollout correction verl multiplies each
sequence by the geometric mean of its token weights; here the token weights multiply the token losses as in every
loss (for sequence modes the same; for token modes the arithmetic mean over the sequence).
Rows: clip_high / clip_low count A > 0 tokens above eps_high / A < 0 tokens below -eps_low (verl's
pg_clipfrac counts every token whose clip binds either way, by A's sign).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, check_range, finish
from vespo.losses.diagnostics import token_counts
from vespo.losses.inputs import LossInputs
from vespo.losses.registry import LossSpec, register


@dataclass
class GmpoConfig(BaseLossConfig):
    """The log-space clip range of each token before the geometric mean."""

    agg: str = "seq-mean-token-mean"
    """Aggregation mode: seq-mean-token-mean (verl's mean over sequences) | token-mean | seq-mean-token-sum |
    seq-mean-token-sum-norm (these weigh each sequence's term by its length)."""
    eps_low: float = 0.4
    """A < 0 tokens: the log-ratio is clipped below at -eps_low; >= 0."""
    eps_high: float = 0.4
    """A > 0 tokens: the log-ratio is clipped above at eps_high; >= 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("eps_low", self.eps_low, 0.0, None)
        check_range("eps_high", self.eps_high, 0.0, None)


def gmpo_loss(x: LossInputs, cfg: GmpoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-A_i * exp(mean_t clipped log-ratio) per sequence in its token form, aggregated by ``cfg.agg``."""
    d = x.clamped_log_ratio  # [B, T] carries the gradient, 0 on padding
    adv = x.adv.expand_as(d) * x.mask_f  # [B, T]
    clipped = torch.where(adv > 0, d.clamp(max=cfg.eps_high), torch.where(adv < 0, d.clamp(min=-cfg.eps_low), 0.0))
    clipped = clipped * x.mask_f
    tokens = x.tokens.clamp(min=1.0)[:, None]  # [B, 1]
    log_rho = clipped.detach().sum(dim=-1, keepdim=True) / tokens  # [B, 1] sg[log rho_i]
    rho_it = (log_rho + clipped - clipped.detach()).exp()  # [B, T] value rho_i, gradient rho_i grad c_it
    seq_adv = adv.sum(dim=-1, keepdim=True) / tokens  # [B, 1] A_i
    loss_mat = -seq_adv * rho_it
    with torch.no_grad():
        live = (x.log_ratio.abs() < 20.0) & ~((adv > 0) & (d > cfg.eps_high)) & ~((adv < 0) & (d < -cfg.eps_low))
        ratio_adv = torch.where(adv != 0, seq_adv / torch.where(adv != 0, adv, 1.0), 0.0)
        weight = torch.where(live, log_rho.exp() * ratio_adv, 0.0)  # [B, T]
        rows = {"clip_high": token_counts((adv > 0) & (d > cfg.eps_high), x.mask_f),
                "clip_low": token_counts((adv < 0) & (d < -cfg.eps_low), x.mask_f)}
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


register(LossSpec("gmpo", gmpo_loss, GmpoConfig))
