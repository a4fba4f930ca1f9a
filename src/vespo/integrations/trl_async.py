"""vespo's losses inside TRL's asynchronous trainer: `VespoAsyncGRPOTrainer`.

    from vespo.integrations.trl_async import VespoAsyncGRPOTrainer
    trainer = VespoAsyncGRPOTrainer(model="path/or/id", reward_funcs=..., args=AsyncGRPOConfig(...),
                                    train_dataset=..., loss_name="vespo")
    trainer.train()

TRL 1.16's `AsyncGRPOTrainer` (trl.experimental.async_grpo) keeps generation (a vLLM server fed by
its rollout worker), rewards, advantages, packing, weight sync and the optimizer; only its
`compute_loss`, PPO-clip written inline, is replaced by vespo's loss `loss_name`.

Behaviour log-probs: the async trainer never recomputes π_old. Each trained token's
`old_log_probs` is the log-prob the generation server reported for it when it sampled it
(vLLM's `/v1/completions` `logprobs.token_logprobs`, carried through `RolloutSample.old_log_probs`
and the packer), so μ is the sampler's own distribution: the loss runs in vespo's bypass mode
(`prepare_inputs(..., bypass=True)`: μ = π_rollout; a rollout correction can only reject, on
π_θ/π_rollout, and a truncating one or IcePop, whose π_old/π_rollout has no π_old here, is refused
when the trainer is built).

Layout: the trainer forwards one packed row per rank (a prefix tree of its samples) and selects
the M trained tokens (`token_index`), each tagged with its sample (`segment_id`); the loss unpacks
them into the [S, T] batch vespo's losses take (S samples, T their longest trained length, each
sample's trained tokens in order), so sequence weights are per sample as in GRPOTrainer.

Normalization, as TRL's own loss: token-mean divides by the micro-batch's trained tokens over all
ranks per rank (`global_n_tokens / world_size`) times the gradient-accumulation steps, so a step's
gradient is the mean over its micro-batches; seq-mean-* by the micro-batch's samples per rank
likewise. vespo's diagnostics are each one optimizer step's value (vespo.integrations.trl.StepMetrics).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import trl
from trl.experimental.async_grpo import AsyncGRPOTrainer

from vespo.integrations.trl import StepMetrics, check_trl_version
from vespo.losses import get_loss, prepare_inputs


class VespoAsyncGRPOTrainer(StepMetrics, AsyncGRPOTrainer):
    """TRL's AsyncGRPOTrainer with the loss computed by vespo's `loss_name` under `loss_config`
    (the loss's defaults when None). TRL's `epsilon` / `epsilon_high` are its PPO-clip's and are not read."""

    def __init__(self, *args: Any, loss_name: str = "vespo", loss_config: Any = None, **kwargs: Any) -> None:
        check_trl_version(trl.__version__)
        self.vespo_spec = get_loss(loss_name)
        self.vespo_config = loss_config if loss_config is not None else self.vespo_spec.config_cls()
        if type(self.vespo_config) is not self.vespo_spec.config_cls:
            raise TypeError(f"loss_config for loss {loss_name!r} must be a {self.vespo_spec.config_cls.__name__}, "
                            f"got {type(self.vespo_config).__name__}")
        refusal = self.vespo_config.bypass_refusal()
        if refusal is not None:  # mu is the sampler's log-probs: the loss runs in bypass mode
            raise ValueError(f"loss_config: {refusal}")
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        start = time.time()
        log_probs, entropy, aux_loss = self._trained_token_logps(model, inputs)  # [M], [M]
        self._step_forward_s += time.time() - start
        selected = inputs["token_index"] >= 0
        segment = inputs["segment_id"][selected]  # [M] sample of each trained token
        logp, old_logp, ent, mask = unpack(segment, log_probs, inputs["old_log_probs"][selected], entropy)  # [S, T]
        advantages = torch.zeros(mask.shape[0], dtype=logp.dtype, device=logp.device)
        advantages = advantages.index_put((segment,), inputs["advantages"][selected].to(logp.dtype))  # [S]
        x = prepare_inputs(logp, old_logp, advantages, mask, bypass=True)
        out = self.vespo_spec.fn(x, self.vespo_config, normalizer=self._normalizer(inputs))
        loss = out.loss
        if aux_loss is not None:  # MoE load balancing, scaled for accumulation as TRL scales it
            loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps
        self._keep_rows("train", out.rows, ent, mask)
        self._account(inputs)
        return loss

    def _trained_token_logps(self, model, inputs):
        """log π_θ and the entropy [M] of each trained token, from TRL's packed forward (as its compute_loss runs it),
        and the MoE aux loss (None unless enabled)."""
        mask_bool = inputs["attention_mask"].bool()
        selected = inputs["token_index"] >= 0
        tree_keys = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
        tree = {key: inputs[key][inputs[key] >= 0] for key in tree_keys}
        tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        outputs = model(input_ids=inputs["input_ids"][mask_bool].unsqueeze(0),
                        position_ids=inputs["position_ids"][mask_bool].unsqueeze(0),
                        shift_labels=inputs["shift_labels"][mask_bool].unsqueeze(0),
                        fused_lm_head=True, **router, **tree)
        token_index = inputs["token_index"][selected]  # [M] packed position predicting each trained token
        aux = outputs.aux_loss if self.aux_loss_enabled else None
        return outputs.log_probs.flatten()[token_index], outputs.entropy.flatten()[token_index], aux

    def _normalizer(self, inputs: dict[str, Any]) -> float:
        """Trained tokens (token-mean) or samples (seq-mean-*) of the micro-batch per rank, times the accumulation."""
        if self.vespo_config.agg == "token-mean":
            count = float(inputs["global_n_tokens"][0])
        else:  # the collator broadcasts forwarded tokens and their mean per sample: their ratio is the sample count
            count = float(torch.round(inputs["global_n_forward_tokens"][0] / inputs["mean_seq_len"][0]))
        return max(count / self.accelerator.num_processes, 1.0) * self.current_gradient_accumulation_steps

    def _account(self, inputs: dict[str, Any]) -> None:
        """TRL's per-step token accounting (perf/* and batch/* metrics), as its compute_loss keeps it."""
        forward_tokens, mean_seq_len = float(inputs["global_n_forward_tokens"][0]), float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += forward_tokens
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += mean_seq_len * forward_tokens
        self._step_samples += forward_tokens / mean_seq_len


def unpack(segment: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each [M] per-token tensor laid out as [S, T] rows (one per sample, its tokens in order, 0 after), and the
    [S, T] bool mask of real tokens. `segment` [M] is non-decreasing (TRL's packer emits a sample's tokens together)."""
    if bool((segment.diff() < 0).any()):
        raise ValueError("segment_id must be non-decreasing (each sample's trained tokens together, in order)")
    samples = int(segment.max()) + 1 if segment.numel() else 0
    counts = torch.bincount(segment, minlength=samples)  # [S]
    starts = torch.cumsum(counts, 0) - counts  # [S]
    position = torch.arange(segment.numel(), device=segment.device) - starts[segment]  # [M]
    length = int(counts.max()) if samples else 0
    index = (segment, position)
    rows = tuple(x.new_zeros(samples, length).index_put(index, x) for x in flat)  # each [S, T]; keeps autograd
    mask = torch.zeros(samples, length, dtype=torch.bool, device=segment.device).index_put(
        index, torch.ones_like(segment, dtype=torch.bool))  # [S, T]
    return (*rows, mask)
