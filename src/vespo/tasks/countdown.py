"""Countdown: reach a target from given numbers with + - * / and parentheses.

Prompt "3 5 8 1>24:", completion e.g. "3*8*1". Any expression that uses each given number at
most once and evaluates exactly (rational arithmetic) to the target scores 1.0. Completions are
parsed by a small recursive-descent parser over digits, + - * / ( ) and spaces; nothing is
ever passed to `eval`.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction
from typing import Any

from vespo.tasks.base import Task, check_int_range, normalize_answer
from vespo.types import Problem

MAX_EXPRESSION_CHARS = 256  # longer completions score 0.0 without being parsed
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


class ExpressionError(ValueError):
    """A completion that is not a well-formed arithmetic expression, or divides by zero."""


def _tokenize(text: str) -> list[str]:
    tokens, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in "+-*/()":
            tokens.append(ch)
            i += 1
        elif ch in "0123456789":
            j = i
            while j < len(text) and text[j] in "0123456789":
                j += 1
            tokens.append(text[i:j])
            i = j
        else:
            raise ExpressionError(f"unexpected character {ch!r}")
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ;
    factor := NUMBER | '(' expr ')'"""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.numbers = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ExpressionError("unexpected end of expression")
        self.pos += 1
        return tok

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            value = value + self.term(depth) if self.take() == "+" else value - self.term(depth)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.factor(depth)
            if op == "/" and rhs == 0:
                raise ExpressionError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > 32:
            raise ExpressionError("parentheses nested too deeply")
        tok = self.take()
        if tok == "(":
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExpressionError("missing ')'")
            return value
        if not tok.isdigit():
            raise ExpressionError(f"expected a number, got {tok!r}")
        self.numbers.append(int(tok))
        return Fraction(int(tok))


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """The exact value of an arithmetic expression and the numbers it uses, in order.
    Raises ExpressionError on anything malformed (unary minus included)."""
    parser = _Parser(_tokenize(text))
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after the expression")
    return value, parser.numbers


def _check_ground_truth(ground_truth: Any) -> tuple[list[int], int]:
    if not isinstance(ground_truth, dict) or "numbers" not in ground_truth or "target" not in ground_truth:
        raise ValueError(f"countdown ground_truth must be a dict with 'numbers' and 'target', got {ground_truth!r}")
    return [int(x) for x in ground_truth["numbers"]], int(ground_truth["target"])


def _format(op: str, left: tuple[str, int], right: tuple[str, int]) -> tuple[str, int]:
    """Join two (text, precedence) operands with the fewest parentheses that keep the value."""
    prec = _PRECEDENCE[op]
    ltext = left[0] if left[1] >= prec else f"({left[0]})"
    right_needs = right[1] < prec or (right[1] == prec and op in "-/")
    rtext = f"({right[0]})" if right_needs else right[0]
    return f"{ltext}{op}{rtext}", prec


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    if op == "/":
        return None if b == 0 else a / b
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def solve(numbers: list[int], target: int) -> str | None:
    """An expression reaching `target` from a sub-multiset of `numbers`, or None (brute force;
    meant for the 2..5 numbers of this task)."""
    items = [(Fraction(x), (str(x), 3)) for x in numbers]
    return _search(items, Fraction(target))


def _search(items: list, target: Fraction) -> str | None:
    for value, (text, _) in items:
        if value == target:
            return text
    for i in range(len(items)):
        for j in range(len(items)):
            if i == j:
                continue
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            for op in "+-*/":
                if op in "+*" and i > j:
                    continue  # commutative: one order is enough
                value = _apply(op, items[i][0], items[j][0])
                if value is not None:
                    found = _search(rest + [(value, _format(op, items[i][1], items[j][1]))], target)
                    if found is not None:
                        return found
    return None


class CountdownTask(Task):
    """`num_numbers` numbers in [1, max_number]; the target is the value of a random expression
    over all of them, kept when it is an integer in [1, max_target]."""

    name = "countdown"

    def __init__(self, num_numbers: int = 4, max_number: int = 10, max_target: int = 100):
        self.num_numbers = check_int_range("num_numbers", num_numbers, 2, 5)
        self.max_number = check_int_range("max_number", max_number, 1, 99)
        self.max_target = check_int_range("max_target", max_target, 1, 9999)

    @property
    def max_answer_chars(self) -> int:
        n = self.num_numbers
        return n * len(str(self.max_number)) + (n - 1) + 2 * max(n - 2, 0)

    def _random_expression(self, rng: random.Random, numbers: list[int]) -> tuple[Fraction, str]:
        items = [(Fraction(x), (str(x), 3)) for x in numbers]
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            op = rng.choice("+-*/")
            value = _apply(op, items[i][0], items[j][0])
            if value is None:
                continue
            merged = (value, _format(op, items[i][1], items[j][1]))
            items = [items[k] for k in range(len(items)) if k not in (i, j)] + [merged]
        return items[0][0], items[0][1][0]

    def make_problem(self, rng: random.Random) -> tuple[str, dict[str, Any], dict[str, Any]]:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            value, solution = self._random_expression(rng, numbers)
            if value.denominator == 1 and 1 <= value <= self.max_target:
                break
        target = int(value)
        prompt = " ".join(map(str, numbers)) + f">{target}:"
        return prompt, {"numbers": numbers, "target": target}, {"solution": solution}

    def reward(self, completion: str, ground_truth: Any) -> float:
        """1.0 iff the completion (surrounding whitespace stripped; spaces inside allowed) is an
        expression of integers, + - * / and parentheses that uses each given number at most once
        (as a multiset) and equals the target exactly. Malformed text, unary minus, division by
        zero or anything over MAX_EXPRESSION_CHARS characters scores 0.0."""
        numbers, target = _check_ground_truth(ground_truth)
        text = normalize_answer(completion)
        if not text or len(text) > MAX_EXPRESSION_CHARS:
            return 0.0
        try:
            value, used = evaluate_expression(text)
        except ExpressionError:
            return 0.0
        if Counter(used) - Counter(numbers):  # a number used that was not given (or too often)
            return 0.0
        return 1.0 if value == target else 0.0

    def reference_completion(self, problem: Problem) -> str:
        solution = problem.extra_info.get("solution")
        if solution is None:
            numbers, target = _check_ground_truth(problem.ground_truth)
            solution = solve(numbers, target)
            if solution is None:
                raise ValueError(f"problem {problem.id!r}: no expression reaches {target} from {numbers}")
        return solution
