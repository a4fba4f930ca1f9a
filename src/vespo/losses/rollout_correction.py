"""Rollout correction: importance weights of the trainer's pi_old over the inference engine's pi_rollout.

The rollout engine's log-probs differ from the trainer's recompute of the same policy (other
kernels, precision, MoE routing). With rho_t = pi_old / pi_rollout per token:

    tis_token   w_t = min(rho_t, C)                       truncated, per token
    tis_seq     w_i = min(prod_t rho_t, C)                truncated, per sequence
    mis_token   w_t = rho_t if rho_t <= C else 0          masked, per token
    mis_seq     w_i = prod_t rho_t if <= C else 0         masked, per sequence

Weights are detached. Every loss but VESPO multiplies its per-token loss by w; VESPO adds
log w to its sequence log-weight log W instead (as the VESPO paper does), so a masked token (w = 0) sends that
sequence's W, and hence phi, to ~0. Log-weights are clamped to [log 1e-8, 20] like VESPO's
official numerics, which keeps masked weights finite in log space.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ROLLOUT_CORRECTION_MODES: tuple[str, ...] = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq")
LOG_W_MIN = math.log(1e-8)  # official lower clamp of a log-weight
LOG_W_MAX = 20.0  # official upper clamp of a log-weight


@dataclass
class RolloutCorrection:
    """How to correct for the gap between the rollout engine and the trainer (pi_old / pi_rollout)."""

    mode: str = "none"
    """none | tis_token | tis_seq | mis_token | mis_seq (truncate or mask, per token or per sequence)."""
    threshold: float = 2.0
    """C: weights above it are truncated to C (tis_*) or masked to 0 (mis_*); must be > 0."""

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_CORRECTION_MODES:
            raise ValueError(
                f"rollout_correction.mode must be one of {', '.join(ROLLOUT_CORRECTION_MODES)}; got {self.mode!r}"
            )
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"rollout_correction.threshold must be a finite number > 0; got {self.threshold!r}")


def correction_weight(rollout_d: Tensor | None, cfg: RolloutCorrection) -> Tensor | None:
    """The detached weight w: [B, T] for *_token modes, [B, 1] for *_seq; None if mode is none.

    ``rollout_d`` is rollout_logp - old_logp per token, 0 on padding (padding then gets w = 1 when C >= 1).
    """
    log_rho = _log_rho(rollout_d, cfg)
    if log_rho is None:
        return None
    log_c = math.log(cfg.threshold)
    if cfg.mode.startswith("tis"):
        return torch.exp(log_rho.clamp(max=log_c))
    return torch.where(log_rho <= log_c, torch.exp(log_rho.clamp(max=log_c)), log_rho.new_zeros(()))


def correction_log_weight(rollout_d: Tensor | None, mask_f: Tensor, cfg: RolloutCorrection) -> Tensor | None:
    """log w clamped to [log 1e-8, 20] (a masked weight becomes log 1e-8), the term VESPO adds to log W.

    Shapes as in :func:`correction_weight`; padding (``mask_f`` [B, T] = 0) gets log w = 0.
    """
    log_rho = _log_rho(rollout_d, cfg)
    if log_rho is None:
        return None
    log_c = math.log(cfg.threshold)
    if cfg.mode.startswith("tis"):
        log_w = log_rho.clamp(max=log_c)
    else:
        log_w = torch.where(log_rho <= log_c, log_rho, torch.full_like(log_rho, LOG_W_MIN))
    log_w = log_w.clamp(LOG_W_MIN, LOG_W_MAX)
    if cfg.mode.endswith("_token"):
        log_w = log_w * mask_f  # log_w is finite, so this equals where(mask, log_w, 0)
    return log_w


def _log_rho(rollout_d: Tensor | None, cfg: RolloutCorrection) -> Tensor | None:
    """log(pi_old / pi_rollout) per token [B, T], or summed per sequence [B, 1] for *_seq modes."""
    if cfg.mode == "none":
        return None
    if rollout_d is None:
        raise ValueError(f"rollout_correction.mode={cfg.mode!r} needs rollout_logp, but rollout_logp is None")
    log_rho = -rollout_d.detach()  # [B, T], 0 on padding
    return log_rho.sum(dim=-1, keepdim=True) if cfg.mode.endswith("_seq") else log_rho
