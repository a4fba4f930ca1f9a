"""Input validation shared by every loss: shapes, dtypes, finiteness, and the cleaned tensors.

Every loss starts with :func:`prepare_inputs`. It checks the caller's tensors once and returns
them with masked positions replaced by zeros, so padding may hold anything (-inf, NaN, garbage)
without reaching the loss or its gradient. Unmasked NaN/inf is an error naming the tensor: real
data is never silently zeroed. All finiteness checks share one host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LossInputs:
    """The validated, cleaned inputs of one loss call (masked positions hold 0)."""

    logp: Tensor  # [B, T] log pi_theta, carries grad; 0 on padding
    old_logp: Tensor  # [B, T] behavior log-probs, detached; 0 on padding
    adv: Tensor  # [B, 1] (sequence advantages) or [B, T] (token advantages); 0 where masked
    mask: Tensor  # [B, T] bool
    tokens: Tensor  # [B] float, number of valid tokens per sequence
    rollout_logp: Tensor | None  # [B, T] inference-engine log-probs, detached; 0 on padding
    log_ratio: Tensor  # [B, T] log(pi_theta / pi_old), with grad; 0 on padding

    @property
    def seq_valid(self) -> Tensor:
        """Which sequences have at least one valid token."""
        return self.tokens > 0  # [B]


def prepare_inputs(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logp: Tensor | None = None,
) -> LossInputs:
    """Validate the loss inputs and return them cleaned; raises ValueError naming the culprit."""
    _check_logp(logp)
    _check_same_shape("old_logp", old_logp, logp)
    _check_same_shape("mask", mask, logp)
    if rollout_logp is not None:
        _check_same_shape("rollout_logp", rollout_logp, logp)
    _check_advantages(advantages, logp)
    mask_b = mask if mask.dtype == torch.bool else mask != 0  # [B, T]
    row_valid = mask_b.any(dim=-1)  # [B]
    adv = advantages.detach().to(logp.dtype)
    adv_valid = row_valid[:, None] if adv.dim() == 1 else mask_b
    adv = adv[:, None] if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    zero = logp.new_zeros(())
    clean = {
        "logp": torch.where(mask_b, logp, zero),
        "old_logp": torch.where(mask_b, old_logp.detach().to(logp.dtype), zero),
        "advantages": torch.where(adv_valid, adv, zero),
    }
    if rollout_logp is not None:
        clean["rollout_logp"] = torch.where(mask_b, rollout_logp.detach().to(logp.dtype), zero)
    raw = {"logp": logp, "old_logp": old_logp, "advantages": adv, "rollout_logp": rollout_logp}
    _check_finite_and_binary(clean, raw, mask_b, adv_valid, mask)
    return LossInputs(
        logp=clean["logp"],
        old_logp=clean["old_logp"],
        adv=clean["advantages"],
        mask=mask_b,
        tokens=mask_b.sum(dim=-1).to(logp.dtype),
        rollout_logp=clean.get("rollout_logp"),
        log_ratio=clean["logp"] - clean["old_logp"],
    )

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


def _check_finite_and_binary(
    clean: dict[str, Tensor], raw: dict[str, Tensor | None], mask_b: Tensor, adv_valid: Tensor, mask: Tensor
) -> None:
    """One host sync for all checks: the float32 sum of a cleaned tensor is finite iff its valid
    entries are (barring overflow, which the slow path below rules out). On failure, name the tensor."""
    flags = [torch.isfinite(x.sum(dtype=torch.float32)) for x in clean.values()]
    if mask.dtype != torch.bool:
        flags.append(((mask == 0) | (mask == 1)).all())
    if bool(torch.stack(flags).all()):
        return
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0/1 (or be bool)")
    for name in clean:
        valid = adv_valid if name == "advantages" else mask_b
        n_bad = int((valid & ~torch.isfinite(raw[name])).sum())
        if n_bad:
            raise ValueError(f"{name} has {n_bad} NaN/inf value(s) at unmasked positions")
