"""The rollout stage: prompts → engine samples → rewards → group advantages → a `TrainBatch`.

The local sample source calls :meth:`RolloutProducer.produce` once per rollout step; a Ray rollout
worker calls :meth:`score` after its own partial-rollout loop, on prompts the driver drew with
:meth:`sample`. Prompts are tokenized and responses decoded by vespo.rollout.text, the decoding
path evaluation uses too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from vespo.advantages import group_advantages, zero_variance_groups
from vespo.config import AdvantageConfig
from vespo.errors import RewardFnError
from vespo.models import encode_prompt
from vespo.rollout.text import decode_responses
from vespo.types import Problem, Rollout, TrainBatch

RewardFn = Callable[[list[str], list[Problem]], list[float]]  # (completions, each one's problem) -> rewards


@dataclass
class PromptBatch:
    problems: list[Problem]  # [n] prompts of this batch
    prompt_ids: list[list[int]]  # [n * G] token ids, each prompt repeated G times
    group_ids: Tensor  # [n * G] int64


class RolloutProducer:
    def __init__(self, engine, tokenizer, stream, reward_fn: RewardFn, sampling, group_size: int,
                 advantage: AdvantageConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.stream = stream
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.group_size = group_size
        self.advantage = advantage
        self._encoded: dict[str, list[int]] = {}

    def produce(self, n_prompts: int, seed: int, first_group_id: int) -> tuple[TrainBatch, dict[str, float]]:
        """Sample, score and advantage one rollout batch of ``n_prompts`` x G responses."""
        prompts = self.sample(n_prompts, first_group_id)
        t0 = time.perf_counter()
        rollout = self.engine.generate(prompts.prompt_ids, self.sampling, seed=seed)
        gen_s = time.perf_counter() - t0
        batch, metrics = self.score(prompts, rollout)
        n_tokens = float(rollout.response_mask.sum())
        metrics.update({"perf/rollout_s": gen_s, "perf/rollout_tokens_per_s": n_tokens / max(gen_s, 1e-9)})
        return batch, metrics

    def sample(self, n_prompts: int, first_group_id: int) -> PromptBatch:
        """The next ``n_prompts`` problems of the stream, tokenized, each repeated G times."""
        problems = self.stream.next_batch(n_prompts)
        ids = [self.encode(p) for p in problems]
        G = self.group_size
        return PromptBatch(problems=problems, prompt_ids=[x for x in ids for _ in range(G)],
                           group_ids=torch.arange(first_group_id, first_group_id + len(problems)).repeat_interleave(G))

    def score(self, prompts: PromptBatch, rollout: Rollout) -> tuple[TrainBatch, dict[str, float]]:
        """Rewards and advantages of a finished rollout, as a TrainBatch (old_logp not yet set)."""
        completions = self.decode(rollout)
        problems = [p for p in prompts.problems for _ in range(self.group_size)]
        rewards = torch.tensor(self.reward_fn(completions, problems), dtype=torch.float32)  # [B]
        scored = torch.isfinite(rewards)  # [B] a reward that failed (NaN, reported by the scorer) drops its row
        if not bool(scored.any()):
            raise RewardFnError(f"every reward of a rollout batch of {len(rewards)} failed (NaN); see the warnings "
                                "above for the reward function's errors")
        if not bool(scored.all()):
            rollout, prompts, rewards, n_failed = _drop_rows(rollout, prompts, rewards, scored)
        else:
            n_failed = 0
        adv = group_advantages(rewards, prompts.group_ids, self.advantage.estimator, self.advantage.eps)  # [B]
        flat = zero_variance_groups(rewards, prompts.group_ids)  # [B]
        token_versions = rollout.token_versions
        if token_versions is None:
            token_versions = torch.full_like(rollout.response_ids, rollout.version)
        big = torch.iinfo(torch.int64).max
        valid = rollout.response_mask > 0
        v_min = torch.where(valid, token_versions, big).amin(dim=1)
        v_max = torch.where(valid, token_versions, -1).amax(dim=1)
        v_min = torch.where(valid.any(1), v_min, rollout.version)
        v_max = torch.where(valid.any(1), v_max, rollout.version)
        batch = TrainBatch(
            prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask, response_ids=rollout.response_ids,
            response_mask=rollout.response_mask.float(), rollout_logp=rollout.logprobs.float(), rewards=rewards,
            advantages=adv, group_ids=prompts.group_ids, versions=v_min, versions_max=v_max,
            truncated=rollout.truncated, routed_experts=rollout.routed_experts,
        )
        metrics = rollout_metrics(batch, flat)
        metrics["reward/failed"] = float(n_failed)
        if self.advantage.skip_zero_variance and bool(flat.any()) and not bool(flat.all()):
            batch = batch.select(torch.nonzero(~flat).flatten())
        return batch, metrics

    def decode(self, rollout: Rollout) -> list[str]:
        return decode_responses(self.tokenizer, rollout)

    def encode_all(self, problems: list[Problem]) -> list[list[int]]:
        return [self.encode(p) for p in problems]

    def encode(self, problem: Problem) -> list[int]:
        key = problem.id
        if key not in self._encoded:
            self._encoded[key] = encode_prompt(self.tokenizer, problem.prompt)
        return self._encoded[key]


def _drop_rows(rollout: Rollout, prompts: PromptBatch, rewards: Tensor, keep: Tensor):
    idx = torch.nonzero(keep).flatten()
    fields = {k: (v[idx] if isinstance(v, Tensor) else v) for k, v in vars(rollout).items()}
    kept = PromptBatch(problems=prompts.problems, prompt_ids=[prompts.prompt_ids[i] for i in idx.tolist()],
                       group_ids=prompts.group_ids[idx])
    return Rollout(**fields), kept, rewards[idx], int((~keep).sum())


def rollout_metrics(batch: TrainBatch, flat: Tensor) -> dict[str, float]:
    lengths = batch.response_mask.sum(dim=1)
    return {
        "reward/mean": float(batch.rewards.mean()),
        "reward/accuracy": float((batch.rewards >= 1.0).float().mean()),
        "reward/std": float(batch.rewards.std()) if len(batch) > 1 else 0.0,
        "rollout/response_len": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/eos_rate": float(1.0 - batch.truncated.float().mean()),
        "rollout/zero_var_group_frac": float(flat.float().mean()),
        "rollout/n_tokens": float(lengths.sum()),
    }
