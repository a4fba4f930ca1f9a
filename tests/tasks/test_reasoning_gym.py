"""reasoning-gym tasks: the registry, prompts, held-out problems disjoint from training, the reward on
hand-worked completions, and the verl-style parquet round trip."""

from __future__ import annotations

import pytest

from vespo.data import load_problems
from vespo.tasks import ReasoningGymTask, get_task
from vespo.tasks.reasoning_gym import INSTRUCTION, compute_score, final_answer, write_verl_parquet

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # a space of a few hundred sums


def test_any_dataset_by_name_with_its_options():
    task = get_task("rg:chain_sum", **SMALL)
    assert isinstance(task, ReasoningGymTask) and task.name == "rg:chain_sum"
    problem = task.generate(1, seed=0)[0]
    assert problem.data_source == "rg:chain_sum"
    assert problem.prompt[0]["role"] == "user" and problem.prompt[0]["content"].endswith("\n\n" + INSTRUCTION)
    assert problem.prompt[0]["content"].startswith(problem.extra_info["question"].rstrip())
    assert get_task("rg:chain_sum", chat=False).generate(1, seed=0)[0].prompt.endswith(INSTRUCTION)


def test_unknown_dataset_and_bad_options_say_what_is_valid():
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'chain_sumx'; choose one of: .*chain_sum"):
        get_task("rg:chain_sumx")
    with pytest.raises(ValueError, match="'chain_sum' rejects its options .*unexpected keyword argument 'foo'"):
        get_task("rg:chain_sum", foo=1)
    with pytest.raises(ValueError, match="rejects its options .*min_terms must be positive"):
        get_task("rg:chain_sum", min_terms=0)


def test_generation_is_deterministic_and_held_out_problems_are_disjoint():
    task = get_task("rg:chain_sum", **SMALL)
    train = task.generate(150, seed=3)
    assert train == task.generate(150, seed=3) and task.generate(10, seed=3) == train[:10]
    held_out = task.held_out(40, seed=4, train=train)
    seen = {p.extra_info["question"] for p in train}
    assert len(held_out) == 40 and not any(p.extra_info["question"] in seen for p in held_out)
    # independent draws of this small space do overlap, so the filter is doing work
    assert any(p.extra_info["question"] in seen for p in task.generate(40, seed=4))
    with pytest.raises(ValueError, match="too few distinct problems"):
        task.held_out(500, seed=4, train=task.generate(2000, seed=3))


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("\\boxed{57}", 1.0),  # the dataset's verifier on the boxed answer
        ("43 + 14 = 57, so the answer is \\boxed{57}.", 1.0),
        ("\\boxed{57.0}", 1.0),  # reasoning-gym gives 0.5 for "57.0"; as decimals they are equal
        ("43 + 14 = 57", 1.0),  # no box: the last number of the text
        ("The answer is 57.", 1.0),
        ("\\boxed{58}", 0.0),
        ("\\boxed{57} ... no, \\boxed{56}", 0.0),  # the last box counts
        ("57 is close, but 43 + 14 = 60", 0.0),
        ("", 0.0),
        # restating the question is not an answer (math-verify evaluated these to 57 and paid 1)
        ("43 + 14 =", 0.0),
        ("To solve it, add the numbers directly:\n\n43 + 14", 0.0),
        ("\\boxed{43 + 14}", 0.0),
        ("\\boxed{43+14}", 0.0),
    ],
)
def test_numeric_reward_hand_worked(completion, reward):
    task = get_task("rg:chain_sum")
    assert task.reward(completion, {"answer": "57", "metadata": {}}) == reward


def test_reward_uses_the_datasets_verifier_with_its_metadata():
    # countdown's verifier evaluates the expression against the numbers and target in the metadata
    task = get_task("rg:countdown")
    truth = {"answer": "94*4 - 61 - 6", "metadata": {"numbers": [6, 61, 94, 4], "target": 309}}
    assert task.reward("\\boxed{94*4 - 61 - 6}", truth) == 1.0
    assert task.reward("\\boxed{4*94 - 6 - 61}", truth) == 1.0  # another correct expression
    assert task.reward("\\boxed{94*4 - 61}", truth) == 0.0  # 315: reasoning-gym gives partial credit, 0/1 here
    assert get_task("rg:countdown", partial_credit=True).reward("\\boxed{94*4 - 61}", truth) > 0.0
    problem = task.generate(1, seed=0)[0]
    assert task.reward(task.reference_completion(problem), problem.ground_truth) == 1.0


def test_final_answer_takes_the_last_complete_box():
    assert final_answer("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert final_answer("  no box here ") == "no box here"
    assert final_answer("\\boxed{unbalanced") == "\\boxed{unbalanced"


def test_verl_parquet_round_trip_scores_the_same(tmp_path):
    task = get_task("rg:countdown")
    problems = task.generate(5, seed=1)
    path = write_verl_parquet(task, problems, tmp_path / "train.parquet", "train")
    loaded = load_problems(path)
    assert [p.prompt for p in loaded] == [p.prompt for p in problems]
    assert [p.ground_truth for p in loaded] == [p.ground_truth["answer"] for p in problems]
    assert [p.id for p in loaded] == [p.id for p in problems]
    for original, row in zip(problems, loaded):
        good = task.reference_completion(original)
        assert compute_score(row.data_source, good, row.ground_truth, row.extra_info) == 1.0
        assert compute_score(row.data_source, "\\boxed{1+1}", row.ground_truth, row.extra_info) == 0.0
    with pytest.raises(ValueError, match="no extra_info\\['reasoning_gym'\\]"):
        compute_score("x", "1", "1", {})
