"""Problems in, completions out: the one decoding path of training, warm start and evaluation.

    ids = encode_problems(tokenizer, problems)          # [[int]] prompt token ids, chat template applied
    texts = decode_responses(tokenizer, rollout)         # the sampled responses as text, EOS and padding cut
    generate = TextGenerator(engine, tokenizer)
    completions = generate(problems, n=4, sampling=params, seed=0)   # n completions per problem

Everything that turns a prompt into text samples (the rollout producer, the held-out evaluation,
the warm start's accuracy probe, `vespo eval`) goes through these functions, so they tokenize and
cut responses the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import replace
from typing import Any

from vespo.models.loading import encode_prompt
from vespo.rollout.base import SamplingParams
from vespo.types import Problem, Rollout


def encode_problems(tokenizer: Any, problems: list[Problem]) -> list[list[int]]:
    """Token ids of each problem's prompt (chat messages through the tokenizer's template)."""
    return [encode_prompt(tokenizer, p.prompt) for p in problems]


def decode_responses(tokenizer: Any, rollout: Rollout) -> list[str]:
    """Each response as text: the tokens under its mask, special tokens (EOS) skipped."""
    out = []
    for ids, mask in zip(rollout.response_ids.tolist(), rollout.response_mask.tolist()):
        out.append(tokenizer.decode([t for t, m in zip(ids, mask) if m > 0], skip_special_tokens=True))
    return out


def greedy(sampling: SamplingParams) -> SamplingParams:
    """The same settings with greedy decoding (top_k = 1)."""
    return replace(sampling, top_k=1, top_p=1.0)


class TextGenerator:
    """``(problems, n, sampling, seed) -> n completions per problem`` with a rollout engine.

    Rows are generated ``batch_size`` at a time (0: all at once); batch b is seeded ``seed + b``,
    so the same call gives the same completions. ``on_batch(done, total)``, when given, hears of each
    batch's rows (a command's progress line).
    """

    def __init__(self, engine: Any, tokenizer: Any, batch_size: int = 0,
                 on_batch: Callable[[int, int], None] | None = None):
        self.engine, self.tokenizer, self.batch_size, self.on_batch = engine, tokenizer, batch_size, on_batch

    def __call__(self, problems: list[Problem], n: int, sampling: SamplingParams, seed: int) -> list[list[str]]:
        ids = [x for x in encode_problems(self.tokenizer, problems) for _ in range(n)]
        size = self.batch_size or max(len(ids), 1)
        texts: list[str] = []
        for b, start in enumerate(range(0, len(ids), size)):
            rollout = self.engine.generate(ids[start : start + size], sampling, seed=seed + b)
            texts += decode_responses(self.tokenizer, rollout)
            if self.on_batch is not None:
                self.on_batch(len(texts), len(ids))
        return [texts[i * n : (i + 1) * n] for i in range(len(problems))]
