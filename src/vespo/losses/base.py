"""What every loss shares: its output type, the config base (aggregation, rollout correction), field
checks, the sequence log-weight, and the last step of every loss (:func:`finish`).

A loss is ``fn(x: LossInputs, cfg, normalizer=None) -> LossOutput``, plain autograd code: from the
inputs the caller prepared once (:func:`vespo.losses.inputs.prepare_inputs`) it builds the per-token
loss l_it [B, T] as its paper writes it (gradient through logp only), and hands it to :func:`finish`,
which applies the rollout correction (the one place it is applied, but for VESPO, which adds it to
log W), aggregates (``cfg.agg``, :mod:`vespo.losses.aggregation`) and adds the rows every loss reports
(:mod:`vespo.losses.diagnostics`). Each loss also states its *gradient weight* w_it, the factor on
REINFORCE's -A_it grad log pi_it in its gradient (VESPO: phi(W_i)); the per-row average of w is
``LossOutput.seq_weight`` (tests hold it equal to autograd's gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vespo.losses.aggregation import NORM_AGG, check_agg_mode, token_weights
from vespo.losses.diagnostics import Rows, base_rows, summarize, token_counts
from vespo.losses.inputs import LossInputs
from vespo.losses.opsm import opsm_keep
from vespo.losses.rollout_correction import (BYPASS_BATCH_NORMALIZE, BYPASS_ICEPOP, BYPASS_TRUNCATION, TRUNCATING,
                                              Correction, RolloutCorrection, correct)


@dataclass
class LossOutput:
    """What every policy loss returns."""

    loss: Tensor  # [] scalar, carries the gradient
    rows: Rows  # name -> [B] float64 per-row statistics, detached (vespo.losses.diagnostics)
    seq_weight: Tensor | None = None  # [B] detached: each row's gradient weight relative to REINFORCE
    #                                    (-A * grad log pi), averaged over its tokens (VESPO: phi(W)); NaN where A = 0

    @property
    def metrics(self) -> dict[str, Tensor]:
        """This call's diagnostics (0-dim tensors); for a batch split into calls, summarize the concatenated rows."""
        return summarize(self.rows)


@dataclass
class BaseLossConfig:
    """Options common to all losses. Subclasses set their own `agg` default."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    """Correction for the engine's pi_rollout (needs rollout_logp unless mode=none): of pi_old / pi_rollout
    with mu recomputed, of pi_theta / pi_rollout (its rejection part) with mu = the engine's log-probs.
    A dict such as {"mode": "tis_token", "threshold": 2.0} is accepted and converted."""
    opsm_delta: float | None = None
    """OPSM (DeepSeek-V3.2): mask a sequence with A < 0 whose mean token log(mu / pi_theta) exceeds this;
    None is off (TRL's default; its docs suggest 0.5, slime's default is 1e-4). See vespo.losses.opsm."""
    norm_length: float | None = None
    """C of agg=seq-mean-token-sum-norm (Dr.GRPO): the token sums are divided by (sequences x C); verl's
    loss_scale_factor, TRL's max_completion_length. Required with that mode, refused with any other; > 0."""

    def __post_init__(self) -> None:
        check_agg_mode(self.agg)
        if isinstance(self.rollout_correction, dict):
            self.rollout_correction = RolloutCorrection(**self.rollout_correction)
        if not isinstance(self.rollout_correction, RolloutCorrection):
            raise ValueError(
                "rollout_correction must be a RolloutCorrection or a dict, "
                f"got {type(self.rollout_correction).__name__}"
            )
        if self.opsm_delta is not None:
            check_range("opsm_delta", self.opsm_delta)
        if (self.agg == NORM_AGG) != (self.norm_length is not None):
            raise ValueError(f"norm_length (the constant length C) is required with agg={NORM_AGG} and applies to "
                             f"it only; got agg={self.agg!r}, norm_length={self.norm_length!r}")
        if self.norm_length is not None:
            check_range("norm_length", self.norm_length, 0.0, None, lo_open=True)

    @property
    def weighs_by_ratio(self) -> bool:
        """Whether the loss weighs a token by its own ratio pi_theta / mu (every loss but reinforce with
        is_level=none): with mu = the engine's log-probs that ratio already is the rollout correction's."""
        return True

    def bypass_refusal(self) -> str | None:
        """Why this config cannot run with mu = the engine's log-probs (bypass mode), or None if it can."""
        if self.weighs_by_ratio and self.rollout_correction.mode in TRUNCATING:
            return BYPASS_TRUNCATION.format(mode=self.rollout_correction.mode)
        if self.weighs_by_ratio and self.rollout_correction.mode == "icepop":
            return BYPASS_ICEPOP
        if self.weighs_by_ratio and self.rollout_correction.batch_normalize:
            return BYPASS_BATCH_NORMALIZE
        return None


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
    grad_weight: Tensor,
    x: LossInputs,
    cfg: BaseLossConfig,
    normalizer: float | Tensor | None,
    rows: Rows | None = None,
    corrected: bool = False,
    correction: Correction | None = None,
) -> LossOutput:
    """Correct, aggregate by ``cfg.agg`` and add the shared rows to the per-token loss ``loss_mat [B, T]``.

    ``grad_weight`` ([B, T] or [B, 1], detached) is the loss's gradient weight w_it (module docstring).
    The rollout correction's detached weight (``cfg.rollout_correction``) multiplies both, unless the
    loss applied the correction itself (``corrected``: VESPO adds its log to log W), computed once per call
    (:func:`rollout_correction`): then ``correction`` is the one it applied, which the rows report.
    """
    if not corrected:
        correction = rollout_correction(x, cfg)
        if correction is not None:
            loss_mat, grad_weight = loss_mat * correction.weight, grad_weight * correction.weight
    rows = {**correction_rows(correction, x), **(rows or {})}
    if cfg.opsm_delta is not None:
        keep = opsm_keep(x.log_ratio, x.adv, x.tokens, cfg.opsm_delta).to(loss_mat.dtype)  # [B, 1] or [B, T]
        loss_mat, grad_weight = loss_mat * keep, grad_weight * keep
        rows["opsm_masked"] = token_counts(keep == 0, x.mask_f)
    share = loss_mat * token_weights(x.mask_f, cfg.agg, normalizer, cfg.norm_length)  # [B, T] each token's share
    all_rows = {**base_rows(x.log_ratio, x.mask_f, share, x.rollout_d, x.engine_log_ratio), **rows}
    return LossOutput(loss=share.sum(), rows=all_rows, seq_weight=sequence_weight(grad_weight, x))


@torch.no_grad()
def sequence_weight(grad_weight: Tensor, x: LossInputs) -> Tensor:
    """Each row's gradient weight relative to REINFORCE: sum_t w_it (-A_it) / sum_t (-A_it) over its valid
    tokens (the mean of w for a sequence advantage); NaN where the row's advantage sums to 0.  # [B]"""
    minus_adv = (-x.adv * x.mask_f).double()  # [B, T]
    num = (grad_weight.double() * minus_adv).sum(dim=-1)
    den = minus_adv.sum(dim=-1)
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), math.nan).to(x.logp.dtype)


def correction_rows(correction: Correction | None, x: LossInputs) -> Rows:
    """Per row, the valid tokens whose rollout-correction weight is 0 (rollout_masked: mis_*, geo_mask,
    icepop) and, for tis_*, those whose weight was truncated at C (rollout_truncated)."""
    if correction is None:
        return {}
    rows = {"rollout_masked": token_counts(correction.weight == 0, x.mask_f)}
    if correction.truncated is not None:  # [B, T] or [B, 1]
        rows["rollout_truncated"] = token_counts(correction.truncated, x.mask_f)
    return rows


def rollout_correction(x: LossInputs, cfg: BaseLossConfig, log_space: bool = False) -> Correction | None:
    """The call's rollout correction (None for mode none), its weight detached, [B, T] or [B, 1]: of pi_old /
    pi_rollout, or in bypass mode the rejection part of pi_theta / pi_rollout (the whole weight for a loss without
    a ratio of its own); with ``log_space`` its log-weight too (VESPO). A truncation or IcePop in bypass mode raises
    (``BaseLossConfig.bypass_refusal``)."""
    return correct(x.rollout_d, x.mask_f, cfg.rollout_correction, bypass_rejects(x, cfg), log_space)


def bypass_rejects(x: LossInputs, cfg: BaseLossConfig) -> bool:
    """Whether the correction applies as its rejection part only: bypass mode, on a loss with its own ratio."""
    return x.bypass and cfg.weighs_by_ratio
