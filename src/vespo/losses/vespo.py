"""VESPO: REINFORCE scaled by a gamma-shaped kernel of the sequence importance weight (arXiv 2602.10693).

    log W_i = clamp( norm( sum_t m_it clamp(logp_it - old_logp_it, +-20) + log w_rc,i ), log 1e-8, 20 )
    phi(W)  = W^k exp(lam (1 - W)),  log phi = lam + k log W - lam W      (phi(1) = 1, mode k/lam)
    (k, lam) = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg);  lam clamped >= 1e-4
    L       = agg( -sg[phi(W_i)] * A_i * logp_it )       =>  grad = -phi * A * grad logp / normalizer

norm is the length-normalization ablation: none (the paper's choice), sqrt (/ sqrt T_i) or linear
(/ T_i). log w_rc is the optional rollout correction log(pi_old / pi_rollout), truncated or masked
(see rollout_correction.py), added in log space. Non-finite phi is set to 0 (official numerics).
With token advantages [B, T], (k, lam) are chosen per token by that token's sign, as in TRL.

NoMu (``nomu_group``, the authors' ``use_nomu``; their verl recipe's megatron worker, `_compute_nomu_group_mean`):
mu is replaced by the group mean of the current policy, so W no longer depends on the behaviour policy. With
G_i = the mean over row i's group (``nomu_group`` consecutive rows, verl's layout) of each row's mean token log pi
(a row without valid tokens counts 0), the authors set old_logp_it = G_i / T_i, hence

    log W_i = sum_t m_it clamp(logp_it - G_i / T_i, +-20)     (= sum_t logp_it - G_i inside the clamp)

(a sum of log-probs minus a group mean of per-token means, as their code computes it). pi is the update's own
forward (sg[logp]), theirs is a no-grad forward at the same weights before the step: the same values. Each loss
call must hold whole groups (its rows a multiple of nomu_group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, check_choice, check_range, finish, rollout_correction
from vespo.losses.diagnostics import kernel_rows
from vespo.losses.inputs import TOKEN_LOG_RATIO_CLAMP, LossInputs
from vespo.losses.kernel import kernel_phi
from vespo.losses.registry import LossSpec, register
from vespo.losses.rollout_correction import LOG_W_MAX, LOG_W_MIN, Correction

LENGTH_NORMS: tuple[str, ...] = ("none", "sqrt", "linear")


@dataclass
class VespoConfig(BaseLossConfig):
    """The gamma kernel's shape for each advantage sign, and the length-normalization ablation."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean (official) | seq-mean-token-mean | seq-mean-token-sum."""
    k_pos: float = 2.0
    """Kernel power k for A >= 0; >= 0 (phi ~ W^k as W -> 0)."""
    lambda_pos: float = 3.0
    """Kernel rate lambda for A >= 0; >= 0 (clamped to >= 1e-4 when used; mode of phi at k/lambda)."""
    k_neg: float = 3.0
    """Kernel power k for A < 0; >= 0."""
    lambda_neg: float = 2.0
    """Kernel rate lambda for A < 0; >= 0 (clamped to >= 1e-4 when used)."""
    length_norm: str = "none"
    """Divide log W by nothing (none, the paper's choice), sqrt(T_i) (sqrt) or T_i (linear)."""
    nomu_group: int | None = None
    """NoMu (the authors' use_nomu): mu replaced by the group mean of pi over groups of this many consecutive rows
    (the rollout group size); None is off. An integer >= 2 (a group of one would make W = 1 for every sequence)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            check_range(name, getattr(self, name), 0.0, None)
        check_choice("length_norm", self.length_norm, LENGTH_NORMS)
        if self.nomu_group is not None and not (isinstance(self.nomu_group, int)
                                                and not isinstance(self.nomu_group, bool) and self.nomu_group >= 2):
            raise ValueError(f"nomu_group must be None or an integer >= 2 (the rollout group size); "
                             f"got {self.nomu_group!r}")


def vespo_loss(x: LossInputs, cfg: VespoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """-sg[phi(W)] * A * logp per token, aggregated by ``cfg.agg``."""
    correction = rollout_correction(x, cfg, log_space=True)  # once per call: its log w goes into log W
    log_w = vespo_log_weight(x, cfg, correction)  # [B, 1]
    k, lam = fixed_shape(cfg, log_w)  # [2], [2]
    return kernel_loss(x, cfg, normalizer, log_w, k, lam, correction)


def kernel_loss(
    x: LossInputs, cfg: VespoConfig, normalizer: float | Tensor | None, log_w: Tensor, k: Tensor, lam: Tensor,
    correction: Correction | None, rows: dict[str, Tensor] | None = None,
) -> LossOutput:
    """VESPO's loss with the kernel shape ``k, lam [2]`` (pos, neg) on the sequence log-weights ``log_w [B, 1]``,
    which hold the rollout ``correction``'s log-weight."""
    phi = kernel_phi(log_w, x.adv, k, lam)  # [B, 1] or [B, T], detached
    loss_mat = -phi * x.adv * x.logp  # [B, T]
    shape_rows = kernel_rows(phi, x.adv, x.mask, log_w, k, lam)
    return finish(loss_mat, phi, x, cfg, normalizer, {**shape_rows, **(rows or {})}, corrected=True,
                  correction=correction)


@torch.no_grad()
def vespo_log_weight(x: LossInputs, cfg: VespoConfig, correction: Correction | None) -> Tensor:
    """The clamped (and optionally corrected, length-normalized) sequence log-weight, detached.  # [B, 1]

    ``correction``: the call's rollout correction, with its log-weight (``rollout_correction(x, cfg, True)``)."""
    if cfg.nomu_group is None:
        log_w = x.clamped_log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]
    else:
        log_w = nomu_log_weight(x, cfg.nomu_group)
    if correction is not None:
        log_w = log_w + correction.log_weight.sum(dim=-1, keepdim=True)  # [B, T] or [B, 1] summed
    lengths = x.tokens.clamp(min=1.0)[:, None]  # [B, 1]
    if cfg.length_norm == "sqrt":
        log_w = log_w / lengths.sqrt()
    elif cfg.length_norm == "linear":
        log_w = log_w / lengths
    return log_w.clamp(LOG_W_MIN, LOG_W_MAX)


@torch.no_grad()
def nomu_log_weight(x: LossInputs, group: int) -> Tensor:
    """NoMu's log W_i = sum_t m_it clamp(logp_it - G_i / T_i, +-20), G_i the group mean of the rows' mean token
    log pi (module docstring).  # [B, 1]"""
    B = x.logp.shape[0]
    if B % group:
        raise ValueError(f"nomu_group={group} needs whole groups in each loss call; got {B} rows "
                         "(a micro-batch must hold a multiple of the group size)")
    tokens = x.tokens.clamp(min=1.0)  # [B]
    seq_mean = (x.logp.detach() * x.mask_f).sum(dim=-1) / tokens  # [B]
    group_mean = seq_mean.view(B // group, group).mean(dim=1, keepdim=True).expand(B // group, group).reshape(B)
    mu = (group_mean / tokens)[:, None]  # [B, 1] the per-token stand-in for log mu
    d = torch.where(x.mask, x.logp.detach() - mu, 0.0).clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)
    return d.sum(dim=-1, keepdim=True)


def fixed_shape(cfg: VespoConfig, like: Tensor) -> tuple[Tensor, Tensor]:
    """The configured kernel shape as tensors ``k, lam [2]`` (pos, neg) in ``like``'s dtype and device."""
    k = torch.tensor([cfg.k_pos, cfg.k_neg], dtype=like.dtype, device=like.device)
    lam = torch.tensor([cfg.lambda_pos, cfg.lambda_neg], dtype=like.dtype, device=like.device)
    return k, lam


@torch.no_grad()
def gamma_phi(log_w: Tensor, adv: Tensor, cfg: VespoConfig) -> Tensor:
    """phi = exp(lam + k log W - lam W) with (k, lam) picked by the sign of ``adv`` (A >= 0: positive pair)."""
    return kernel_phi(log_w, adv, *fixed_shape(cfg, log_w))


register(LossSpec("vespo", vespo_loss, VespoConfig))
