"""RewardScorer and load_reward_fn: failures are reported, never turned into silent rewards;
the time limit really stops a hanging reward function."""

from __future__ import annotations

import math
import sys
import textwrap
import time

import pytest

from vespo.rewards import RewardError, RewardScorer, load_reward_fn, math_verify_reward
from vespo.tasks import get_task

USER_REWARDS = textwrap.dedent(
    """
    import math, os, time

    def exact(completion, ground_truth):
        return 1.0 if completion.strip() == str(ground_truth) else 0.0

    def hang_on_loop(completion, ground_truth):
        if completion == "loop":
            time.sleep(1000)
        return exact(completion, ground_truth)

    def raise_on_bad(completion, ground_truth):
        if completion == "bad":
            raise KeyError("no answer")
        return exact(completion, ground_truth)

    def odd_values(completion, ground_truth):
        return {"nan": math.nan, "inf": math.inf, "text": "yes", "none": None}.get(completion, 1.0)

    def die_on_exit(completion, ground_truth):
        if completion == "exit":
            os._exit(3)
        return exact(completion, ground_truth)

    def sleep_then_exact(completion, ground_truth):
        time.sleep(1.5)
        return exact(completion, ground_truth)

    def always_raise(completion, ground_truth):
        raise RuntimeError("boom")

    def raise_on_long(completion, ground_truth):
        if len(completion) > 100:
            raise RuntimeError("boom")
        return exact(completion, ground_truth)

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A reward module the test writes to tmp_path and puts on sys.path (workers inherit it)."""
    (tmp_path / "user_rewards_for_test.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards_for_test"
    sys.modules.pop("user_rewards_for_test", None)


def test_load_reward_fn_by_import_path(user_module):
    fn = load_reward_fn(f"{user_module}:exact")
    assert fn(" 12 ", 12) == 1.0 and fn("13", 12) == 0.0
    assert load_reward_fn("vespo.rewards.math:math_verify_reward")(r"\boxed{1/2}", "0.5") == 1.0


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_colon_here", "must look like 'package.module:function'"),
        ("module_that_does_not_exist_xyz:f", "cannot import module 'module_that_does_not_exist_xyz'"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:NOT_CALLABLE", "is a int, not a callable"),
    ],
)
def test_load_reward_fn_errors_name_the_problem(user_module, path, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(path.format(mod=user_module))


def test_in_process_fast_path_scores_a_task_reward():
    task = get_task("addition", digits=2)
    problems = task.generate(6, seed=0)
    completions = [task.reference_completion(p) if i % 2 == 0 else "0" for i, p in enumerate(problems)]
    result = RewardScorer(task.reward, num_workers=0).score(completions, [p.ground_truth for p in problems])
    assert result.rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0] and result.errors == []


def test_exceptions_and_non_numbers_are_reported_with_the_sample(user_module):
    scorer = RewardScorer(load_reward_fn(f"{user_module}:odd_values"), num_workers=0)
    result = scorer.score(["ok", "nan", "inf", "text", "none", "ok"], [None] * 6)
    assert result.rewards[0] == 1.0 and result.rewards[5] == 1.0
    assert all(math.isnan(r) for r in result.rewards[1:5])
    assert result.valid == [True, False, False, False, False, True]
    assert [(e.index, e.kind) for e in result.errors] == [
        (1, "non_finite"), (2, "non_finite"), (3, "non_numeric"), (4, "non_numeric")]
    assert result.errors[2].completion_excerpt == "'text'"

    raising = RewardScorer(load_reward_fn(f"{user_module}:raise_on_bad"), num_workers=0)
    result = raising.score(["1", "bad"], ["1", "1"])
    assert result.rewards[0] == 1.0 and math.isnan(result.rewards[1])
    assert result.errors[0].kind == "exception" and "KeyError" in result.errors[0].message


def test_max_errors_raises_with_the_offending_samples(user_module):
    scorer = RewardScorer(load_reward_fn(f"{user_module}:raise_on_bad"), num_workers=0, max_errors=1)
    assert len(scorer.score(["bad", "1"], ["1", "1"]).errors) == 1  # one error is allowed
    with pytest.raises(RewardError, match=r"(?s)2 of 3 samples failed.*sample 0 \(exception\).*'bad'"):
        scorer.score(["bad", "1", "bad"], ["1", "1", "1"])


def test_long_completions_are_excerpted(user_module):
    scorer = RewardScorer(load_reward_fn(f"{user_module}:raise_on_long"), num_workers=0)
    result = scorer.score(["x" * 500, "0"], [0, 0])
    assert result.errors[0].completion_excerpt == repr("x" * 80 + "...")
    assert result.errors[0].message == "RuntimeError: boom"


def test_bad_scorer_arguments():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardScorer(math_verify_reward, timeout_s=0)
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0"):
        RewardScorer(math_verify_reward, num_workers=-1)
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        RewardScorer(lambda c, t: 1.0, num_workers=1)
    with pytest.raises(ValueError, match="completions has 2 items but ground_truths has 1"):
        RewardScorer(math_verify_reward, num_workers=0).score(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="completions has 2 items but data_sources has 3"):
        RewardScorer(math_verify_reward, num_workers=0).score(["a", "b"], ["1", "2"], ["s"] * 3)


def test_timeout_kills_a_hanging_reward_and_keeps_scoring(user_module):
    fn = load_reward_fn(f"{user_module}:hang_on_loop")
    with RewardScorer(fn, timeout_s=1.0, num_workers=2) as scorer:
        scorer.score(["warm"], ["warm"])  # workers started and ready
        hung_pids = {w.process.pid for w in scorer._workers}
        start = time.monotonic()
        result = scorer.score(["1", "loop", "2", "3", "loop", "4"], ["1", "1", "2", "9", "1", "4"])
        elapsed = time.monotonic() - start
        assert elapsed < 30.0  # the sleeper would run 1000 s
        assert result.rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]  # timeouts score 0.0
        assert [(e.index, e.kind) for e in result.errors] == [(1, "timeout"), (4, "timeout")]
        assert scorer.num_timeouts == 2
        assert len(scorer._workers) == 2 and all(w.process.is_alive() for w in scorer._workers)
        assert {w.process.pid for w in scorer._workers} != hung_pids  # killed ones were replaced
        assert scorer.score(["5"], ["5"]).rewards == [1.0]  # the replacements work


def test_workers_score_in_parallel(user_module):
    with RewardScorer(load_reward_fn(f"{user_module}:sleep_then_exact"), timeout_s=20.0, num_workers=2) as scorer:
        scorer.score(["warm", "warm"], ["warm", "warm"])  # both workers started
        start = time.monotonic()
        assert scorer.score(["1", "2"], ["1", "3"]).rewards == [1.0, 0.0]
        assert time.monotonic() - start < 2.9  # two 1.5 s calls side by side, not 3.0 s in a row


def test_a_dying_worker_is_reported_and_replaced(user_module):
    with RewardScorer(load_reward_fn(f"{user_module}:die_on_exit"), timeout_s=20.0, num_workers=1) as scorer:
        result = scorer.score(["1", "exit", "2"], ["1", "1", "2"])
        assert result.rewards[0] == 1.0 and math.isnan(result.rewards[1]) and result.rewards[2] == 1.0
        assert result.errors[0].kind == "crash" and "exit code 3" in result.errors[0].message


def test_math_verify_in_workers_matches_in_process():
    completions = [r"\boxed{0.5}", r"\boxed{2}", r"the answer: \boxed{\frac{2}{4}}", "none"]
    truths = ["1/2", "3", "0.5", "1"]
    expected = [math_verify_reward(c, t) for c, t in zip(completions, truths)]
    assert expected == [1.0, 0.0, 1.0, 0.0]
    with RewardScorer(math_verify_reward, timeout_s=20.0, num_workers=2) as scorer:
        result = scorer.score(completions, truths)
    assert result.rewards == expected and result.errors == []
