"""vespo's losses inside TRL: `VespoGRPOTrainer`, a GRPOTrainer whose loss is one of vespo's.

    from vespo.integrations.trl import VespoGRPOTrainer
    trainer = VespoGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                               loss_name="vespo", loss_config=get_loss("vespo").config_cls(length_norm="sqrt"))
    trainer.train()

TRL keeps generation, rewards, advantages, batching and the optimizer; only the loss of each
micro-batch (`GRPOTrainer._compute_loss`) is replaced. The policy's log-probs are TRL's
(`_get_per_token_logps_and_entropies`); the behavior log-probs are TRL's `old_per_token_logps` (the
policy at generation time), or the current ones detached when TRL skips them (fully on-policy).

With vLLM, the sampler's log-probs (TRL's `sampling_per_token_logps`; unavailable ones count as
π_old's, as TRL counts them) are the loss's rollout log-probs, and TRL's importance-sampling
correction (`vllm_importance_sampling_correction`) becomes vespo's rollout correction of the same
ratio ρ = π_old/π_sampler, as TRL applies it:

    vllm_importance_sampling_mode    vespo rollout_correction (threshold = vllm_importance_sampling_clip_max)
    token_truncate / token_mask      tis_token / mis_token
    sequence_truncate / sequence_mask  tis_seq / mis_seq (not with vespo, vespo_adaptive)

VESPO (and vespo_adaptive) add log ρ to log W, as TRL's `loss_type="vespo"` does, and like it accept
the token-level modes only: TRL's default `sequence_mask` and `sequence_truncate` are rejected,
naming the field. The other losses multiply their per-token loss by ρ, as TRL's other losses do.
`vllm_importance_sampling_clip_min` has no counterpart and is rejected. With TRL's correction off,
the loss config's own `rollout_correction` applies (none by default), and `rollout/k1`, `rollout/k3`
still report the gap. TRL 1.16 recomputes π_old over the full vocabulary while vLLM returns the
log-probs of the truncated distribution it sampled, so ρ carries the kept mass S whenever
sampling is truncated (fixed in TRL 1.17; docs/sampling.md): the correction is refused
with `top_p < 1`, `top_k > 0`, `min_p` or `repetition_penalty != 1` (docs/sampling.md).

Supported TRL: 1.16 (checked when the trainer is built). The hook relies on 1.16's internals (the
meaning of `num_items_in_batch`, `_get_per_token_logps_and_entropies`, the batch's keys), which
changed before it and in 1.17's importance sampling under top-k / top-p.

The loss is normalized the way TRL normalizes its token-summing losses (`dapo`, `vespo`): by the
token count, or for seq-mean-* aggregations the sequence count, of one optimizer step's batch on
this process, so gradient accumulation and data parallelism leave the gradient unchanged.

vespo's diagnostics (`is/ess`, `vespo/phi_pos_mean`, ..., and `entropy`) are each one optimizer step's
value whatever the micro-batching: every call keeps its per-row statistics until the step's
micro-batches (the gradient-accumulation window) are all in, the rows of every process are gathered,
and the step's metrics are formed from all of them (vespo.losses.diagnostics). At each log the steps
since the last one combine by the metric's name (a `_max` by max, a count by sum, a statistic of one
sign of A over the steps that have that sign; vespo.metrics.reduce_metrics), not by TRL's plain mean.
"""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace
from typing import Any

import torch
import trl
from accelerate.utils import gather_object
from trl import GRPOConfig, GRPOTrainer

from vespo.losses import RolloutCorrection, concat_rows, get_loss, prepare_inputs, summarize
from vespo.metrics import reduce_metrics, to_floats

SUPPORTED_TRL = (1, 16)  # (major, minor) this hook is written and tested against

# TRL's vllm_importance_sampling_mode -> vespo's rollout-correction mode for the same ratio
TRL_IS_MODES = {
    "token_truncate": "tis_token",
    "token_mask": "mis_token",
    "sequence_truncate": "tis_seq",
    "sequence_mask": "mis_seq",
}
VESPO_IS_MODES = ("token_truncate", "token_mask")  # what TRL's own loss_type="vespo" accepts


class StepMetrics:
    """vespo's diagnostics as one optimizer step's values, for a TRL trainer (GRPOTrainer, AsyncGRPOTrainer).

    `_keep_rows` keeps each loss call's per-row statistics until the step's micro-batches are all in;
    `log` combines the steps since the last log by the metrics' names (vespo.metrics.reduce_metrics).
    """

    def _keep_rows(self, mode: str, rows: dict[str, torch.Tensor], entropies: torch.Tensor,
                   mask: torch.Tensor) -> None:
        """Keep the call's rows until its optimizer step is whole (train: the accumulation window; eval: the
        call), then record the step's metrics, formed from the rows of every process."""
        entropy = (entropies.detach() * mask).sum(dim=-1).double()  # [B] per-row sums
        pending = self.__dict__.setdefault("_vespo_pending", {}).setdefault(mode, [])
        pending.append({**{k: v.detach().cpu() for k, v in rows.items()}, "entropy": entropy.cpu()})
        if len(pending) < (self.current_gradient_accumulation_steps if mode == "train" else 1):
            return
        step = concat_rows(gather_object([concat_rows(pending)]))  # every process's rows of the step
        pending.clear()
        metrics = to_floats(summarize(step))
        metrics["entropy"] = float(step["entropy"].sum() / step["tokens"].sum().clamp(min=1.0))
        self.__dict__.setdefault("_vespo_steps", {}).setdefault(mode, []).append(metrics)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with vespo's metrics of the steps since the last log combined by their names."""
        mode = "train" if self.model.training else "eval"
        steps = self.__dict__.get("_vespo_steps", {}).pop(mode, [])
        for key, value in reduce_metrics(steps).items():
            self._metrics[mode][key] = [value]  # one value: TRL's mean over the window is the name's reduction
        super().log(logs, start_time)


class VespoGRPOTrainer(StepMetrics, GRPOTrainer):
    """TRL's GRPOTrainer with the loss computed by vespo's `loss_name` under `loss_config`.

    `loss_config` defaults to the loss's own defaults; for `vespo` and `vespo_adaptive` the (k, λ)
    pairs (the adaptive loss's base shape) then come from `GRPOConfig.vespo_k_pos`, ... so that the
    two trainers agree on the same arguments.
    """

    def __init__(self, *args: Any, loss_name: str = "vespo", loss_config: Any = None, **kwargs: Any) -> None:
        check_trl_version(trl.__version__)
        self.vespo_spec = get_loss(loss_name)
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:  # before TRL builds vLLM, as TRL checks its own VESPO
            trl_rollout_correction(_settings_of(config, self.vespo_spec))
        super().__init__(*args, **kwargs)
        self.vespo_config = _resolve_config(self.vespo_spec, loss_config, self.args)
        _check_supported(self.args)
        with_trl_correction(self.vespo_config, trl_rollout_correction(self))  # fails early on a conflict

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        logp, entropies, aux_loss = self._policy_logps(model, inputs)  # [B, T]
        mask = inputs["completion_mask"]  # [B, T]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp  # [B, T]
        x = prepare_inputs(logp, old_logp, inputs["advantages"], mask.to(logp.dtype),
                           rollout_logp=_sampler_logp(old_logp, inputs.get("sampling_per_token_logps")))
        out = self.vespo_spec.fn(x, self._loss_config(inputs), normalizer=self._normalizer(mode, inputs, logp.shape[0]))
        loss = out.loss
        if aux_loss is not None:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._keep_rows(mode, out.rows, entropies, mask)
        return loss

    def _policy_logps(self, model: torch.nn.Module, inputs: dict[str, Any]):
        """Per-token log-probs [B, T] (with grad), entropies [B, T] and the MoE aux loss, as TRL computes them."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + T]
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # [B, P + T]
        multimodal = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                      "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
        return self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in multimodal},
        )

    def _loss_config(self, inputs: dict[str, Any]) -> Any:
        """The loss config, with TRL's vLLM importance-sampling correction as its rollout correction when on."""
        correction = trl_rollout_correction(self)
        if correction is not None and inputs.get("sampling_per_token_logps") is None:
            raise ValueError("TRL's vllm_importance_sampling_correction is on, but the batch has no "
                             "sampling_per_token_logps (the vLLM log-probs the correction needs)")
        return with_trl_correction(self.vespo_config, correction)

    def _normalizer(self, mode: str, inputs: dict[str, Any], batch_size: int) -> float:
        """Tokens (token-mean) or sequences (seq-mean-*) in one optimizer step's batch on this process.

        Token count as TRL's `dapo`/`vespo` losses take it: `num_items_in_batch` spans the generation
        batch of all processes, so it is divided by the process count and rescaled from
        `steps_per_generation` micro-batches to one accumulation window.
        """
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.vespo_config.agg != "token-mean":
            return float(batch_size * accumulation)
        tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            tokens = tokens * accumulation / self.args.steps_per_generation
        return float(tokens)


def _resolve_config(spec: Any, loss_config: Any, args: GRPOConfig) -> Any:
    if loss_config is None:
        if spec.name in ("vespo", "vespo_adaptive"):
            return spec.config_cls(k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos,
                                   k_neg=args.vespo_k_neg, lambda_neg=args.vespo_lambda_neg)
        return spec.config_cls()
    if type(loss_config) is not spec.config_cls:
        raise TypeError(
            f"loss_config for loss {spec.name!r} must be a {spec.config_cls.__name__}, got {type(loss_config).__name__}"
        )
    return loss_config


def trl_rollout_correction(trainer: GRPOTrainer) -> RolloutCorrection | None:
    """vespo's rollout correction equal to TRL's vLLM importance-sampling correction, None when that is off."""
    if not (trainer.use_vllm and trainer.vllm_importance_sampling_correction):
        return None
    mode = trainer.vllm_importance_sampling_mode
    if mode not in TRL_IS_MODES:
        raise ValueError(f"GRPOConfig.vllm_importance_sampling_mode={mode!r} is unknown; choose one of: "
                         f"{', '.join(TRL_IS_MODES)}")
    if trainer.vespo_spec.name in ("vespo", "vespo_adaptive") and mode not in VESPO_IS_MODES:
        raise ValueError(
            f"GRPOConfig.vllm_importance_sampling_mode={mode!r} is not supported with loss "
            f"{trainer.vespo_spec.name!r}, as TRL's own loss_type='vespo' rejects it: VESPO folds the "
            f"correction into its sequence weight token by token; set it to {' or '.join(VESPO_IS_MODES)} "
            "(TRL's default is 'sequence_mask'), or vllm_importance_sampling_correction=False"
        )
    _check_untruncated_sampling(trainer)
    if trainer.vllm_importance_sampling_clip_min is not None:
        raise ValueError(
            f"GRPOConfig.vllm_importance_sampling_clip_min={trainer.vllm_importance_sampling_clip_min!r} is not "
            "supported by VespoGRPOTrainer (vespo's rollout correction truncates or masks above a threshold only); "
            "leave it at None"
        )
    clip_max = trainer.vllm_importance_sampling_clip_max
    return RolloutCorrection(mode=TRL_IS_MODES[mode], threshold=sys.float_info.max if clip_max is None else clip_max)


def with_trl_correction(config: Any, correction: RolloutCorrection | None) -> Any:
    """``config`` with TRL's correction as its rollout correction (unchanged when TRL's is off)."""
    if correction is None:
        return config
    if config.rollout_correction.mode != "none":
        raise ValueError(
            f"loss_config.rollout_correction.mode={config.rollout_correction.mode!r} would correct a second time: "
            "TRL's vllm_importance_sampling_correction is on; use one of the two"
        )
    return dataclasses.replace(config, rollout_correction=correction)


def _settings_of(config: GRPOConfig, spec: Any) -> SimpleNamespace:
    """The settings `trl_rollout_correction` reads, from the config that GRPOTrainer.__init__ copies them from."""
    names = ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "top_p", "top_k", "min_p",
             "repetition_penalty")
    return SimpleNamespace(args=config, vespo_spec=spec, **{name: getattr(config, name) for name in names})


def check_trl_version(version: str) -> None:
    """Refuse a TRL other than SUPPORTED_TRL, whose internals the hook reads."""
    major_minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if major_minor != SUPPORTED_TRL:
        supported = ".".join(map(str, SUPPORTED_TRL))
        raise RuntimeError(
            f"VespoGRPOTrainer supports TRL {supported}.x; TRL {version} is installed. The hook reads TRL "
            f"{supported}'s GRPOTrainer internals (its loss normalizer and batch keys), which other versions "
            f"change: install trl=={supported}.* (docs/integrations.md)"
        )


def _check_untruncated_sampling(trainer: GRPOTrainer) -> None:
    """Refuse TRL's correction when vLLM samples from a reshaped distribution TRL 1.16's π_old does not see."""
    overrides = getattr(trainer.args, "generation_kwargs", None) or {}
    settings = {name: overrides.get(name, getattr(trainer, name, None))
                for name in ("top_p", "top_k", "min_p", "repetition_penalty")}
    reshaped = {
        "top_p": settings["top_p"] is not None and settings["top_p"] < 1.0,
        "top_k": settings["top_k"] is not None and settings["top_k"] > 0,
        "min_p": bool(settings["min_p"]),
        "repetition_penalty": settings["repetition_penalty"] not in (None, 1.0),
    }
    for name, bad in reshaped.items():
        if bad:
            raise ValueError(
                f"GRPOConfig.{name}={settings[name]!r} with vllm_importance_sampling_correction=True: vLLM's "
                "log-probs are those of the reshaped distribution it samples from, TRL 1.16's π_old those of "
                "the full softmax, so the correction's ratio would carry the kept mass (docs/sampling.md); "
                f"leave {name} at its default or set vllm_importance_sampling_correction=False"
            )


def _check_supported(args: GRPOConfig) -> None:
    """Reject the GRPOConfig options that change TRL's own loss and that this loss hook does not apply."""
    unsupported = {
        "beta": args.beta != 0.0,
        "top_entropy_quantile": args.top_entropy_quantile < 1.0,
        "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
        "entropy_coef": args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        "importance_sampling_level": args.importance_sampling_level != "token",
    }
    for name, bad in unsupported.items():
        if bad:
            raise ValueError(
                f"GRPOConfig.{name}={getattr(args, name)!r} is not supported by VespoGRPOTrainer; leave it at TRL's "
                "default (vespo's losses form their own sequence weights and carry no KL or entropy term)"
            )


def _sampler_logp(old_logp: torch.Tensor, sampling_logp: torch.Tensor | None) -> torch.Tensor | None:
    """The sampler's (vLLM's) log-probs [B, T], None without them; a NaN (unavailable) one counts as π_old's."""
    if sampling_logp is None:
        return None
    if sampling_logp.shape != old_logp.shape:
        raise ValueError(
            f"sampling_per_token_logps has shape {tuple(sampling_logp.shape)}, expected {tuple(old_logp.shape)}"
        )
    sampling_logp = sampling_logp.detach().to(old_logp.dtype)
    return torch.where(torch.isnan(sampling_logp), old_logp.detach(), sampling_logp)
