"""Built-in verifiable tasks and their registry.

    from vespo.tasks import get_task, task_names
    task = get_task("addition", digits=2)
    problems = task.generate(n=8, seed=0)          # deterministic given the seed
    task.reward("46", problems[0].ground_truth)    # exact str -> float
    task.reference_completion(problems[0])         # a correct completion (warm start)
    task.max_answer_chars                          # sizes max_new_tokens
"""

from __future__ import annotations

import inspect
from typing import Any

from vespo.tasks.arithmetic import AdditionTask, MultiplicationTask, SubtractionTask
from vespo.tasks.base import Task
from vespo.tasks.countdown import CountdownTask
from vespo.tasks.strings import ReverseLongTask, ReverseTask, SortTask

_TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (AdditionTask, SubtractionTask, MultiplicationTask, CountdownTask, ReverseTask,
                ReverseLongTask, SortTask)
}


def task_names() -> list[str]:
    """The names `get_task` accepts, sorted."""
    return sorted(_TASKS)


def get_task(name: str, **kwargs: Any) -> Task:
    """The task called `name`, built with its difficulty options `kwargs`.
    An unknown name or option, or an option out of range, raises a ValueError that says what is valid."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(task_names())}")
    cls = _TASKS[name]
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"task {name!r} has no option {', '.join(map(repr, unknown))}; "
                         f"its options are: {', '.join(params) or '(none)'}")
    return cls(**kwargs)


__all__ = ["Task", "get_task", "task_names", "AdditionTask", "SubtractionTask", "MultiplicationTask",
           "CountdownTask", "ReverseTask", "ReverseLongTask", "SortTask"]
