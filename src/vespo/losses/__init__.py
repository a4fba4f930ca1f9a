"""Policy losses: VESPO and its baselines as pure functions, behind a registry.

    from vespo.losses import get_loss, prepare_inputs
    spec = get_loss("vespo")                       # LossSpec(name, fn, config_cls)
    cfg = spec.config_cls(k_pos=2.0)               # the loss's options, incl. agg and rollout_correction
    x = prepare_inputs(logp, old_logp, advantages, mask, rollout_logp=None)   # checked once, padding made 0
    out = spec.fn(x, cfg, normalizer=None)         # every loss: fn(x: LossInputs, cfg, normalizer)
    out.loss                                       # [] scalar with grad
    out.rows                                       # per-row statistics [B]: concatenate over micro-batches
    out.metrics                                    # {"is/ess": tensor(...), "kl/k1": ...} = summarize(out.rows)

Shapes: logp, old_logp, mask, rollout_logp [B, T]; advantages [B] or [B, T]. One file per loss, each
plain autograd code that reads like its paper; a new loss is one more file that registers itself.
Shared pieces: inputs.py (LossInputs, checks), base.py (config base, ``finish``: the rollout
correction, aggregation and rows every loss ends with), aggregation.py, rollout_correction.py,
diagnostics.py (rows and metrics), kernel.py (VESPO's phi).
vespo_adaptive.py picks VESPO's (k, lambda) per batch (docs/adaptive.md); dppo.py and m2po.py are the
newer trust regions (divergence mask, second-moment mask), prime_rl.py prime-rl's default loss; the peers'
newer losses: luspo.py (TRL), gmpo.py, dro.py, kl_cov.py, clip_cov.py (verl), ipo.py (prime-rl), topr.py (ROLL); opsm.py
DeepSeek-V3.2's off-policy sequence mask (an option of every loss); step_size.py is VCPO's ESS-scaled step size,
applied by the learner to any loss. docs/losses.md lists every loss with its equation and source.
"""

from vespo.losses import (  # noqa: F401  (register)
    cispo, clip_cov, decoupled_ppo, dppo, dro, gmpo, grpo, gspo, ipo, kl_cov, luspo, m2po, prime_rl, reinforce, sapo,
    topr, vespo, vespo_adaptive,
)
from vespo.losses.aggregation import AGG_MODES, aggregate
from vespo.losses.base import BaseLossConfig, LossOutput, sequence_log_weight
from vespo.losses.cispo import CispoConfig, cispo_loss
from vespo.losses.clip_cov import ClipCovConfig, clip_cov_loss
from vespo.losses.diagnostics import Rows, concat_rows, summarize
from vespo.losses.decoupled_ppo import DecoupledPpoConfig, decoupled_ppo_loss
from vespo.losses.dppo import DppoConfig, dppo_loss
from vespo.losses.dro import DroConfig, dro_loss
from vespo.losses.gmpo import GmpoConfig, gmpo_loss
from vespo.losses.grpo import GrpoConfig, grpo_loss
from vespo.losses.gspo import GspoConfig, gspo_loss
from vespo.losses.inputs import LossInputs, prepare_inputs
from vespo.losses.ipo import IpoConfig, ipo_loss
from vespo.losses.kl_cov import KlCovConfig, kl_cov_loss
from vespo.losses.luspo import LuspoConfig, luspo_loss
from vespo.losses.m2po import M2poConfig, m2po_loss
from vespo.losses.prime_rl import PrimeRlConfig, prime_rl_loss
from vespo.losses.registry import LossSpec, get_loss, loss_names
from vespo.losses.reinforce import ReinforceConfig, reinforce_loss
from vespo.losses.rollout_correction import ROLLOUT_CORRECTION_MODES, RolloutCorrection
from vespo.losses.sapo import SapoConfig, sapo_loss
from vespo.losses.step_size import ess_step_scale
from vespo.losses.topr import ToprConfig, topr_loss
from vespo.losses.vespo import VespoConfig, gamma_phi, vespo_loss
from vespo.losses.vespo_adaptive import VespoAdaptiveConfig, vespo_adaptive_loss

__all__ = [
    "AGG_MODES",
    "BaseLossConfig",
    "ROLLOUT_CORRECTION_MODES",
    "CispoConfig",
    "ClipCovConfig",
    "DecoupledPpoConfig",
    "DppoConfig",
    "DroConfig",
    "GmpoConfig",
    "GrpoConfig",
    "GspoConfig",
    "IpoConfig",
    "KlCovConfig",
    "LossInputs",
    "LossOutput",
    "LossSpec",
    "LuspoConfig",
    "M2poConfig",
    "PrimeRlConfig",
    "ReinforceConfig",
    "Rows",
    "RolloutCorrection",
    "SapoConfig",
    "ToprConfig",
    "VespoAdaptiveConfig",
    "VespoConfig",
    "aggregate",
    "cispo_loss",
    "clip_cov_loss",
    "concat_rows",
    "decoupled_ppo_loss",
    "dppo_loss",
    "dro_loss",
    "ess_step_scale",
    "gamma_phi",
    "get_loss",
    "gmpo_loss",
    "grpo_loss",
    "gspo_loss",
    "ipo_loss",
    "kl_cov_loss",
    "loss_names",
    "luspo_loss",
    "m2po_loss",
    "prepare_inputs",
    "prime_rl_loss",
    "reinforce_loss",
    "sapo_loss",
    "sequence_log_weight",
    "summarize",
    "topr_loss",
    "vespo_adaptive_loss",
    "vespo_loss",
]
