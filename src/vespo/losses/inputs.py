"""The inputs every loss starts from: checked once, with padding made harmless.

    x = prepare_inputs(logp, old_logp, advantages, mask, rollout_logp, bypass=False)
    x.logp        [B, T] the caller's log pi_theta with 0 on padding; carries the gradient
    x.old_logp    [B, T] behaviour log-probs mu, detached, 0 on padding
    x.adv         [B, 1] sequence advantages or [B, T] token advantages, detached, 0 where masked
    x.mask        [B, T] bool;  x.mask_f the same in logp's dtype;  x.tokens [B] valid tokens per row
    x.rollout_logp [B, T] the engine's log-probs pi_rollout, detached, 0 on padding (None if not given)
    x.bypass      mu is the engine's own log-probs (verl's bypass mode): pi_rollout = mu
    x.lag         [B] how many policy versions each row is behind the learner (None: not given); decoupled_ppo
    x.token_lag   [B, T] how many versions each token is behind the learner (the version that sampled it; 0 on
                  padding; None: not given); a row's tokens differ where a partial rollout spans versions
    x.version_lag [B, T] or [B, 1]: token_lag, else lag per row, else None (what decoupled_ppo reads)
    x.log_ratio   [B, T] logp - old_logp on valid tokens, 0 on padding; carries the gradient
    x.rollout_d   [B, T] log pi_rollout - log pi_ref, pi_ref = mu (decoupled) or sg[pi_theta] (bypass): the
                  rollout correction's rho = pi_ref / pi_rollout is exp(-rollout_d) (None without pi_rollout)

Padding may hold anything (NaN, -inf, garbage): it is replaced with ``torch.where`` before any
arithmetic, so it reaches neither the loss nor the gradient. A NaN or inf at a *valid* position is
an error naming the tensor: real data is never silently zeroed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

TOKEN_LOG_RATIO_CLAMP = 20.0  # token log-ratios are clamped to +-20 before exp (official VESPO, verl)


@dataclass(frozen=True)
class LossInputs:
    """The validated inputs of one loss call (see the module docstring for each field)."""

    logp: Tensor  # [B, T] carries the gradient, 0 on padding
    old_logp: Tensor  # [B, T] detached, 0 on padding
    adv: Tensor  # [B, 1] or [B, T] detached, 0 where masked
    mask: Tensor  # [B, T] bool
    mask_f: Tensor  # [B, T] the mask in logp's dtype
    tokens: Tensor  # [B] valid tokens per row, logp's dtype
    rollout_logp: Tensor | None = None  # [B, T] detached, 0 on padding
    bypass: bool = False  # mu (old_logp) is the engine's log-probs: rollout_logp is old_logp
    lag: Tensor | None = None  # [B] logp's dtype, policy versions between the row's sampler and the learner (>= 0)
    token_lag: Tensor | None = None  # [B, T] logp's dtype, versions between each token's sampler and the learner

    @property
    def version_lag(self) -> Tensor | None:
        """Versions behind the learner per token: token_lag, else each row's lag, else None.  # [B, T] or [B, 1]"""
        if self.token_lag is not None:
            return self.token_lag
        return None if self.lag is None else self.lag[:, None]

    @property
    def rollout_d(self) -> Tensor | None:
        """log pi_rollout - log pi_ref per token, 0 on padding, detached; pi_ref = mu, or pi_theta in bypass mode.  # [B, T]"""
        if self.rollout_logp is None:
            return None
        return self.rollout_logp - (self.logp.detach() if self.bypass else self.old_logp)

    @property
    def engine_log_ratio(self) -> Tensor | None:
        """log pi_theta - log pi_rollout per token, 0 on padding, detached (None without pi_rollout).  # [B, T]"""
        return None if self.rollout_logp is None else self.logp.detach() - self.rollout_logp

    @property
    def log_ratio(self) -> Tensor:
        """logp - old_logp per token, 0 on padding; carries the gradient.  # [B, T]"""
        return self.logp - self.old_logp

    @property
    def clamped_log_ratio(self) -> Tensor:
        """The token log-ratio clamped to +-20 (no gradient where the clamp binds).  # [B, T]"""
        return self.log_ratio.clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)

    @property
    def seq_valid(self) -> Tensor:
        """Which rows have at least one valid token.  # [B] bool"""
        return self.tokens > 0

    @property
    def seq_adv(self) -> bool:
        """Whether the advantages are per sequence ([B, 1]) rather than per token."""
        return self.adv.shape[-1] == 1 and self.mask.shape[-1] != 1


def prepare_inputs(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logp: Tensor | None = None,
    bypass: bool = False,
    lag: Tensor | None = None,
    token_lag: Tensor | None = None,
) -> LossInputs:
    """Check the loss inputs and return them with padding set to 0; raises ValueError naming the culprit.

    ``bypass``: ``old_logp`` is the inference engine's own log-probs (verl's bypass mode), which are then
    also pi_rollout for the rollout correction; ``rollout_logp`` must be None. ``lag`` [B]: each row's policy
    versions behind the learner (the learner's version minus the row's sampling version), >= 0. ``token_lag``
    [B, T]: the same per token (the learner's version minus the version that sampled the token), >= 0 on valid
    tokens (padding may hold anything); at most one of the two.
    """
    if bypass and rollout_logp is not None:
        raise ValueError("bypass=True takes pi_rollout from old_logp (mu is the engine's log-probs); "
                         "pass rollout_logp=None")
    if lag is not None and token_lag is not None:
        raise ValueError("pass lag (per row) or token_lag (per token), not both: token_lag would override lag")
    _check_logp(logp)
    _check_same_shape("old_logp", old_logp, logp)
    _check_same_shape("mask", mask, logp)
    if rollout_logp is not None:
        _check_same_shape("rollout_logp", rollout_logp, logp)
    _check_advantages(advantages, logp)
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0/1 (or be bool)")
    mask_b = mask if mask.dtype == torch.bool else mask != 0  # [B, T]
    adv = advantages.detach().to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    adv_valid = mask_b.any(dim=-1, keepdim=True) if adv.shape[-1] == 1 and mask_b.shape[-1] != 1 else mask_b
    tensors = {"logp": (logp, mask_b), "old_logp": (old_logp.detach().to(logp.dtype), mask_b),
               "advantages": (adv, adv_valid)}
    if rollout_logp is not None:
        tensors["rollout_logp"] = (rollout_logp.detach().to(logp.dtype), mask_b)
    _check_finite(tensors)
    zero = logp.new_zeros(())
    clean = {name: torch.where(valid, x, zero) for name, (x, valid) in tensors.items()}
    mask_f = mask_b.to(logp.dtype)
    rollout = clean["old_logp"] if bypass else clean.get("rollout_logp")
    return LossInputs(logp=clean["logp"], old_logp=clean["old_logp"], adv=clean["advantages"], mask=mask_b,
                      mask_f=mask_f, tokens=mask_f.sum(dim=-1), rollout_logp=rollout, bypass=bypass,
                      lag=_check_lag(lag, logp), token_lag=_check_token_lag(token_lag, logp, mask_b))


def _check_finite(tensors: dict[str, tuple[Tensor, Tensor]]) -> None:
    """Raise naming the first tensor with NaN/inf at a valid position (one host sync when all is well)."""
    with torch.no_grad():
        bad = torch.stack([(valid & ~torch.isfinite(x)).sum() for x, valid in tensors.values()])  # [K]
    counts = bad.tolist()
    for name, n_bad in zip(tensors, counts):
        if n_bad:
            raise ValueError(f"{name} has {n_bad} NaN/inf value(s) at unmasked positions")


def check_normalizer(normalizer: float | Tensor | None) -> None:
    """An external normalizer must be a positive finite number (python or 1-element tensor)."""
    if normalizer is None:
        return
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got a tensor of shape {tuple(normalizer.shape)}")
        value = float(normalizer.detach().reshape(()))
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


def _check_lag(lag: Tensor | None, logp: Tensor) -> Tensor | None:
    """The lag as [B] in logp's dtype; raises unless it is a [B] tensor of finite values >= 0."""
    if lag is None:
        return None
    if not isinstance(lag, Tensor) or tuple(lag.shape) != tuple(logp.shape[:1]):
        raise ValueError(f"lag must be a tensor of shape [B] = {tuple(logp.shape[:1])}; got "
                         f"{tuple(lag.shape) if isinstance(lag, Tensor) else type(lag).__name__}")
    lag = lag.detach().to(device=logp.device, dtype=logp.dtype)
    if not bool((torch.isfinite(lag) & (lag >= 0)).all()):
        raise ValueError("lag must hold finite values >= 0 (policy versions behind the learner)")
    return lag


def _check_token_lag(token_lag: Tensor | None, logp: Tensor, mask: Tensor) -> Tensor | None:
    """The token lag as [B, T] in logp's dtype, 0 on padding; raises unless finite and >= 0 on valid tokens."""
    if token_lag is None:
        return None
    if not isinstance(token_lag, Tensor) or token_lag.shape != logp.shape:
        raise ValueError(f"token_lag must be a tensor of shape [B, T] = {tuple(logp.shape)}; got "
                         f"{tuple(token_lag.shape) if isinstance(token_lag, Tensor) else type(token_lag).__name__}")
    token_lag = token_lag.detach().to(device=logp.device, dtype=logp.dtype)
    if not bool((~mask | (torch.isfinite(token_lag) & (token_lag >= 0))).all()):
        raise ValueError("token_lag must hold finite values >= 0 on valid tokens (policy versions behind the learner)")
    return torch.where(mask, token_lag, logp.new_zeros(()))


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
