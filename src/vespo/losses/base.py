"""What every loss shares: the config base (agg, rollout correction), field checks, log W, the final step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vespo.losses._checks import LossInputs
from vespo.losses.aggregation import check_agg_mode, reduce_masked
from vespo.losses.diagnostics import base_metrics
from vespo.losses.rollout_correction import RolloutCorrection, correction_weight
from vespo.types import LossOutput

TOKEN_LOG_RATIO_CLAMP = 20.0  # token log-ratios are clamped to +-20 before exp (official VESPO, verl)


@dataclass
class LossConfig:
    """Options common to all losses. Subclasses set their own `agg` default."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum."""
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    """Correction for pi_old vs the inference engine's pi_rollout (needs rollout_logp unless mode=none).
    A dict such as {"mode": "tis_token", "threshold": 2.0} is accepted and converted."""

    def __post_init__(self) -> None:
        check_agg_mode(self.agg)
        if isinstance(self.rollout_correction, dict):
            self.rollout_correction = RolloutCorrection(**self.rollout_correction)
        if not isinstance(self.rollout_correction, RolloutCorrection):
            raise ValueError(
                "rollout_correction must be a RolloutCorrection or a dict, "
                f"got {type(self.rollout_correction).__name__}"
            )


def check_range(
    name: str, value: object, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a finite real number in the range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (lo is None or (value > lo if lo_open else value >= lo)) and (hi is None or value <= hi)
    if not ok:
        low = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        high = "" if hi is None else f"<= {hi}"
        allowed = " and ".join(x for x in (low, high) if x) or "finite"
        raise ValueError(f"{name} must be a finite number {allowed}; got {value!r}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def sequence_log_weight(logp: Tensor, old_logp: Tensor, mask: Tensor, token_clamp: float | None = None) -> Tensor:
    """log W_i = sum_t m_it (logp_it - old_logp_it), the log of the sequence importance weight.  # [B]

    Masked positions are ignored even if they hold NaN/inf. With ``token_clamp``, each token's
    log-ratio is first clamped to [-token_clamp, token_clamp] (VESPO uses 20). Carries logp's grad.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp shape {tuple(logp.shape)}, old_logp shape {tuple(old_logp.shape)} and mask shape "
            f"{tuple(mask.shape)} must match"
        )
    mask_b = mask if mask.dtype == torch.bool else mask != 0
    log_ratio = torch.where(mask_b, logp - old_logp.detach(), logp.new_zeros(()))  # [B, T]
    if token_clamp is not None:
        log_ratio = log_ratio.clamp(-token_clamp, token_clamp)
    return log_ratio.sum(dim=-1)


def finish(
    loss_mat: Tensor,
    inp: LossInputs,
    cfg: LossConfig,
    normalizer: float | Tensor | None,
    extra_metrics: dict[str, Tensor],
) -> LossOutput:
    """Aggregate the per-token loss ``loss_mat [B, T]`` by ``cfg.agg`` and attach the shared metrics.

    ``loss_mat`` must be finite on padding (true of any loss built from the cleaned inputs).
    """
    loss = reduce_masked(loss_mat * inp.mask_f, inp.tokens, cfg.agg, normalizer)
    log_ratio = inp.log_ratio.detach()  # [B, T], 0 on padding
    rollout_d = None if inp.rollout_logp is None else inp.rollout_logp - inp.old_logp
    metrics = base_metrics(loss, log_ratio.sum(dim=-1), inp.seq_valid, log_ratio, inp.tokens, rollout_d)
    return LossOutput(loss=loss, metrics={**metrics, **extra_metrics})


def apply_rollout_correction(loss_mat: Tensor, inp: LossInputs, cfg: LossConfig) -> Tensor:
    """Multiply the per-token loss by the detached rollout-correction weight (identity for mode none)."""
    weight = correction_weight(inp.old_logp, inp.rollout_logp, cfg.rollout_correction)
    return loss_mat if weight is None else loss_mat * weight


def token_ratio(inp: LossInputs) -> Tensor:
    """r = exp(clamp(logp - old_logp, -20, 20)), with grad.  # [B, T]"""
    return torch.exp(inp.log_ratio.clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP))
