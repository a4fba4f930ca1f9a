"""The verifiable-task protocol every built-in task implements, and helpers they share.

A task generates `Problem`s deterministically from a seed, scores a completion with an exact
`str -> float` reward, and writes a correct completion for the supervised warm start. Every
prompt and answer a built-in task writes uses only `vespo.charset.CHARSET`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any

from vespo.charset import unsupported_chars
from vespo.types import Problem

HELD_OUT_SEED_OFFSET = 1_000_003  # a run's held-out problems are drawn with run.seed + this


class Task(ABC):
    """A family of generated problems with an exact reward."""

    name: str = "task"

    @property
    @abstractmethod
    def max_answer_chars(self) -> int:
        """An upper bound on the length of a correct completion (sizes max_new_tokens)."""

    @property
    def max_new_tokens(self) -> int:
        """The response cap that fits every correct completion: the longest answer and its EOS."""
        return self.max_answer_chars + 1

    @abstractmethod
    def make_problem(self, rng: random.Random) -> tuple[str, Any, dict[str, Any]]:
        """One random (prompt, ground_truth, extra_info) drawn from `rng`."""

    @abstractmethod
    def reward(self, completion: str, ground_truth: Any) -> float:
        """1.0 if `completion` is a correct answer to the problem with `ground_truth`, else 0.0."""

    @abstractmethod
    def reference_completion(self, problem: Problem) -> str:
        """A completion that `reward` scores 1.0."""

    def generate(self, n: int, seed: int) -> list[Problem]:
        """`n` problems; the same (n, seed) always gives the same list, and a longer list
        with the same seed starts with the shorter one."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        rng = random.Random(f"{self.name}:{seed}")
        problems = []
        for i in range(n):
            prompt, truth, extra = self.make_problem(rng)
            problems.append(
                Problem(id=f"{self.name}-{seed}-{i}", prompt=prompt, ground_truth=truth,
                        data_source=self.name, extra_info=extra)
            )
        return problems

    def held_out(self, n: int, seed: int, train: list[Problem]) -> list[Problem]:
        """``n`` held-out problems drawn with ``seed``. Built-in tasks draw them independently of ``train``
        (their small problem spaces overlap it); a task whose space is large keeps them disjoint."""
        return self.generate(n, seed)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def check_int_range(field: str, value: Any, low: int, high: int) -> int:
    """`value` if it is an int in [low, high]; otherwise a ValueError naming the field and range."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{field} must be an integer in [{low}, {high}], got {value!r}")
    return value


def check_charset(text: str, what: str) -> str:
    """`text` unchanged, or a ValueError if it holds characters outside the built-in charset."""
    bad = unsupported_chars(text)
    if bad:
        raise ValueError(f"{what} {text!r} uses characters outside vespo.charset.CHARSET: {sorted(bad)}")
    return text


def normalize_answer(completion: str) -> str:
    """The answer part of a completion: surrounding whitespace stripped, nothing else changed."""
    return completion.strip()
