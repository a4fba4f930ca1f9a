"""vespo's losses as verl policy losses (verl 0.9.1's `register_policy_loss` registry).

Importing this module registers, in `verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY`:

    vespo           vespo's VESPO loss (verl 0.9.1 has none)
    vespo_adaptive  VESPO with (k, λ) chosen per micro-batch and sign of A (docs/adaptive.md)
    vespo_<name>    each of vespo's other losses: vespo_grpo, vespo_gspo, vespo_sapo, ... (verl's own
                    `vanilla`, `gspo`, `sapo`, `cispo` are left as they are)

Select one with `actor_rollout_ref.actor.policy_loss.loss_mode=vespo`. Each registered loss has
verl's signature `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights) -> (pg_loss, metrics)` and

- reads its options from `config.policy_loss.<registered name>` (`policy_loss.vespo.k_pos`, ...,
  the section the VESPO authors' recipe reads), with `config` an ActorConfig or an omegaconf
  DictConfig; options not given keep vespo's defaults. verl 0.9.1's PolicyLossConfig rejects
  unknown keys, so that section needs `policy_loss._target_=vespo.integrations.verl.VespoPolicyLossConfig`
  (which also imports this module, i.e. registers the losses, in every verl worker);
- aggregates with verl's `loss_agg_mode` and normalizes by `config.global_batch_info`
  (`batch_num_tokens` / `global_batch_size` / `dp_size`) exactly as verl's `agg_loss` does, so
  micro-batch and data-parallel splits leave the gradient unchanged;
- turns verl's rollout correction weights (π_old/π_rollout, already truncated or masked by verl)
  into the rollout log-probs vespo's losses take and applies them unchanged: VESPO adds their log
  to log W, the other losses multiply by them. `policy_loss.<name>.rollout_is` (token | sequence,
  default token) must say at which level verl formed them (`algorithm.rollout_correction.rollout_is`);
- returns verl-style metrics: plain floats under `actor/` (`actor/ppo_kl`, `actor/is/ess`,
  `actor/vespo/phi_pos_mean`, ...), each the value of the whole mini-batch whatever the
  micro-batching: the loss keeps each call's per-row statistics until this rank's share of the
  mini-batch (``global_batch_size / dp_size`` sequences) is complete, gathers the other data-parallel
  ranks' rows (when the data-parallel group is the whole process group), and reports the metrics of
  all of them once, on the mini-batch's last micro-batch (verl averages a metric over the calls that
  report it, so each mini-batch contributes its exact value). Without ``global_batch_info`` each call
  reports its own micro-batch's values.

See docs/integrations.md for the command-line overrides and how to import this in verl's workers.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss
from verl.workers.config import PolicyLossConfig

from vespo.losses import Rows, concat_rows, get_loss, loss_names, prepare_inputs, summarize
from vespo.losses.rollout_correction import RolloutCorrection

# verl's loss_agg_mode -> the vespo aggregation that computes it (with the normalizer below)
AGG_MODES = {
    "token-mean": "token-mean",
    "token-sum": "token-mean",  # token-mean over a normalizer of 1 / dp_size
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum",  # then divided by loss_scale_factor
}
LOG_WEIGHT_FLOOR = 1e-8  # rollout weights below this (masked tokens are 0) count as this
ROLLOUT_IS_LEVELS = ("token", "sequence")  # verl's algorithm.rollout_correction.rollout_is
# verl has already truncated or masked its weights; ours then applies them as they are (a
# truncation at the largest float is none), per token or per sequence as verl formed them.
PASS_THROUGH = {
    "token": RolloutCorrection(mode="tis_token", threshold=sys.float_info.max),
    "sequence": RolloutCorrection(mode="tis_seq", threshold=sys.float_info.max),
}


def verl_loss_name(name: str) -> str:
    """The name vespo's loss `name` is registered under in verl: its own if it starts with `vespo`."""
    return name if name.startswith("vespo") else f"vespo_{name}"


def make_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """verl policy-loss function computing vespo's loss `name`."""
    spec = get_loss(name)
    registered = verl_loss_name(name)

    def policy_loss(
        old_log_prob: torch.Tensor,  # [B, T]
        log_prob: torch.Tensor,  # [B, T], carries the gradient
        advantages: torch.Tensor,  # [B, T]
        response_mask: torch.Tensor,  # [B, T], bool or 0/1
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,  # [B, T] π_old/π_rollout
    ) -> tuple[torch.Tensor, dict[str, float]]:
        options = _options(config, registered)
        rollout_is = options.pop("rollout_is", "token")
        cfg = loss_config(spec.config_cls, registered, options, _vespo_agg(loss_agg_mode))
        batch_info = _batch_info(config)
        mask = response_mask.to(log_prob.dtype)  # [B, T]
        rollout_logp = None
        if rollout_is_weights is not None:
            rollout_logp = rollout_log_probs(old_log_prob, rollout_is_weights, mask, rollout_is, registered)
            if cfg.rollout_correction.mode == "none":
                cfg = dataclasses.replace(cfg, rollout_correction=PASS_THROUGH[rollout_is])
        x = prepare_inputs(log_prob, old_log_prob, advantages, mask, rollout_logp=rollout_logp)
        out = spec.fn(x, cfg, normalizer=normalizer(loss_agg_mode, batch_info))
        loss = out.loss
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (batch_info.get("loss_scale_factor") or mask.shape[-1])
        rows = MINI_BATCH.add(registered, out.rows, batch_info)
        return loss, ({} if rows is None else verl_metrics(summarize(rows)))

    policy_loss.__name__ = policy_loss.__qualname__ = f"compute_policy_loss_{registered}"
    policy_loss.__doc__ = f"vespo's `{name}` loss with verl's policy-loss signature (see vespo.integrations.verl)."
    return policy_loss


def register_all() -> list[str]:
    """Register vespo's losses in verl; returns the names registered. verl's own losses stay."""
    registered = []
    for name in loss_names():
        verl_name = verl_loss_name(name)
        existing = POLICY_LOSS_REGISTRY.get(verl_name)
        if existing is not None and not existing.__module__.startswith("vespo."):
            raise RuntimeError(f"verl already has a policy loss named {verl_name!r} ({existing.__module__})")
        register_policy_loss(verl_name)(make_policy_loss(name))
        registered.append(verl_name)
    return registered


def policy_loss_config_cls() -> type:
    """verl's PolicyLossConfig plus one options mapping per registered loss (`vespo`, `vespo_grpo`, ...).

    verl builds its actor config from `_target_` classes that reject unknown keys, so
    `policy_loss.vespo.k_pos` needs a class with a `vespo` field: set
    `actor_rollout_ref.actor.policy_loss._target_=vespo.integrations.verl.VespoPolicyLossConfig`.
    Instantiating it also imports this module, i.e. registers the losses, in verl's workers.
    """
    extra = [(verl_loss_name(name), dict, dataclasses.field(default_factory=dict)) for name in loss_names()]
    cls = dataclasses.make_dataclass("VespoPolicyLossConfig", extra, bases=(PolicyLossConfig,))
    cls.__module__ = __name__
    cls.__doc__ = "verl's PolicyLossConfig with an options mapping per vespo loss (policy_loss.vespo.k_pos, ...)."
    return cls


def loss_config(config_cls: type, registered: str, options: dict[str, Any], agg: str) -> Any:
    """The loss's config from its options (`config.policy_loss.<registered>`), aggregating with `agg`."""
    valid = {f.name for f in dataclasses.fields(config_cls)} - {"agg"}
    where = f"actor.policy_loss.{registered}"
    if "agg" in options:
        raise ValueError(f"{where}.agg: set the aggregation with actor.loss_agg_mode instead")
    unknown = sorted(set(options) - valid)
    if unknown:
        choices = ", ".join(sorted(valid | {"rollout_is"}))
        raise ValueError(f"{where}.{unknown[0]}: unknown option; choose from: {choices}")
    return config_cls(**options, agg=agg)


def normalizer(loss_agg_mode: str, batch_info: Mapping[str, Any]) -> float | None:
    """The count vespo's loss divides by so that it equals verl's `agg_loss` on this micro-batch.

    verl divides a micro-batch's sum by the whole mini-batch's count and multiplies by dp_size
    (data-parallel ranks average their gradients): that is dividing by count / dp_size.
    """
    dp_size = float(batch_info.get("dp_size") or 1)
    if loss_agg_mode == "token-sum":
        return 1.0 / dp_size
    key = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
    count = batch_info.get(key)
    if count is None:
        if dp_size > 1:
            raise ValueError(f"config.global_batch_info.{key} is required when dp_size > 1 ({loss_agg_mode})")
        return None  # this micro-batch's own count
    return float(count) / dp_size


def rollout_log_probs(
    old_log_prob: torch.Tensor, rollout_is_weights: torch.Tensor, mask: torch.Tensor, rollout_is: str, registered: str
) -> torch.Tensor:
    """Rollout log-probs [B, T] implied by verl's weights w = π_old/π_rollout.

    token level:    log π_rollout_t = log π_old_t − log w_t
    sequence level: verl repeats the sequence weight w_i on every token, so log w_i is spread
                    evenly over the T_i valid tokens and the sequence sums back to log w_i.
    Weights verl zeroed (rejected tokens or sequences) are floored at 1e-8, which drives the
    sequence weight, and VESPO's φ(W), towards 0, as in the authors' recipe.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(
            f"actor.policy_loss.{registered}.rollout_is must be one of {', '.join(ROLLOUT_IS_LEVELS)} "
            f"(as algorithm.rollout_correction.rollout_is); got {rollout_is!r}"
        )
    log_w = torch.log(rollout_is_weights.detach().to(old_log_prob.dtype).clamp(min=LOG_WEIGHT_FLOOR))  # [B, T]
    if rollout_is == "sequence":
        log_w = log_w / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)  # [B, T]
    return old_log_prob - log_w * mask


class MiniBatchRows:
    """Each loss's per-row statistics of the calls of one mini-batch on this rank, until the mini-batch is whole."""

    def __init__(self) -> None:
        self.parts: dict[str, list[Rows]] = {}

    def add(self, loss: str, rows: Rows, batch_info: Mapping[str, Any]) -> Rows | None:
        """The rows of the whole mini-batch (all ranks) when this call completes it, else None (keep waiting)."""
        global_rows, dp_size = batch_info.get("global_batch_size"), int(batch_info.get("dp_size") or 1)
        if not global_rows:
            return rows  # no batch info: this call is the batch
        parts = self.parts.setdefault(loss, [])
        parts.append({k: v.detach().cpu() for k, v in rows.items()})
        if sum(len(p["tokens"]) for p in parts) < int(global_rows) // dp_size:
            return None
        del self.parts[loss]
        return _gather_over_ranks(concat_rows(parts), dp_size)


def _gather_over_ranks(rows: Rows, dp_size: int) -> Rows:
    """The rows of every data-parallel rank, when the data-parallel group is the whole process group."""
    if dp_size <= 1 or not torch.distributed.is_initialized() or torch.distributed.get_world_size() != dp_size:
        return rows
    parts: list[Any] = [None] * dp_size
    torch.distributed.all_gather_object(parts, rows)
    return concat_rows(parts)


MINI_BATCH = MiniBatchRows()


def verl_metrics(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """vespo's diagnostics as verl logs them: floats under `actor/`, plus verl's `actor/ppo_kl` (mean of
    old_logp - logp over the tokens: vespo's kl/k1, whose per-token terms are clamped to +-20)."""
    out = {"actor/ppo_kl": float(metrics["kl/k1"])}
    out.update({f"actor/{key}": float(value) for key, value in metrics.items()})
    return out


def _vespo_agg(loss_agg_mode: str) -> str:
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not supported; choose one of: {', '.join(AGG_MODES)}")
    return AGG_MODES[loss_agg_mode]


def _options(config: Any, registered: str) -> dict[str, Any]:
    """The mapping at `config.policy_loss.<registered>` as a plain dict ({} when absent)."""
    section = _get(_get(config, "policy_loss"), registered)
    if section is None:
        return {}
    if not hasattr(section, "items"):
        raise TypeError(f"actor.policy_loss.{registered} must be a mapping of options, got {type(section).__name__}")
    return {str(key): _plain(value) for key, value in section.items()}


def _plain(value: Any) -> Any:
    """Nested omegaconf mappings (e.g. rollout_correction) as dicts."""
    return {str(k): _plain(v) for k, v in value.items()} if hasattr(value, "items") else value


def _batch_info(config: Any) -> Mapping[str, Any]:
    info = dict(_get(config, "global_batch_info") or {})
    if info.get("loss_scale_factor") is None:
        info["loss_scale_factor"] = _get(config, "loss_scale_factor")
    return info


def _get(obj: Any, key: str) -> Any:
    """`obj.key` for ActorConfig (a dataclass Mapping), omegaconf DictConfig or dict; None if absent."""
    if obj is None:
        return None
    if hasattr(obj, "get"):
        return obj.get(key, None)
    return getattr(obj, key, None)


REGISTERED = register_all()
VespoPolicyLossConfig = policy_loss_config_cls()
