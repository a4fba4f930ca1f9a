"""String tasks of a different shape than arithmetic: `reverse`, `reverse_long` and `sort`.

    reverse   "r:abcde="  -> "edcba"   letters (or digits), length `length`..`max_length`
    sort      "s:31412="  -> "11234"   digits sorted ascending, length `length`
    reverse_long                        reverse with 16..32 characters: the lab's long-answer task
"""

from __future__ import annotations

import random
from typing import Any

from vespo.charset import DIGITS, LETTERS
from vespo.tasks.base import Task, check_int_range, normalize_answer
from vespo.types import Problem

ALPHABETS = {"letters": LETTERS, "digits": DIGITS}


def exact_match_reward(completion: str, ground_truth: Any) -> float:
    """1.0 iff the completion stripped of surrounding whitespace equals the ground truth."""
    return 1.0 if normalize_answer(completion) == str(ground_truth) else 0.0


class ReverseTask(Task):
    """Reverse a random string whose length is drawn uniformly from [length, max_length]."""

    name = "reverse"

    def __init__(self, length: int = 5, max_length: int | None = None, alphabet: str = "letters"):
        self.length = check_int_range("length", length, 1, 64)
        hi = length if max_length is None else max_length
        self.max_length = check_int_range("max_length", hi, self.length, 64)
        if alphabet not in ALPHABETS:
            raise ValueError(f"alphabet must be one of {sorted(ALPHABETS)}, got {alphabet!r}")
        self.alphabet = alphabet

    @property
    def max_answer_chars(self) -> int:
        return self.max_length

    def make_problem(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        size = rng.randint(self.length, self.max_length)
        text = "".join(rng.choice(ALPHABETS[self.alphabet]) for _ in range(size))
        return f"r:{text}=", text[::-1], {"text": text}

    def reward(self, completion: str, ground_truth: Any) -> float:
        """1.0 iff the completion stripped of surrounding whitespace is the reversed string
        (case-sensitive; no other normalization)."""
        return exact_match_reward(completion, ground_truth)

    def reference_completion(self, problem: Problem) -> str:
        return str(problem.ground_truth)


class ReverseLongTask(ReverseTask):
    """Reverse with 16..32 characters, so correct answers are 16..32 characters long."""

    name = "reverse_long"

    def __init__(self, length: int = 16, max_length: int | None = 32, alphabet: str = "letters"):
        super().__init__(length, max_length, alphabet)
        if self.length < 16:
            raise ValueError(f"length must be an integer in [16, 64] for reverse_long, got {length!r}")


class SortTask(Task):
    """Sort `length` random digits ascending."""

    name = "sort"

    def __init__(self, length: int = 5):
        self.length = check_int_range("length", length, 1, 64)

    @property
    def max_answer_chars(self) -> int:
        return self.length

    def make_problem(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        text = "".join(rng.choice(DIGITS) for _ in range(self.length))
        return f"s:{text}=", "".join(sorted(text)), {"text": text}

    def reward(self, completion: str, ground_truth: Any) -> float:
        """1.0 iff the completion stripped of surrounding whitespace is the sorted digit string."""
        return exact_match_reward(completion, ground_truth)

    def reference_completion(self, problem: Problem) -> str:
        return str(problem.ground_truth)
