"""Multi-digit arithmetic: `addition`, `subtraction`, `multiplication`.

Prompt "12+34=", completion "46". Difficulty `digits` (1..9) is the number of digits of each
operand. Subtraction orders its operands so the answer is never negative.
"""

from __future__ import annotations

import random
from typing import Any

from vespo.tasks.base import Task, check_int_range, normalize_answer
from vespo.types import Problem


class ArithmeticTask(Task):
    """Two `digits`-digit operands and one operator; the answer is the exact integer result."""

    op: str = "+"

    def __init__(self, digits: int = 2):
        self.digits = check_int_range("digits", digits, 1, 9)

    @property
    def max_answer_chars(self) -> int:
        return {"+": self.digits + 1, "-": self.digits, "*": 2 * self.digits}[self.op]

    def _operand(self, rng: random.Random) -> int:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return rng.randint(low, 10**self.digits - 1)

    def make_problem(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        a, b = self._operand(rng), self._operand(rng)
        if self.op == "-" and a < b:
            a, b = b, a
        result = {"+": a + b, "-": a - b, "*": a * b}[self.op]
        return f"{a}{self.op}{b}=", str(result), {"a": a, "b": b}

    def reward(self, completion: str, ground_truth: Any) -> float:
        """1.0 iff the completion, stripped of surrounding whitespace, is exactly the decimal
        ground truth ("46"; "046", "46.0" and "+46" score 0.0)."""
        return 1.0 if normalize_answer(completion) == str(ground_truth) else 0.0

    def reference_completion(self, problem: Problem) -> str:
        return str(problem.ground_truth)


class AdditionTask(ArithmeticTask):
    name = "addition"
    op = "+"


class SubtractionTask(ArithmeticTask):
    name = "subtraction"
    op = "-"


class MultiplicationTask(ArithmeticTask):
    name = "multiplication"
    op = "*"
