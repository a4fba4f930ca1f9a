"""vespo's losses inside TRL: `VespoGRPOTrainer`, a GRPOTrainer whose loss is one of vespo's.

    from vespo.integrations.trl import VespoGRPOTrainer
    trainer = VespoGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                               loss_name="vespo", loss_config=get_loss("vespo").config_cls(length_norm="sqrt"))
    trainer.train()

TRL keeps generation, rewards, advantages, batching and the optimizer; only the loss of each
micro-batch (`GRPOTrainer._compute_loss`) is replaced. The policy's log-probs are TRL's
(`_get_per_token_logps_and_entropies`); the behavior log-probs are TRL's `old_per_token_logps` (the
policy at generation time), or the current ones detached when TRL skips them (fully on-policy).
With vLLM importance-sampling correction, TRL's per-token ratio π_old/π_sampler is passed to the
loss as rollout log-probs (log π_sampler = log π_old − log ratio), so VESPO corrects in log space.

The loss is normalized the way TRL normalizes its token-summing losses (`dapo`, `vespo`): by the
token count, or for seq-mean-* aggregations the sequence count, of one optimizer step's batch on
this process, so gradient accumulation and data parallelism leave the gradient unchanged.

vespo's diagnostics (`is/ess`, `vespo/phi_pos_mean`, ...) go to TRL's metrics (`self._metrics`),
averaged over processes, and appear in the trainer's logs next to TRL's own.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from vespo.losses import get_loss

LOG_WEIGHT_FLOOR = 1e-8  # importance ratios below this (masked tokens are 0) count as this


class VespoGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with the loss computed by vespo's `loss_name` under `loss_config`.

    `loss_config` defaults to the loss's own defaults; for `vespo` the (k, λ) pairs then come from
    `GRPOConfig.vespo_k_pos`, ... so that the two trainers agree on the same arguments.
    """

    def __init__(self, *args: Any, loss_name: str = "vespo", loss_config: Any = None, **kwargs: Any) -> None:
        self.vespo_spec = get_loss(loss_name)
        super().__init__(*args, **kwargs)
        self.vespo_config = _resolve_config(self.vespo_spec, loss_config, self.args)
        _check_supported(self.args)

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        logp, entropies, aux_loss = self._policy_logps(model, inputs)  # [B, T]
        mask = inputs["completion_mask"]  # [B, T]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp  # [B, T]
        out = self.vespo_spec.fn(
            logp,
            old_logp,
            inputs["advantages"],
            mask.to(logp.dtype),
            self.vespo_config,
            normalizer=self._normalizer(mode, inputs, logp.shape[0]),
            rollout_logp=_rollout_logp(old_logp, inputs.get("importance_sampling_ratio")),
        )
        loss = out.loss
        if aux_loss is not None:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_metrics(mode, out.metrics, entropies, mask)
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

    def _log_metrics(
        self, mode: str, metrics: dict[str, torch.Tensor], entropies: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """vespo's diagnostics and the mean token entropy, averaged over processes, into TRL's metrics."""
        for name, value in metrics.items():
            gathered = self.accelerator.gather(value.detach().float().reshape(1))
            self._metrics[mode][name].append(gathered.nanmean().item())
        totals = torch.stack([(entropies.detach() * mask).sum(), mask.sum().float()])
        totals = self.accelerator.reduce(totals, reduction="sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())


def _resolve_config(spec: Any, loss_config: Any, args: GRPOConfig) -> Any:
    if loss_config is None:
        if spec.name == "vespo":
            return spec.config_cls(k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos,
                                   k_neg=args.vespo_k_neg, lambda_neg=args.vespo_lambda_neg)
        return spec.config_cls()
    if not isinstance(loss_config, spec.config_cls):
        raise TypeError(
            f"loss_config for loss {spec.name!r} must be a {spec.config_cls.__name__}, got {type(loss_config).__name__}"
        )
    return loss_config


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


def _rollout_logp(old_logp: torch.Tensor, ratio: torch.Tensor | None) -> torch.Tensor | None:
    """Sampler log-probs [B, T] from TRL's per-token π_old/π_sampler ratio, or None without one."""
    if ratio is None:
        return None
    if ratio.shape != old_logp.shape:
        raise ValueError(
            f"importance_sampling_ratio has shape {tuple(ratio.shape)}; vespo's losses need the per-token ratio "
            f"{tuple(old_logp.shape)} (vllm_importance_sampling_mode 'token_truncate' or 'token_mask')"
        )
    return old_logp - torch.log(ratio.detach().to(old_logp.dtype).clamp(min=LOG_WEIGHT_FLOOR))
