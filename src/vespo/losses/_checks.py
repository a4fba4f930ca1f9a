"""Input validation shared by every loss: shapes, dtypes, finiteness, and the cleaned tensors.

Every loss starts with :func:`prepare_inputs`. It checks the caller's tensors once and returns
them with masked positions replaced by zeros, so padding may hold anything (-inf, NaN, garbage)
without reaching the loss or its gradient. Unmasked NaN/inf is an error naming the tensor: real
data is never silently zeroed.

Fast path (one host sync): x * mask has a finite float32 sum iff x is finite everywhere (inf * 0
is NaN), and then x * mask is already the cleaned tensor. Only when some sum is not finite do we
clean with torch.where (slower) and look for unmasked NaN/inf.
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
    mask_f: Tensor  # [B, T] the mask in logp's dtype (multiply by it: every cleaned tensor is finite)
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
    mask_f = mask_b.to(logp.dtype)  # [B, T]
    tokens = mask_f.sum(dim=-1)  # [B]
    raw = {"logp": logp, "old_logp": old_logp.detach().to(logp.dtype)}
    if rollout_logp is not None:
        raw["rollout_logp"] = rollout_logp.detach().to(logp.dtype)
    adv = advantages.detach().to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    adv_valid = (tokens > 0)[:, None] if adv.shape[-1] == 1 else mask_b
    clean = {name: x * mask_f for name, x in raw.items()}
    clean["advantages"] = torch.where(adv_valid, adv, adv.new_zeros(()))
    if not _all_finite(clean, mask):
        clean = {name: torch.where(mask_b, x, x.new_zeros(())) for name, x in raw.items()}
        clean["advantages"] = torch.where(adv_valid, adv, adv.new_zeros(()))
        _name_the_culprit({**raw, "advantages": adv}, mask_b, adv_valid, mask)
    return LossInputs(
        logp=clean["logp"],
        old_logp=clean["old_logp"],
        adv=clean["advantages"],
        mask=mask_b,
        mask_f=mask_f,
        tokens=tokens,
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


def _all_finite(clean: dict[str, Tensor], mask: Tensor) -> bool:
    """One host sync: every cleaned tensor has a finite float32 sum and the mask is 0/1."""
    flags = [torch.isfinite(x.sum(dtype=torch.float32)) for x in clean.values()]
    if mask.dtype != torch.bool:
        flags.append(((mask == 0) | (mask == 1)).all())
    return bool(torch.stack(flags).all())


def _name_the_culprit(raw: dict[str, Tensor], mask_b: Tensor, adv_valid: Tensor, mask: Tensor) -> None:
    """Slow path: raise for a non-0/1 mask or unmasked NaN/inf; return if only the padding was bad."""
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0/1 (or be bool)")
    for name, x in raw.items():
        valid = adv_valid if name == "advantages" else mask_b
        n_bad = int((valid & ~torch.isfinite(x)).sum())
        if n_bad:
            raise ValueError(f"{name} has {n_bad} NaN/inf value(s) at unmasked positions")
