"""VCPO's step size: the learning rate of one optimizer step scaled by sqrt(ESS / B) of the mini-batch's
sequence importance weights (Variance-Controlled Off-Policy optimization, arXiv 2602.17616, code
mit-han-lab/vcpo).

Over the B sequences of the mini-batch (those with a valid token), with W_i = prod_t pi_theta / mu the
sequence weight of the rows (``log_w``, unclamped):

    rho_ess = ESS / B = (sum_i W_i)^2 / (B sum_i W_i^2)       in (0, 1]
    scale   = sqrt(min(1, rho_ess))                           lr_step = scale * lr

as the authors' code does with its defaults (ess_scaling.scaling_rule = sqrt, base_ess_ratio = 1,
use_clipped = False): the unclipped sequence weights, no floor, 0 for a mini-batch without sequences.
The square root follows their argument for Adam-type optimizers, whose update size does not scale
with the gradient's. Their W is pi_old / pi_rollout, the learner's policy at the step against the
sampler's. Here ``optim.ess_against`` chooses: ``mu`` (the default) takes the ratio the loss sees,
pi_theta / mu, which with mu recomputed leaves out the engine mismatch and is exactly 1 at N = 1 (the
trainer says so in one line at start-up); ``engine`` takes pi_theta / pi_rollout, theirs (with
``staleness.behavior=rollout`` the two are the same).

The scale is formed from the rows of the whole mini-batch, so micro-batching does not change it;
it is orthogonal to the loss and wraps any of them, VESPO included (``optim.ess_scaled_lr``).
"""

from __future__ import annotations

from torch import Tensor

from vespo.losses.diagnostics import Rows, effective_sample_size


def ess_step_scale(rows: Rows, key: str = "log_w") -> Tensor:
    """sqrt(min(1, ESS / B)) of the sequence weights exp(rows[key]) over the rows with a valid token.  # []

    ``key``: ``log_w`` (pi_theta / mu, the loss's own ratio) or ``engine_log_w`` (pi_theta / pi_rollout, VCPO's).
    """
    valid = rows["tokens"] > 0  # [B]
    return effective_sample_size(rows[key], valid).clamp(max=1.0).sqrt()
