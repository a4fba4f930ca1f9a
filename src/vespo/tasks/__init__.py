"""Built-in verifiable tasks and their registry.

    from vespo.tasks import get_task, task_names
    task = get_task("addition", digits=2)
    problems = task.generate(n=8, seed=0)          # deterministic given the seed
    task.reward("46", problems[0].ground_truth)    # exact str -> float
    task.reference_completion(problems[0])         # a correct completion (warm start)
    task.max_answer_chars                          # sizes max_new_tokens

    get_task("rg:chain_sum", min_terms=2)          # any reasoning-gym dataset (vespo.tasks.reasoning_gym)

The built-in tasks speak the tiny character tokenizer's alphabet (the lab's tiny models); real
models train on reasoning-gym's datasets (countdown among them).
"""

from __future__ import annotations

import inspect
from typing import Any

from vespo.tasks.arithmetic import AdditionTask, MultiplicationTask, SubtractionTask
from vespo.tasks.base import Task
from vespo.tasks.reasoning_gym import PREFIX as RG_PREFIX
from vespo.tasks.reasoning_gym import ReasoningGymTask
from vespo.tasks.strings import ReverseLongTask, ReverseTask, SortTask

_TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (AdditionTask, SubtractionTask, MultiplicationTask, ReverseTask,
                ReverseLongTask, SortTask)
}


def task_names() -> list[str]:
    """The built-in names `get_task` accepts, sorted (and rg:NAME for any reasoning-gym dataset)."""
    return sorted(_TASKS)


def get_task(name: str, **kwargs: Any) -> Task:
    """The task called `name`, built with its difficulty options `kwargs`.
    An unknown name or option, or an option out of range, raises a ValueError that says what is valid."""
    if name.startswith(RG_PREFIX):
        return ReasoningGymTask(name[len(RG_PREFIX):], **kwargs)
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(task_names())}, or rg:NAME for a "
                         "reasoning-gym dataset (e.g. rg:chain_sum)")
    cls = _TASKS[name]
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"task {name!r} has no option {', '.join(map(repr, unknown))}; "
                         f"its options are: {', '.join(params) or '(none)'}")
    return cls(**kwargs)


__all__ = ["Task", "get_task", "task_names", "AdditionTask", "SubtractionTask", "MultiplicationTask",
           "ReasoningGymTask", "ReverseTask", "ReverseLongTask", "SortTask"]
