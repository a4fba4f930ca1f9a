"""What every loss shares: the config base (agg, rollout correction), field checks, log W, the final step.

Each loss computes its per-token loss and its gradient coefficient without autograd, from the
detached inputs of :func:`prepare_inputs`: every loss here has a gradient of the form
coef_it * grad logp_it (ratios, weights and kernels are functions of logp, but their derivatives
are known in closed form). :func:`finish` aggregates the value exactly as before and attaches
the gradient coef * d(agg)/d(loss_it) to the caller's logp with one small autograd function, so
the backward pass is a single multiply instead of a replay of the whole forward graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vespo.losses._checks import LossInputs
from vespo.losses.aggregation import agg_grad_scale, check_agg_mode, reduce_masked, reduce_rows
from vespo.losses.diagnostics import base_metrics
from vespo.losses.rollout_correction import RolloutCorrection, correction_weight
from vespo.types import LossOutput


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
    coef: Tensor,
    inp: LossInputs,
    cfg: LossConfig,
    normalizer: float | Tensor | None,
    extra_metrics: dict[str, Tensor],
    loss_masked: bool = False,
) -> LossOutput:
    """Aggregate the per-token loss by ``cfg.agg``, attach its gradient to logp, add the shared metrics.

    ``loss_mat`` is the detached per-token loss: [B, T], finite, masked here in place unless
    ``loss_masked`` says it is 0 on padding already; or [B, 1], the same value on every valid token
    of a row. ``coef`` is d loss_it / d logp_it: [B, T] and 0 on padding, or [B, 1] (masked in the
    backward pass).
    """
    with torch.no_grad():
        scratch = None
        if loss_mat.shape[-1] == 1 and inp.mask.shape[-1] != 1:
            value = reduce_rows(loss_mat[:, 0] * inp.tokens, inp.tokens, cfg.agg, normalizer)
        else:
            masked = loss_mat if loss_masked else loss_mat.mul_(inp.mask_f)  # [B, T]
            value = reduce_masked(masked, inp.tokens, cfg.agg, normalizer)
            scratch = loss_mat if loss_mat.shape == inp.mask.shape else None  # no longer needed: reuse it
        scale = agg_grad_scale(inp.tokens, cfg.agg, normalizer)  # [] or [B, 1]
        metrics = base_metrics(value, inp.row_log_ratio, inp.seq_valid, inp.clamped_log_ratio,
                               inp.tokens, inp.rollout_d, scratch)
        seq_weight = sequence_weight(coef, inp)  # [B]
    loss = _CoefficientGradient.apply(inp.logp_in, value, coef, scale, inp.mask_f)
    return LossOutput(loss=loss, metrics={**metrics, **extra_metrics}, seq_weight=seq_weight)


def sequence_weight(coef: Tensor, inp: LossInputs) -> Tensor:
    """Each row's weight on its gradient relative to plain REINFORCE, whose coefficient is -A:
    sum_t coef_it / sum_t (-A_it) over the row's valid tokens.  # [B]

    VESPO gives phi(W_i), clipped losses the mean kept ratio; NaN where the row's advantage is 0 or
    it has no valid token (no gradient to weigh).
    """
    num = coef[:, 0] * inp.tokens if coef.shape[-1] == 1 else (coef * inp.mask_f).sum(dim=-1)  # [B]
    den = -inp.adv[:, 0] * inp.tokens if inp.adv.shape[-1] == 1 else -(inp.adv * inp.mask_f).sum(dim=-1)  # [B]
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), torch.full_like(num, math.nan))


class _CoefficientGradient(torch.autograd.Function):
    """Returns ``value``; its gradient w.r.t. ``logp [B, T]`` is coef * scale (times mask_f if coef is [B, 1])."""

    @staticmethod
    def forward(ctx, logp: Tensor, value: Tensor, coef: Tensor, scale: Tensor, mask_f: Tensor) -> Tensor:
        ctx.coef, ctx.scale, ctx.mask_f = coef, scale, mask_f
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grad = ctx.coef * (ctx.scale * grad_out)  # [B, T] or [B, 1]
        if ctx.coef.shape[-1] == 1:
            grad = grad * ctx.mask_f  # [B, T]
        return grad, None, None, None, None


def rollout_corrected(loss_mat: Tensor, coef: Tensor, inp: LossInputs, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """Multiply the per-token loss and its coefficient by the detached rollout-correction weight.

    Identity for mode none. A [B, 1] coefficient times a [B, T] weight is masked here.
    """
    weight = correction_weight(inp.rollout_d, cfg.rollout_correction)  # None, [B, T] or [B, 1]
    if weight is None:
        return loss_mat, coef
    if coef.shape[-1] == 1 and weight.shape[-1] != 1:
        return loss_mat * weight, coef * weight * inp.mask_f  # [B, T], 0 on padding
    return loss_mat * weight, coef * weight


def token_ratio(lr_c: Tensor) -> Tensor:
    """r = exp(clamp(logp - old_logp, -20, 20)) from the clamped log-ratio ``lr_c``, detached.  # [B, T]"""
    return torch.exp(lr_c)


def clamp_pass(inp: LossInputs, lr_c: Tensor) -> Tensor | None:
    """1.0 where the +-20 token clamp lets the gradient through, 0.0 where it binds; None if it binds nowhere."""
    if not inp.clamp_binds:
        return None
    return indicator(torch.eq, lr_c, inp.log_ratio)  # [B, T]


def indicator(compare, a: Tensor, b: Tensor | float, out: Tensor | None = None) -> Tensor:
    """compare(a, b) as 0.0 / 1.0 in a's dtype, written to ``out`` if given (else a new tensor).

    A float mask multiplies much faster than a bool one on CPU; reusing ``out`` saves an allocation.
    """
    if out is None:
        shape = a.shape if not isinstance(b, Tensor) else torch.broadcast_shapes(a.shape, b.shape)
        out = torch.empty(shape, dtype=a.dtype, device=a.device)
    return compare(a, b, out=out)
