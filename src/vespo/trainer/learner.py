"""The learner: behavior log-probs, one optimizer step per mini-batch, and the non-finite guard.

It knows nothing about where samples come from: the synchronous loop and the asynchronous
(Ray) trainer feed it the same `TrainBatch`es.

    learner.behavior_logp(batch, replay)   μ = the trainer's own log-probs of the current weights (no grad),
                                           and the MoE routing every training forward will replay
    learner.update(minibatch)              one AdamW step; returns metric tensors; skips non-finite steps

Router replay (``replay``, docs/router_replay.md) on a MoE model: ``r2`` records the experts this
recompute pass chose at every position into ``batch.routed_experts``; ``r3`` replays the engine's
recorded ones there. Every training forward replays ``batch.routed_experts`` when it is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vespo.config import OptimConfig
from vespo.losses import get_loss
from vespo.models import compile_decoder_layers, is_moe, record_routing, response_logprobs
from vespo.models.moe import stack_routing
from vespo.types import TrainBatch


REPLAY_MODES = ("none", "r2", "r3")


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


@dataclass
class UpdateResult:
    metrics: dict[str, Tensor | float]
    skipped: bool
    logp: Tensor | None = None  # [b, T] the update's own log-probs, detached (when asked for)
    entropy: Tensor | None = None  # [b, T] their entropy, detached (when asked for)


class Learner:
    def __init__(self, model: nn.Module, loss_name: str, loss_options: dict, optim: OptimConfig,
                 total_updates: int, temperature: float = 1.0, max_nonfinite: int = 3, compile: bool = False):
        self.model = model
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
        parts = [self._behavior_micro(micro, record) for micro in self.micro_batches(batch)]
        self.model.train(was_training)
        if record:
            batch.routed_experts = torch.cat([routing for _, _, routing in parts])  # [B, P+T, L, K]
        return torch.cat([logp for logp, _, _ in parts]), torch.cat([ent for _, ent, _ in parts])

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
        return response_logprobs(self.model, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                 micro.response_mask, temperature=self.temperature, with_entropy=with_entropy,
                                 routed_experts=micro.routed_experts, share_prompts=share_prompts)

    # ------------------------------------------------------------ one optimizer step

    def shares_behavior_forward(self, replay: str = "none") -> bool:
        """Whether a lag-0 mini-batch may take μ from its own update's forward (``update(own_behavior=True)``).

        At lag 0 the weights are still those μ is defined by, so the update's forward, detached, is
        the recompute itself, provided a train-mode forward equals an eval-mode one (no dropout)
        and μ's pass records nothing the update needs (R2 records routing in it).
        """
        return not (replay == "r2" and self.moe) and _dropout_free(self.model)

    def update(self, mb: TrainBatch, own_behavior: bool = False, report_logp: bool = False) -> UpdateResult:
        """One optimizer step on mini-batch ``mb``.

        ``mb.old_logp`` must be set, unless ``own_behavior``: then μ is this update's own forward,
        detached (one forward instead of two, and W == 1 bit for bit), which is right for a lag-0
        mini-batch when ``shares_behavior_forward``; it is stored in ``mb.old_logp``. With
        ``own_behavior`` or ``report_logp`` the result carries the forward's log-probs and entropy.
        """
        if mb.old_logp is None and not own_behavior:
            raise ValueError("mini-batch has no old_logp: set the behavior log-probs before update()")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        normalizer = self._normalizer(mb)
        report = own_behavior or report_logp
        loss_sum, metrics, logps, entropies = torch.zeros(()), [], [], []
        for micro in self.micro_batches(mb):
            logp, entropy = self._logprobs(micro, with_entropy=report)  # replays micro.routed_experts when set
            if own_behavior:
                micro.old_logp = logp.detach()
            out = self.spec.fn(logp, micro.old_logp, micro.advantages, micro.response_mask, self.loss_cfg,
                               normalizer=normalizer, rollout_logp=micro.rollout_logp)
            out.loss.backward()
            loss_sum = loss_sum + out.loss.detach()
            metrics.append(out.metrics)
            logps.append(logp.detach())
            entropies.append(entropy)
        if own_behavior:
            mb.old_logp = torch.cat(logps)  # [b, T]
        result = self._step(loss_sum, metrics)
        if report:
            result.logp, result.entropy = torch.cat(logps), torch.cat(entropies)
        return result

    def _step(self, loss_sum: Tensor, metrics: list[dict]) -> UpdateResult:
        """Clip, check and apply the accumulated gradient."""
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        reduced = _mean_metrics(metrics)
        reduced.update({"loss/total": loss_sum, "optim/grad_norm": grad_norm, "optim/lr": self.scheduler.get_last_lr()[0]})
        if not (torch.isfinite(loss_sum) and torch.isfinite(grad_norm)):
            return self._skip(reduced)
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        self.nonfinite_in_a_row = 0
        reduced["optim/skipped"] = 0.0
        return UpdateResult(reduced, skipped=False)

    def _skip(self, metrics: dict) -> UpdateResult:
        """Drop the gradient of a non-finite step: the weights and optimizer state stay untouched."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        metrics["optim/skipped"] = 1.0
        if self.nonfinite_in_a_row >= self.max_nonfinite:
            raise NonFiniteError(f"{self.nonfinite_in_a_row} consecutive updates had a non-finite loss or gradient "
                                 f"(loss={float(metrics['loss/total'])}, grad_norm={float(metrics['optim/grad_norm'])}); "
                                 "stopping. The last checkpoint holds the weights before them.")
        return UpdateResult(metrics, skipped=True)

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

    # ------------------------------------------------------------ state

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


def _mean_metrics(dicts: list[dict[str, Tensor]]) -> dict[str, Tensor | float]:
    """Mean over micro-batches (each micro-batch's diagnostics describe its own rows)."""
    if len(dicts) == 1:
        return dict(dicts[0])
    return {k: torch.stack([d[k].float() for d in dicts if k in d]).mean() for k in dicts[0]}
