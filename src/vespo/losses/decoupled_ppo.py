"""AReaL's decoupled PPO with the log-linear proximal policy: PPO against an interpolated pi_prox, no extra forward.

AReaL (inclusionAI/AReaL, commit 4aef98d8d818af55b43621aaadba047ae10f4e77; `use_decoupled_loss=True`,
`prox_logp_method="loglinear"`): areal/trainer/ppo/actor.py `compute_prox_logp_approximations` and
areal/utils/functional/functional.py `ppo_actor_loss_fn`, `apply_rejection_sampling`. AReaL's version counts the
trainer's weight updates: areal/trainer/rl_trainer.py sets actor and rollout to `global_step + 1` after the update
of step `global_step`, and areal/infra/remote_inf_engine.py tags each generated token with the rollout's version,
so a token sampled by the weights being trained has v_behave = current_version. vespo's versions count the same
(TrainBatch.token_versions; the learner's version = its optimizer steps), and token t of row i is
L_it = v - v_it versions behind the learner. AReaL's v_theta = current_version = v, v_prox = v - 1, v_behave = v - L:

    alpha_it = clamp((v_prox - v_behave) / (v_theta - v_behave), 0, 1) = (L_it - 1) / L_it for L_it >= 1, 0 at L_it = 0
    log pi_prox = log mu + alpha (sg[logp] - log mu)                     (log-linear interpolation, no forward)
    r_t      = exp(clamp(logp_t - log pi_prox_t, +-20))     value (pi / mu)^(1 - alpha), gradient r grad logp
    l_t      = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))     (min(., -A c) for A < 0 with dual_clip_c)
    l_t     *= b_t   with behave: none  b = 1                            (AReaL's default: rejection_sampling None)
                                  mask  b = w if behave_low <= w <= behave_high else 0,   w = pi_prox / mu
                                  clamp b = clamp(w, behave_low or 0, behave_high)
    L        = agg(l)                                                    default token-mean (AReaL: / all loss tokens)

So alpha is 0 at lags 0 and 1 (pi_prox = mu: PPO on pi / mu), 1/2 at lag 2, 2/3 at lag 3. Each token reads its own
lag (LossInputs.token_lag; a partial rollout's row spans versions); a caller with one lag per row (LossInputs.lag)
gets it for every token of the row, and a call with neither (the verl and TRL integrations) counts every token at
lag 0. Defaults AReaL's: eps = 0.2 / 0.2 (eps_clip, eps_clip_higher None), no dual clip (c_clip None), no behaviour
weight; with mask or clamp, behave_high = 5 (its RejectionSamplingConfig.upper), token level, metric "ratio".
Where it differs from AReaL: AReaL's version steps once per rollout batch (its ppo_n_minibatches optimizer steps
share one version), vespo's once per optimizer step (the same at one mini-batch per batch); w = exp(clamp(alpha d,
+-20)) (AReaL: unclamped, float32); AReaL's sequence-level and k1/k2/k3 behaviour filters are not built (vespo's
rollout_correction mode=reject filters on pi / pi_rollout).
Rows: clip_low / clip_high as GRPO's, behave_masked / behave_clamped (loss/behave_mask_frac|clamp_frac).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vespo.losses.base import BaseLossConfig, LossOutput, check_choice, check_range, finish
from vespo.losses.diagnostics import token_counts
from vespo.losses.grpo import check_clip_range, clipped_surrogate
from vespo.losses.inputs import TOKEN_LOG_RATIO_CLAMP, LossInputs
from vespo.losses.registry import LossSpec, register

BEHAVE_MODES: tuple[str, ...] = ("none", "mask", "clamp")
DEFAULT_BEHAVE_HIGH = 5.0  # AReaL's RejectionSamplingConfig.upper


@dataclass
class DecoupledPpoConfig(BaseLossConfig):
    """PPO's clip against the log-linear proximal policy, and the behaviour weight pi_prox / mu."""

    agg: str = "token-mean"
    """Aggregation mode: token-mean (AReaL's) | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    eps_low: float = 0.2
    """Lower clip of pi / pi_prox at 1 - eps_low (AReaL's eps_clip); in [0, 1)."""
    eps_high: float = 0.2
    """Upper clip at 1 + eps_high (AReaL's eps_clip_higher, None there: eps_clip); >= 0."""
    dual_clip_c: float | None = None
    """Dual clip for A < 0 (AReaL's c_clip, None there); > 1, or None."""
    behave: str = "none"
    """The behaviour weight w = pi_prox / mu: none (AReaL's default), mask (w inside the bounds, else 0) or clamp."""
    behave_high: float | None = None
    """Upper bound on w for mask / clamp (None: 5, AReaL's); refused with behave=none; > 0."""
    behave_low: float | None = None
    """Lower bound on w for mask / clamp (None: none for mask, 0 for clamp); refused with behave=none; > 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_clip_range(self.eps_low, self.eps_high)
        if self.dual_clip_c is not None:
            check_range("dual_clip_c", self.dual_clip_c, 1.0, None, lo_open=True)
        check_choice("behave", self.behave, BEHAVE_MODES)
        if self.behave == "none":
            given = [n for n in ("behave_high", "behave_low") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{given[0]} applies to behave=mask or clamp; got behave='none'")
            return
        if self.behave_high is None:
            self.behave_high = DEFAULT_BEHAVE_HIGH
        check_range("behave_high", self.behave_high, 0.0, None, lo_open=True)
        if self.behave_low is not None:
            check_range("behave_low", self.behave_low, 0.0, self.behave_high, lo_open=True)


def prox_alpha(lag: Tensor) -> Tensor:
    """AReaL's interpolation weight of pi_theta in log pi_prox for tokens ``lag`` versions behind the learner:
    (v_prox - v_behave) / (v_theta - v_behave) with v_theta = v, v_prox = v - 1, v_behave = v - lag, clamped
    to [0, 1], and 0 where v_theta = v_behave (lag 0).  # lag's shape"""
    return torch.where(lag > 0, (lag - 1.0) / lag.clamp(min=1.0), 0.0).clamp(0.0, 1.0)


def decoupled_ppo_loss(x: LossInputs, cfg: DecoupledPpoConfig, normalizer: float | Tensor | None = None) -> LossOutput:
    """PPO-clip on pi / pi_prox (log-linear pi_prox) times the behaviour weight, aggregated by ``cfg.agg``."""
    lag = x.version_lag if x.version_lag is not None else x.logp.new_zeros(x.logp.shape[0], 1)  # [B, T] or [B, 1]
    alpha = prox_alpha(lag)  # [B, T] or [B, 1]
    d = x.log_ratio  # [B, T] log pi - log mu, carries the gradient
    log_r = d - alpha * d.detach()  # [B, T] log pi - log pi_prox
    live = log_r.detach().abs() <= TOKEN_LOG_RATIO_CLAMP
    ratio = log_r.clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP).exp()
    loss_mat, weight, rows = clipped_surrogate(ratio, live, x.adv, x.mask_f, cfg.eps_low, cfg.eps_high,
                                               cfg.dual_clip_c)
    if cfg.behave != "none":
        with torch.no_grad():
            w = (alpha * d.detach()).clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP).exp()  # [B, T] pi_prox / mu
            low = cfg.behave_low
            if cfg.behave == "mask":
                inside = (w <= cfg.behave_high) & (w >= low if low is not None else torch.ones_like(x.mask))
                b = torch.where(inside, w, 0.0)
                rows["behave_masked"] = token_counts(~inside, x.mask_f)
            else:
                b = w.clamp(min=low if low is not None else 0.0, max=cfg.behave_high)
                rows["behave_clamped"] = token_counts(b != w, x.mask_f)
        loss_mat, weight = loss_mat * b, weight * b
    return finish(loss_mat, weight, x, cfg, normalizer, rows)


register(LossSpec("decoupled_ppo", decoupled_ppo_loss, DecoupledPpoConfig))
