"""Built-in tasks: registry errors, determinism, charset, and each reward on correct, wrong and
malformed answers."""

from __future__ import annotations

import pytest

from vespo.charset import unsupported_chars
from vespo.tasks import get_task, task_names
from vespo.types import Problem

ALL_TASKS = task_names()


def test_registry_lists_every_family():
    for name in ("addition", "subtraction", "multiplication", "reverse", "sort", "reverse_long"):
        assert name in ALL_TASKS


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="unknown task 'additon'; choose one of: addition, multiplication"):
        get_task("additon")


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("addition", {"digits": 0}, r"digits must be an integer in \[1, 9\], got 0"),
        ("addition", {"digits": 2.5}, r"digits must be an integer in \[1, 9\]"),
        ("addition", {"size": 3}, r"no option 'size'; its options are: digits"),
        ("reverse", {"length": 5, "max_length": 3}, r"max_length must be an integer in \[5, 64\]"),
        ("reverse", {"alphabet": "greek"}, r"alphabet must be one of"),
        ("reverse_long", {"length": 4}, r"length must be an integer in \[16, 64\]"),
        ("sort", {"length": 100}, r"length must be an integer in \[1, 64\]"),
    ],
)
def test_bad_options_name_the_field_and_range(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_task(name, **kwargs)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_generation_is_deterministic_by_seed(name):
    task = get_task(name)
    a, b, c = task.generate(20, seed=7), task.generate(20, seed=7), task.generate(20, seed=8)
    assert a == b
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert task.generate(5, seed=7) == a[:5]
    assert len({p.id for p in a}) == 20 and all(p.data_source == name for p in a)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_prompts_and_answers_use_only_the_charset(name):
    task = get_task(name)
    for problem in task.generate(200, seed=3):
        reference = task.reference_completion(problem)
        assert not unsupported_chars(problem.prompt), problem.prompt
        assert not unsupported_chars(reference), reference
        assert isinstance(problem.prompt, str) and len(problem.prompt) <= 40


@pytest.mark.parametrize("name", ALL_TASKS)
def test_reference_completion_scores_one_and_fits_max_answer_chars(name):
    task = get_task(name)
    for problem in task.generate(200, seed=11):
        reference = task.reference_completion(problem)
        assert task.reward(reference, problem.ground_truth) == 1.0
        assert task.reward(f"  {reference}\n", problem.ground_truth) == 1.0  # surrounding whitespace
        assert 1 <= len(reference) <= task.max_answer_chars


@pytest.mark.parametrize("name", ALL_TASKS)
def test_empty_and_garbage_completions_score_zero(name):
    task = get_task(name)
    problem = task.generate(1, seed=0)[0]
    for bad in ("", "   ", "?!#", "((((", "<eos>"):
        assert task.reward(bad, problem.ground_truth) == 0.0


@pytest.mark.parametrize(
    "name, prompt, truth, right, wrong",
    [
        ("addition", "12+34=", "46", "46", ["47", "046", "46.0", "+46", "4 6", "46 46"]),
        ("subtraction", "34-12=", "22", "22", ["-22", "21", "22x"]),
        ("multiplication", "12*34=", "408", "408", ["480", "12*34"]),
        ("reverse", "r:abcde=", "edcba", "edcba", ["abcde", "EDCBA", "edcb", "e d c b a"]),
        ("sort", "s:31412=", "11234", "11234", ["43211", "1234", "11 234"]),
    ],
)
def test_exact_match_rewards_by_hand(name, prompt, truth, right, wrong):
    task = get_task(name)
    assert task.reward(right, truth) == 1.0
    for answer in wrong:
        assert task.reward(answer, truth) == 0.0, answer


def test_arithmetic_ground_truth_is_the_true_result():
    for name, op in (("addition", int.__add__), ("subtraction", int.__sub__), ("multiplication", int.__mul__)):
        task = get_task(name, digits=3)
        for p in task.generate(50, seed=1):
            a, b = p.extra_info["a"], p.extra_info["b"]
            assert p.ground_truth == str(op(a, b)) and int(p.ground_truth) >= 0
            assert 100 <= a <= 999 and 100 <= b <= 999


def test_reverse_long_answers_are_16_to_32_characters():
    task = get_task("reverse_long")
    lengths = {len(p.ground_truth) for p in task.generate(300, seed=0)}
    assert min(lengths) >= 16 and max(lengths) <= 32 and len(lengths) > 10


def test_generate_rejects_negative_n():
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        get_task("sort").generate(-1, seed=0)
