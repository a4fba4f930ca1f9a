"""math_verify_reward: equivalent answers score 1.0, wrong ones and parse errors 0.0."""

from __future__ import annotations

import pytest

from vespo.rewards import math_verify_reward
from vespo.rewards.math import final_answer_text, last_boxed


@pytest.mark.parametrize(
    "completion, truth",
    [
        (r"\boxed{0.5}", "1/2"),  # decimal vs fraction
        (r"The answer is \boxed{\frac{1}{2}}.", "0.5"),  # LaTeX fraction vs decimal
        (r"so \boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        (r"x = 3, hence \boxed{4}", "4"),  # the boxed answer wins over other numbers
        (r"\boxed{4} no, wait: \boxed{5}", "5"),  # the LAST boxed answer is final
        (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}"),
        (r"\boxed{x^2+2x+1}", "(x+1)^2"),
        (r"\boxed{3}", 3),  # a non-string ground truth is compared as text
        (r"\boxed{3}", r"\boxed{3}"),  # an already boxed ground truth
        ("I think it is 42", "42"),  # no box: the last expression
    ],
)
def test_equivalent_answers_score_one(completion, truth):
    assert math_verify_reward(completion, truth) == 1.0


@pytest.mark.parametrize(
    "completion, truth",
    [
        (r"\boxed{0.33}", "1/3"),  # not equal to 6 decimals
        (r"\boxed{4} no, wait: \boxed{5}", "4"),  # an earlier box is not the final answer
        (r"\boxed{2}", "3"),
        ("", "3"),
        (r"\boxed{", "3"),  # unbalanced box, nothing else: parse fails
        (r"\boxed{\frac{1}{0}}", "1"),
        ("no numbers here", "3"),
    ],
)
def test_wrong_or_unparseable_answers_score_zero(completion, truth):
    assert math_verify_reward(completion, truth) == 0.0


def test_last_boxed_balances_braces():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b") == r"\boxed{\frac{1}{2}}"
    assert last_boxed(r"\boxed{1} and \boxed{2") is None
    assert last_boxed("plain") is None
    assert final_answer_text("plain 7") == "plain 7"


def test_rewards_are_exactly_zero_or_one():
    values = {math_verify_reward(c, t) for c, t in [(r"\boxed{1}", "1"), (r"\boxed{2}", "1"), ("?", "1")]}
    assert values == {0.0, 1.0}
