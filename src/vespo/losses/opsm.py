"""OPSM, off-policy sequence masking (DeepSeek-V3.2, Eq. 9): drop a sequence with a negative advantage
whose policy has moved too far from the one that sampled it. An option of every loss (``opsm_delta``),
applied with the rollout correction in :func:`vespo.losses.base.finish`.

    d_i = (1/T_i) sum_t m_it (log mu_it - sg[log pi_theta_it])     mean token log-ratio of mu over pi_theta
    M_i = 0 if A_i < 0 and d_i > delta, else 1                     (token advantages: A_it < 0, per token)
    l_it <- M_i l_it                                               masked sequences stay in the normalizer

mu is the behaviour policy the loss is given (``old_logp``): with staleness.behavior=rollout that is the
engine's sampling log-probs, as TRL uses them (``get_off_policy_mask``: sampling log-probs when present)
and as DeepSeek-V3.2 defines it; with mu recomputed it is the trainer's pi_old, slime's default
(``compute_opsm_mask`` without ``--use-rollout-logprobs``). TRL's ``off_policy_mask_threshold`` defaults
to None (off; its docs suggest 0.5), slime's delta to 1e-4; here ``opsm_delta`` defaults to None (off).
The mean is taken in float64 over the sequence's valid tokens (TRL: in the inputs' dtype; a row without
valid tokens has d = 0 in both).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def opsm_keep(log_ratio: Tensor, adv: Tensor, tokens: Tensor, delta: float) -> Tensor:
    """Which entries OPSM keeps: A >= 0 or d_i <= delta.  # [B, 1] (sequence advantages) or [B, T] bool

    ``log_ratio [B, T]`` is log pi_theta - log mu, 0 on padding; ``adv`` [B, 1] or [B, T]; ``tokens [B]``.
    """
    d = -log_ratio.detach().double().sum(dim=-1, keepdim=True) / tokens.double().clamp(min=1.0)[:, None]  # [B, 1]
    return (adv >= 0) | (d <= delta)
