"""The rollout stage in two parts: prompts for a batch, and the scoring of what the engine sampled.

    sampler = PromptSampler(tokenizer, stream, group_size)
    prompts = sampler.sample(n_prompts, first_group_id)       # PromptBatch: n prompts, each G times
    rollout = engine.generate(prompts.prompt_ids, sampling, seed)
    batch, rows = RolloutScorer(tokenizer, rewards, group_size, advantage).score(prompts, rollout)

The local sample source runs all three in one process; in async mode the driver samples prompts
and each Ray rollout worker generates and scores. Prompts are tokenized and responses decoded by
vespo.rollout.text, the decoding path evaluation uses too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from vespo.advantages import group_advantages, zero_variance_groups
from vespo.config import AdvantageConfig
from vespo.errors import RewardFnError
from vespo.metrics import rollout_rows
from vespo.models import encode_prompt
from vespo.rollout.text import decode_responses
from vespo.types import Problem, Rollout, TrainBatch

RewardFn = Callable[[list[str], list[Problem]], list[float]]  # (completions, each one's problem) -> rewards


@dataclass(frozen=True)
class PromptBatch:
    problems: list[Problem]  # [n] prompts of this batch
    prompt_ids: list[list[int]]  # [n * G] token ids, each prompt repeated G times
    group_ids: Tensor  # [n * G] int64

    def part(self, index: int, parts: int) -> "PromptBatch":
        """The ``index``-th of ``parts`` equal shares of the prompts, each with its whole group."""
        if parts == 1:
            return self
        n = len(self.problems) // parts
        G = len(self.prompt_ids) // max(len(self.problems), 1)
        rows = slice(index * n * G, (index + 1) * n * G)
        return PromptBatch(self.problems[index * n:(index + 1) * n], self.prompt_ids[rows], self.group_ids[rows])


class PromptSampler:
    """Draws the next problems of the prompt stream and tokenizes them (cached per problem id)."""

    def __init__(self, tokenizer, stream, group_size: int):
        self.tokenizer, self.stream, self.group_size = tokenizer, stream, group_size
        self._encoded: dict[str, list[int]] = {}

    def sample(self, n_prompts: int, first_group_id: int) -> PromptBatch:
        """The next ``n_prompts`` problems of the stream, tokenized, each repeated G times."""
        problems = self.stream.next_batch(n_prompts)
        ids = self.encode_all(problems)
        G = self.group_size
        return PromptBatch(problems=problems, prompt_ids=[x for x in ids for _ in range(G)],
                           group_ids=torch.arange(first_group_id, first_group_id + len(problems)).repeat_interleave(G))

    def encode_all(self, problems: list[Problem]) -> list[list[int]]:
        return [self.encode(p) for p in problems]

    def encode(self, problem: Problem) -> list[int]:
        if problem.id not in self._encoded:
            self._encoded[problem.id] = encode_prompt(self.tokenizer, problem.prompt)
        return self._encoded[problem.id]


class RolloutScorer:
    """Rewards and group advantages of a finished rollout, as a TrainBatch and its rollout rows."""

    def __init__(self, tokenizer, reward_fn: RewardFn, group_size: int, advantage: AdvantageConfig):
        self.tokenizer, self.reward_fn, self.group_size, self.advantage = tokenizer, reward_fn, group_size, advantage

    def score(self, prompts: PromptBatch, rollout: Rollout) -> tuple[TrainBatch, dict[str, Tensor], dict[str, float]]:
        """(batch, rollout rows of every scored response, {"reward/n_failed": ...}); a row whose reward failed
        (NaN, reported by the scorer) is dropped, and with ``advantage.skip_zero_variance`` so are groups of
        equal rewards (after their rows are counted)."""
        completions = decode_responses(self.tokenizer, rollout)
        problems = [p for p in prompts.problems for _ in range(self.group_size)]
        rewards = torch.tensor(self.reward_fn(completions, problems), dtype=torch.float32)  # [B]
        scored = torch.isfinite(rewards)  # [B]
        if not bool(scored.any()):
            raise RewardFnError(f"every reward of a rollout batch of {len(rewards)} failed (NaN); see the warnings "
                                "above for the reward function's errors")
        if not bool(scored.all()):
            rollout, prompts, rewards = _keep_rows(rollout, prompts, rewards, scored)
        adv = group_advantages(rewards, prompts.group_ids, self.advantage.estimator, self.advantage.eps)  # [B]
        flat = zero_variance_groups(rewards, prompts.group_ids)  # [B]
        token_versions = _token_versions(rollout)  # [B, T]
        versions_min, versions_max = row_versions(token_versions, rollout.response_mask, rollout.version)
        batch = TrainBatch(
            prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask, response_ids=rollout.response_ids,
            response_mask=rollout.response_mask.float(), rollout_logp=rollout.logprobs.float(), rewards=rewards,
            advantages=adv, group_ids=prompts.group_ids, versions=versions_min, versions_max=versions_max,
            token_versions=token_versions, truncated=rollout.truncated, routed_experts=rollout.routed_experts,
        )
        rows = rollout_rows(rewards, batch.response_mask, batch.truncated, flat)
        if self.advantage.skip_zero_variance and bool(flat.any()) and not bool(flat.all()):
            batch = batch.select(torch.nonzero(~flat).flatten())
        return batch, rows, {"reward/n_failed": float((~scored).sum())}


def _token_versions(rollout: Rollout) -> Tensor:
    """The version that sampled each response token, 0 on padding (unrecorded: the batch's).  # [B, T]"""
    valid = rollout.response_mask > 0
    recorded = rollout.token_versions
    if recorded is None:
        recorded = torch.full_like(rollout.response_ids, rollout.version)
    return torch.where(valid, recorded.long(), 0)


def row_versions(token_versions: Tensor, response_mask: Tensor, empty: int) -> tuple[Tensor, Tensor]:
    """The oldest and newest version over each row's valid tokens (``empty`` for a row without any).  # [B], [B]"""
    big = torch.iinfo(torch.int64).max
    valid = response_mask > 0
    v_min = torch.where(valid, token_versions, big).amin(dim=1)
    v_max = torch.where(valid, token_versions, -1).amax(dim=1)
    return torch.where(valid.any(1), v_min, empty), torch.where(valid.any(1), v_max, empty)


def _keep_rows(rollout: Rollout, prompts: PromptBatch, rewards: Tensor, keep: Tensor):
    idx = torch.nonzero(keep).flatten()
    fields = {k: (v[idx] if isinstance(v, Tensor) else v) for k, v in vars(rollout).items()}
    kept = replace(prompts, prompt_ids=[prompts.prompt_ids[i] for i in idx.tolist()], group_ids=prompts.group_ids[idx])
    return Rollout(**fields), kept, rewards[idx]
