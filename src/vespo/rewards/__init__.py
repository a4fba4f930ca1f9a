"""Rewards: the math-verify reward, a batched scorer with time limits, and user rewards by import path.

    from vespo.rewards import math_verify_reward, RewardScorer, load_reward_fn
    fn = load_reward_fn("my_package.rewards:exact")      # (completion, ground_truth) -> float
    fn = load_reward_fn("my_verl_rewards:compute_score") # or verl's (data_source, solution_str, ground_truth, ...)
    with RewardScorer(fn, timeout_s=5.0, num_workers=2) as scorer:
        result = scorer.score(completions, ground_truths)  # ScoreResult(rewards, errors)
        result = scorer.score_problems(completions, problems)  # with each Problem's data_source and extra_info
"""

from __future__ import annotations

import importlib
from typing import Any

from vespo.errors import RewardFnError
from vespo.rewards.scorer import (
    SIGNATURES,
    RewardError,
    RewardFn,
    RewardScorer,
    RewardsFailedError,
    ScoreError,
    ScoreResult,
    reward_call,
)


def __getattr__(name: str) -> Any:
    """`math_verify_reward` is imported on first use: math-verify takes about a second to load.
    (It is the function of `vespo.rewards.math` itself, so a worker process that unpickles it
    loads math-verify before it reports ready, not inside the first timed call.)"""
    if name == "math_verify_reward":
        from vespo.rewards.math import math_verify_reward

        return math_verify_reward
    raise AttributeError(f"module 'vespo.rewards' has no attribute {name!r}")


def load_reward_fn(path: str, field: str = "reward function") -> RewardFn:
    """The callable named by "package.module:function" (a dotted attribute path after the colon
    is followed, e.g. "pkg.mod:obj.method"), with one of the signatures the scorer accepts
    (``SIGNATURES``). Errors are RewardFnError naming ``field`` (the config field or option that
    gave the path, e.g. "task.reward") and the part of the path that failed."""
    module_name, sep, attr_path = path.partition(":")
    where = f"{field} {path!r}"
    if not sep or not module_name or not attr_path:
        raise RewardFnError(f"{where}: a reward function path must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardFnError(f"{where}: cannot import module {module_name!r}: {exc}; check the name and that "
                            "its folder is on PYTHONPATH") from exc
    except Exception as exc:  # the user's module raised while importing
        raise RewardFnError(f"{where}: importing {module_name!r} raised {type(exc).__name__}: {exc} "
                            "(--debug shows the traceback)") from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise RewardFnError(f"{where}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardFnError(f"{where} is a {type(obj).__name__}, not a callable")
    try:
        reward_call(obj)  # one of the two accepted signatures
    except RewardFnError as exc:
        raise RewardFnError(f"{where}: {exc}") from None
    return obj


__all__ = ["SIGNATURES", "RewardError", "RewardScorer", "RewardsFailedError", "ScoreError", "ScoreResult",
           "load_reward_fn", "math_verify_reward", "reward_call"]
