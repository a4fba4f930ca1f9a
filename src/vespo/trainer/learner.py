"""The learner: behavior log-probs, one optimizer step per mini-batch, and the non-finite guard.

It knows nothing about where samples come from: both sample sources (local and Ray) feed it the
same `TrainBatch`es, and the training loop calls the same three methods in both modes.

    batches, m = learner.prepare(minibatches, behavior, replay)   μ for each mini-batch, before any
                                       update: the trainer's recompute (no grad) or the engine's
                                       log-probs; engine-vs-trainer metrics
    result = learner.update(minibatch)                    one AdamW step; skips non-finite steps
    result = learner.update(minibatch, behavior_pass=True)   a lag-0 mini-batch whose update's forward is
                                       also its behavior pass (one forward fewer)
    learner.save_checkpoint(...) / learner.weights()      what the loop checkpoints and pushes to engines

The learner owns the weights and the optimizer on ``model.device``; batches arrive on the CPU and
are moved there. ``RemoteLearner`` (vespo.trainer.remote) runs the same object as a Ray actor.

Router replay (``cfg.rollout.router_replay``, docs/router_replay.md) on a MoE model: ``r2`` records
the experts the recompute pass chose at every position into ``batch.routed_experts``; ``r3``
replays the engine's recorded ones there. Every training forward replays ``batch.routed_experts``
when it is set.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from vespo.config import OptimConfig
from vespo.losses import get_loss
from vespo.metrics import masked_mean, mismatch_metrics, reduce_metrics, to_floats
from vespo.models import compile_decoder_layers, is_moe, record_routing, response_logprobs
from vespo.models.moe import stack_routing
from vespo.types import TrainBatch


REPLAY_MODES = ("none", "r2", "r3")


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


@dataclass
class UpdateResult:
    metrics: dict[str, float]
    skipped: bool
    log_w: Tensor = field(default_factory=lambda: torch.zeros(0))  # [b] sequence log-weight each row had
    weight: Tensor = field(default_factory=lambda: torch.zeros(0))  # [b] the loss's weight on each row (LossOutput.seq_weight)


class Learner:
    def __init__(self, model: nn.Module, loss_name: str, loss_options: dict, optim: OptimConfig,
                 total_updates: int, temperature: float = 1.0, max_nonfinite: int = 3,
                 device: torch.device | str = "cpu", autocast: bool = False, compile: bool = False):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.autocast = autocast
        self.compiled = compile and compile_decoder_layers(model)  # eager (with a warning) where it cannot
        self.spec = get_loss(loss_name)
        self.loss_cfg = self.spec.config_cls(**loss_options)
        self.optim_cfg = optim
        self.temperature = temperature
        self.max_nonfinite = max_nonfinite
        self.params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel for all parameters instead of ~10 small ops per tensor (4x faster on CPU)
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                           weight_decay=optim.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(optim, total_updates))
        self.version = 0  # optimizer steps taken = the policy version
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.moe = is_moe(model)

    # ------------------------------------------------------------ behavior policy

    def prepare(self, minibatches: list[TrainBatch], behavior: str,
                replay: str = "none") -> tuple[list[TrainBatch], dict[str, float]]:
        """Set each mini-batch's old_logp (μ) before any update, and measure the engine-vs-trainer gap.

        behavior ``recompute``: μ = the trainer's log-probs of the current weights, computed on exactly
        the micro-batches the update will use, so with N = 1 the first update sees W == 1 bit for bit.
        ``rollout``: μ = the engine's log-probs. The recompute pass runs in both cases, for the
        ``mismatch/*`` metrics (engine vs trainer on the same tokens) and the entropy. ``replay`` is the
        router replay mode (none, r2, r3; see ``behavior_logp``).
        """
        stats = []
        for mb in minibatches:
            logp, entropy = self.behavior_logp(mb, replay)  # [b, T], [b, T] (on the CPU)
            mb.old_logp = logp if behavior == "recompute" else mb.rollout_logp
            stats.append(behavior_metrics(mb, logp, entropy))
        return minibatches, to_floats(reduce_metrics(stats))

    @torch.no_grad()
    def behavior_logp(self, batch: TrainBatch, replay: str = "none") -> tuple[Tensor, Tensor]:
        """The trainer's log-probs [B, T] and entropy [B, T] of the batch under the current weights.

        Computed on exactly the micro-batches ``update`` will use, so with N = 1 the first update
        sees W == 1 bit for bit. ``replay`` sets ``batch.routed_experts``, what every training
        forward over the batch replays (nothing changes on a dense model):
          none  routes freely and clears batch.routed_experts;
          r2    routes freely and records its choices at every position into batch.routed_experts;
          r3    replays batch.routed_experts, the engine's choices (it must be set).
        """
        if replay not in REPLAY_MODES:
            raise ValueError(f"router replay must be one of {', '.join(REPLAY_MODES)}; got {replay!r}")
        if replay == "r3" and self.moe and batch.routed_experts is None:
            raise ValueError("router replay r3 needs the engine's routing, but batch.routed_experts is None: "
                             "build the HF engine with record_routing=True (the vLLM backend does not report "
                             "routing; see docs/router_replay.md)")
        if replay != "r3":
            batch.routed_experts = None  # none and r2 route freely here
        record = replay == "r2" and self.moe
        was_training = self.model.training
        self.model.eval()
        parts = [self._behavior_micro(micro.to(self.device), record) for micro in self.micro_batches(batch)]
        self.model.train(was_training)
        if record:
            batch.routed_experts = torch.cat([routing for _, _, routing in parts]).cpu()  # [B, P+T, L, K]
        return torch.cat([logp for logp, _, _ in parts]).cpu(), torch.cat([ent for _, ent, _ in parts]).cpu()

    def _behavior_micro(self, micro: TrainBatch, record: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """logp [b, T], entropy [b, T] and, when recording, the routing of every position [b, P+T, L, K]."""
        if not record:
            logp, entropy = self._logprobs(micro, with_entropy=True)
            return logp, entropy, None
        with record_routing(self.model) as records:
            logp, entropy = self._logprobs(micro, with_entropy=True, share_prompts=False)  # one pass: P+T positions
        b, S = micro.prompt_ids.shape[0], micro.prompt_ids.shape[1] + micro.response_ids.shape[1]
        return logp, entropy, stack_routing(records, b, S)

    def _logprobs(self, micro: TrainBatch, with_entropy: bool,
                  share_prompts: bool = True) -> tuple[Tensor, Tensor | None]:
        """Response log-probs [b, T] (and entropy) replaying micro.routed_experts when it is set.

        Without replay, each of the micro-batch's distinct prompts runs once (``share_prompts``);
        μ and the update take the same path, so with N = 1 they still agree bit for bit.
        """
        share_prompts = share_prompts and micro.routed_experts is None
        with self._autocast():
            return response_logprobs(self.model, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                     micro.response_mask, temperature=self.temperature, with_entropy=with_entropy,
                                     routed_experts=micro.routed_experts, share_prompts=share_prompts)

    # ------------------------------------------------------------ one optimizer step

    def shares_behavior_forward(self, replay: str = "none") -> bool:
        """Whether a mini-batch trained on the weights μ is defined by (lag 0) may take its behavior pass
        from its own update's forward (``update(mb, behavior_pass=True)``).

        The update's forward, detached, then is the recompute itself, provided a train-mode forward
        equals an eval-mode one (no dropout) and μ's pass records nothing the update needs (R2
        records routing in it).
        """
        return not (replay == "r2" and self.moe) and _dropout_free(self.model)

    def update(self, mb: TrainBatch, behavior_pass: bool = False) -> UpdateResult:
        """One optimizer step on mini-batch ``mb``.

        ``mb.old_logp`` must be set, unless ``behavior_pass``: then this update's forward is also the
        behavior pass of a lag-0 mini-batch (``shares_behavior_forward``): μ = its log-probs, detached,
        when ``mb.old_logp`` is None (one forward instead of two, and W == 1 bit for bit), and its
        ``mismatch/*`` and entropy metrics come with the update's.
        """
        if mb.old_logp is None and not behavior_pass:
            raise ValueError("mini-batch has no old_logp: set the behavior log-probs before update()")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        normalizer = self._normalizer(mb)
        loss_sum, metrics, behavior = torch.zeros((), device=self.device), [], []
        rows: dict[str, list[Tensor]] = {"log_w": [], "weight": [], "old_logp": []}
        for micro in self.micro_batches(mb):
            micro = micro.to(self.device)
            logp, entropy = self._logprobs(micro, with_entropy=behavior_pass)  # replays micro.routed_experts
            if behavior_pass:
                if micro.old_logp is None:  # μ = this lag-0 forward, detached: the recompute itself
                    micro.old_logp = logp.detach()
                behavior.append(behavior_metrics(micro, logp.detach(), entropy))
            out = self._loss(micro, logp, normalizer)
            out.loss.backward()
            loss_sum = loss_sum + out.loss.detach()
            metrics.append(out.metrics)
            log_w = ((logp.detach() - micro.old_logp) * micro.response_mask).sum(dim=-1)  # [b]
            rows["log_w"].append(log_w)
            rows["weight"].append(out.seq_weight if out.seq_weight is not None else torch.full_like(log_w, math.nan))
            rows["old_logp"].append(micro.old_logp)
        if mb.old_logp is None:
            mb.old_logp = torch.cat(rows["old_logp"]).cpu()  # [b, T]
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        reduced = reduce_metrics(metrics + behavior)
        reduced.update({"loss/total": loss_sum, "optim/grad_norm": grad_norm, "optim/grad_norm_max": grad_norm,
                        "optim/lr": self.scheduler.get_last_lr()[0]})
        reduced = to_floats(reduced)  # the update's one host sync
        per_row = {"log_w": torch.cat(rows["log_w"]).cpu(), "weight": torch.cat(rows["weight"]).float().cpu()}
        if not (math.isfinite(reduced["loss/total"]) and math.isfinite(reduced["optim/grad_norm"])):
            return self._skip(reduced, per_row)
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        self.nonfinite_in_a_row = 0
        reduced["optim/n_skipped"] = 0.0
        return UpdateResult(reduced, skipped=False, **per_row)

    def _loss(self, micro: TrainBatch, logp: Tensor, normalizer: float):
        """The loss of one micro-batch (on the learner's device) given its log-probs [b, T]."""
        # the engine's log-probs reach the loss only for its rollout correction; the engine-vs-trainer gap
        # itself is logged once, as mismatch/* (the behavior pass), not again as the loss's rollout/k1, k3
        correct = self.loss_cfg.rollout_correction.mode != "none"
        out = self.spec.fn(logp, micro.old_logp, micro.advantages, micro.response_mask, self.loss_cfg,
                           normalizer=normalizer, rollout_logp=micro.rollout_logp if correct else None)
        out.metrics = {k: v for k, v in out.metrics.items() if k not in ("rollout/k1", "rollout/k3")}
        return out

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else nullcontext()

    def _skip(self, metrics: dict[str, float], rows: dict[str, Tensor]) -> UpdateResult:
        """Drop the gradient of a non-finite step: the weights and optimizer state stay untouched."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        metrics["optim/n_skipped"] = 1.0
        if self.nonfinite_in_a_row >= self.max_nonfinite:
            raise NonFiniteError(f"{self.nonfinite_in_a_row} consecutive updates had a non-finite loss or gradient "
                                 f"(loss={metrics['loss/total']}, grad_norm={metrics['optim/grad_norm']}); "
                                 "stopping. The last checkpoint holds the weights before them.")
        return UpdateResult(metrics, skipped=True, **rows)

    def _normalizer(self, mb: TrainBatch) -> float:
        """Token count (token-mean) or sequence count (seq-mean-*) of the whole mini-batch."""
        valid = mb.response_mask > 0
        if getattr(self.loss_cfg, "agg", "token-mean") == "token-mean":
            return float(max(int(valid.sum()), 1))
        return float(max(int(valid.any(dim=1).sum()), 1))

    def micro_batches(self, mb: TrainBatch):
        size = self.optim_cfg.micro_batch_size or len(mb)
        for start in range(0, len(mb), size):
            yield mb.select(torch.arange(start, min(start + size, len(mb))))

    # ------------------------------------------------------------ weights and state

    def weights(self) -> dict[str, Tensor]:
        """The policy's weights on the CPU (what engines load and checkpoints store)."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, run_dir: str | Path, step: int, extra: dict, config: dict) -> Path:
        """An atomic checkpoint of the weights, the optimizer and ``extra`` (the loop's counters)."""
        from vespo.trainer.checkpoint import save_checkpoint

        return save_checkpoint(run_dir, step, self.model, {**extra, "learner": self.state_dict()}, config)

    def load_checkpoint(self, path: str | Path) -> dict:
        """Weights and optimizer from a checkpoint (RNG restored); returns the loop's ``extra`` state."""
        from vespo.trainer.checkpoint import load_checkpoint

        state = load_checkpoint(path, self.model)
        self.load_state_dict(state.pop("learner"))
        return state

    def save_policy(self, run_dir: str | Path, tokenizer, config: dict) -> Path:
        """RUN_DIR/policy/: the policy as a Hugging Face directory (model + tokenizer, save_pretrained)."""
        from vespo.trainer.checkpoint import save_run_policy

        return save_run_policy(run_dir, self.model, tokenizer, config)

    def close(self) -> None:
        pass  # nothing to release in process (RemoteLearner stops its actor)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "version": self.version, "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "nonfinite_total": self.nonfinite_total}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.nonfinite_total = state["nonfinite_total"]


def behavior_metrics(mb: TrainBatch, logp: Tensor, entropy: Tensor) -> dict[str, Tensor]:
    """Engine-vs-trainer mismatch on the batch's responses (the trainer's logp [b, T]) and the policy's entropy."""
    return {**mismatch_metrics(mb.rollout_logp, logp, mb.response_mask),
            "rollout/entropy": masked_mean(entropy, mb.response_mask)}


def _dropout_free(model: nn.Module) -> bool:
    """No dropout anywhere (modules or config rates): a train-mode forward equals an eval-mode one."""
    config = vars(getattr(model, "config", None) or object())
    rates = [v for k, v in config.items() if "dropout" in k and isinstance(v, float)]
    rates += [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    return all(rate == 0 for rate in rates)


def _schedule(optim: OptimConfig, total: int):
    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total - optim.warmup_steps))
        if optim.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


