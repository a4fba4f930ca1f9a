"""Input validation shared by every loss: shapes, dtypes, finiteness, and the detached working tensors.

Every loss starts with :func:`prepare_inputs`. It checks the caller's tensors once and returns
detached copies that are finite everywhere, plus the log-ratio that is 0 on padding, so padding
may hold anything (-inf, NaN, garbage) without reaching the loss or its gradient. Unmasked
NaN/inf is an error naming the tensor: real data is never silently zeroed.

Fast path (one host sync): if (logp - old_logp) * mask has a finite min and max, and the other
inputs a finite sum, every element is finite and nothing needs cleaning; the same range tells
the losses whether the +-20 token clamp binds anywhere. Only when a check fails do we clean with
torch.where (slower) and look for unmasked NaN/inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

TOKEN_LOG_RATIO_CLAMP = 20.0  # token log-ratios are clamped to +-20 before exp (official VESPO, verl)


@dataclass
class LossInputs:
    """The validated inputs of one loss call, detached and finite; ``logp_in`` carries the gradient."""

    logp_in: Tensor  # [B, T] the caller's log pi_theta; the loss attaches its gradient to it
    logp: Tensor  # [B, T] detached, finite; padding holds the caller's finite values or 0
    old_logp: Tensor  # [B, T] behavior log-probs, detached, finite; padding as for logp
    adv: Tensor  # [B, 1] (sequence advantages) or [B, T] (token advantages); 0 where masked
    mask: Tensor  # [B, T] bool
    mask_f: Tensor  # [B, T] the mask in logp's dtype
    tokens: Tensor  # [B] float, number of valid tokens per sequence
    log_ratio: Tensor  # [B, T] logp - old_logp on valid tokens, 0 on padding; detached
    rollout_d: Tensor | None  # [B, T] rollout_logp - old_logp on valid tokens, 0 on padding; detached
    clamp_binds: bool  # some valid |log_ratio| exceeds TOKEN_LOG_RATIO_CLAMP

    @property
    def seq_valid(self) -> Tensor:
        """Which sequences have at least one valid token."""
        return self.tokens > 0  # [B]

    @cached_property
    def clamped_log_ratio(self) -> Tensor:
        """The token log-ratio clamped to +-20 (the same tensor when the clamp binds nowhere).  # [B, T]"""
        if not self.clamp_binds:
            return self.log_ratio
        return self.log_ratio.clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)

    @cached_property
    def row_log_ratio(self) -> Tensor:
        """log W_i = sum_t m_it (logp_it - old_logp_it), unclamped.  # [B]"""
        return self.log_ratio.sum(dim=-1)

    @cached_property
    def row_clamped_log_ratio(self) -> Tensor:
        """sum_t of the +-20-clamped token log-ratios.  # [B]"""
        return self.row_log_ratio if not self.clamp_binds else self.clamped_log_ratio.sum(dim=-1)


def prepare_inputs(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logp: Tensor | None = None,
) -> LossInputs:
    """Validate the loss inputs and return them detached and cleaned; raises ValueError naming the culprit."""
    _check_logp(logp)
    _check_same_shape("old_logp", old_logp, logp)
    _check_same_shape("mask", mask, logp)
    if rollout_logp is not None:
        _check_same_shape("rollout_logp", rollout_logp, logp)
    _check_advantages(advantages, logp)
    with torch.no_grad():
        return _prepare(logp, old_logp, advantages, mask, rollout_logp)


def _prepare(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, rollout_logp: Tensor | None
) -> LossInputs:
    mask_b = mask if mask.dtype == torch.bool else mask != 0  # [B, T]
    mask_f = mask_b.view(torch.uint8).to(logp.dtype)  # [B, T] (from uint8: a much faster conversion than bool)
    tokens = mask_f.sum(dim=-1)  # [B]
    raw = {"logp": logp.detach(), "old_logp": old_logp.detach().to(logp.dtype)}
    if rollout_logp is not None:
        raw["rollout_logp"] = rollout_logp.detach().to(logp.dtype)
    adv = advantages.detach().to(logp.dtype)
    raw["advantages"] = adv[:, None] if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    # Differences times the mask are finite everywhere iff both terms are (NaN or inf times 0 is NaN).
    log_ratio = (raw["logp"] - raw["old_logp"]).mul_(mask_f)  # [B, T], 0 on padding
    rollout_d = None if rollout_logp is None else (raw["rollout_logp"] - raw["old_logp"]).mul_(mask_f)  # [B, T]
    finite, lr_range = _fast_path_check(log_ratio, rollout_d, raw["advantages"], mask)
    if finite:
        clean = {**raw, "advantages": _zero_invalid_advantages(raw["advantages"], tokens, mask_f)}
    else:
        clean = _clean_slow(raw, mask_b, tokens, mask)
        log_ratio = clean["logp"] - clean["old_logp"]  # [B, T], 0 on padding
        if rollout_d is not None:
            rollout_d = clean["rollout_logp"] - clean["old_logp"]  # [B, T], 0 on padding
        lr_range = _range(log_ratio).tolist()
    return LossInputs(
        logp_in=logp,
        logp=clean["logp"],
        old_logp=clean["old_logp"],
        adv=clean["advantages"],
        mask=mask_b,
        mask_f=mask_f,
        tokens=tokens,
        log_ratio=log_ratio,
        rollout_d=rollout_d,
        clamp_binds=not (-TOKEN_LOG_RATIO_CLAMP <= lr_range[0] and lr_range[1] <= TOKEN_LOG_RATIO_CLAMP),
    )


def _fast_path_check(
    log_ratio: Tensor, rollout_d: Tensor | None, adv: Tensor, mask: Tensor
) -> tuple[bool, list[float]]:
    """One host sync: whether every input is finite everywhere (and the mask 0/1), and log_ratio's [min, max].

    log_ratio is finite iff logp and old_logp are (its min and max propagate NaN and inf); a sum of
    finite values is finite (barring overflow, which only sends us to the slow path).
    """
    checks = [_range(log_ratio), adv.sum(dtype=torch.float32 if adv.element_size() < 4 else None)[None]]
    if rollout_d is not None:
        checks.append(rollout_d.sum()[None])
    if mask.dtype != torch.bool:
        checks.append(torch.where(((mask == 0) | (mask == 1)).all(), 0.0, math.nan)[None])
    dtype = torch.promote_types(log_ratio.dtype, torch.float32)
    values = torch.cat([c.to(dtype) for c in checks]).tolist()
    return all(math.isfinite(v) for v in values), values[:2]


def _range(x: Tensor) -> Tensor:
    """[min, max] of x, [0, 0] when x is empty.  # [2]"""
    return torch.stack(torch.aminmax(x)) if x.numel() else x.new_zeros(2)


def _zero_invalid_advantages(adv: Tensor, tokens: Tensor, mask_f: Tensor) -> Tensor:
    """Advantages of empty rows / masked tokens set to 0 (``adv`` is finite here).  # [B, 1] or [B, T]"""
    if adv.shape[-1] == 1:
        return torch.where((tokens > 0)[:, None], adv, adv.new_zeros(()))
    return adv * mask_f


def _clean_slow(raw: dict[str, Tensor], mask_b: Tensor, tokens: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Raise for a bad mask or unmasked NaN/inf; otherwise every input with its padding set to 0."""
    adv = raw["advantages"]
    adv_valid = (tokens > 0)[:, None] if adv.shape[-1] == 1 else mask_b
    _name_the_culprit(raw, mask_b, adv_valid, mask)
    clean = {name: torch.where(mask_b, x, x.new_zeros(())) for name, x in raw.items() if name != "advantages"}
    clean["advantages"] = torch.where(adv_valid, adv, adv.new_zeros(()))
    return clean


def check_normalizer(normalizer: float | Tensor | None) -> None:
    """An external normalizer must be a positive finite number (python or 1-element tensor)."""
    if normalizer is None:
        return
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got a tensor of shape {tuple(normalizer.shape)}")
        value = float(normalizer.detach().reshape(()))  # one host sync, only when given as a tensor
    elif isinstance(normalizer, (int, float)) and not isinstance(normalizer, bool):
        value = float(normalizer)
    else:
        raise ValueError(f"normalizer must be a float or a scalar tensor, got {type(normalizer).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"normalizer must be a positive finite token/sequence count, got {value}")


def _check_logp(logp: Tensor) -> None:
    if not isinstance(logp, Tensor):
        raise ValueError(f"logp must be a torch.Tensor, got {type(logp).__name__}")
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape [B, T], got shape {tuple(logp.shape)}")
    if not logp.is_floating_point():
        raise ValueError(f"logp must be a floating-point tensor, got dtype {logp.dtype}")


def _check_same_shape(name: str, x: Tensor, logp: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != logp.shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} does not match logp shape {tuple(logp.shape)}")
    if x.device != logp.device:
        raise ValueError(f"{name} is on {x.device} but logp is on {logp.device}")


def _check_advantages(advantages: Tensor, logp: Tensor) -> None:
    if not isinstance(advantages, Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    batch = tuple(logp.shape[:1])
    if tuple(advantages.shape) not in (batch, tuple(logp.shape)):
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be [B] = {batch} or [B, T] = "
            f"{tuple(logp.shape)} (logp shape {tuple(logp.shape)})"
        )
    if advantages.device != logp.device:
        raise ValueError(f"advantages is on {advantages.device} but logp is on {logp.device}")


def _name_the_culprit(raw: dict[str, Tensor], mask_b: Tensor, adv_valid: Tensor, mask: Tensor) -> None:
    """Slow path: raise for a non-0/1 mask or unmasked NaN/inf; return if only the padding was bad."""
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0/1 (or be bool)")
    for name, x in raw.items():
        valid = adv_valid if name == "advantages" else mask_b
        n_bad = int((valid & ~torch.isfinite(x)).sum())
        if n_bad:
            raise ValueError(f"{name} has {n_bad} NaN/inf value(s) at unmasked positions")
