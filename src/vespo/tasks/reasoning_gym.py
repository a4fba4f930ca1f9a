"""Real reasoning tasks from reasoning-gym: any of its procedural datasets by name, with its options.

    task = get_task("rg:chain_sum", min_terms=2, max_terms=3)    # task.name=rg:chain_sum task.options={...}
    problems = task.generate(n=8, seed=0)       # chat-message prompts with an answer-format instruction
    task.reward(completion, problems[0].ground_truth)            # 1.0 if the final answer is right
    held_out = task.held_out(256, seed=1, train=problems)        # no question of `train` among them
    write_verl_parquet(problems, "train.parquet")                # the same problems for verl and others

Prompt: the dataset's question, then ``INSTRUCTION`` ("Put the final answer in \\boxed{}."), as one
user message rendered by the model's chat template (``chat=False`` sends plain text instead).

Reward: the dataset's own verifier (``score_answer``) on the extracted final answer: the content of
the last ``\\boxed{...}``, or, when there is none, the completion itself stripped. Where the answer
is a number, a number literal decides too: the boxed content when it is one, else (no box) the last
number in the completion, equal to the answer as a decimal ("12.0", "12" and "\\boxed{12}" agree):
a completion is right when either says so. An expression is never evaluated: restating the question
("6 + 8 + 5 =", "\\boxed{6+8+5}") earns nothing (math-verify, which evaluates it, paid the model for
echoing the problem until 2026-12-05). Rewards are 0/1: a score below 1 (reasoning-gym gives partial
credit for some near misses) counts 0 unless ``partial_credit=True``.

Ground truth: ``{"answer": str, "metadata": {...}}``, the dataset entry without its question (some
verifiers read the metadata, e.g. countdown's numbers and target). In a verl-style file the answer
is ``reward_model.ground_truth`` and the entry is in ``extra_info["reasoning_gym"]`` as JSON, and
:func:`compute_score` (verl's signature) scores it, in verl or in ``vespo train task.dataset=...
task.reward=vespo.tasks.reasoning_gym:compute_score``.
"""

from __future__ import annotations

import functools
import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

from vespo.tasks.base import Task
from vespo.types import Problem

PREFIX = "rg:"
INSTRUCTION = "Put the final answer in \\boxed{}."
NUMBER = re.compile(r"^\s*-?\d+(\.\d+)?\s*$")
NUMBER_IN_TEXT = re.compile(r"-?\d+(?:\.\d+)?")
MAX_HELD_OUT_DRAW = 20  # held-out problems are searched for among this many times as many draws
SEED_STRIDE = 2**32  # reasoning-gym seeds item i with Random(seed + i): seeds this far apart never share items


@functools.lru_cache(maxsize=64)
def _dataset(name: str, options_json: str, size: int = 1, seed: int = 0) -> Any:
    """A reasoning-gym dataset object (its ``score_answer`` for scoring; a larger one for generating)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(options_json))


def dataset_names() -> list[str]:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("reasoning-gym tasks (rg:NAME) need the reasoning-gym package: "
                         "pip install 'vespo[reasoning]'") from None

    return sorted(reasoning_gym.factory.DATASETS)


class ReasoningGymTask(Task):
    """A reasoning-gym dataset as a vespo task (see the module docstring)."""

    def __init__(self, dataset: str, chat: bool = True, partial_credit: bool = False,
                 instruction: str = INSTRUCTION, **options: Any) -> None:
        names = dataset_names()
        if dataset not in names:
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; choose one of: {', '.join(names)}")
        self.dataset, self.chat, self.partial_credit, self.instruction = dataset, chat, partial_credit, instruction
        self.options = dict(options)
        self.name = PREFIX + dataset
        try:
            _dataset(dataset, self._options_json())
        except (TypeError, ValueError, AssertionError) as e:  # reasoning-gym's checks of its config
            raise ValueError(f"reasoning-gym dataset {dataset!r} rejects its options {self.options}: {e}") from None

    def _options_json(self) -> str:
        return json.dumps(self.options, sort_keys=True)

    @property
    def max_answer_chars(self) -> int:
        return 0  # answers with reasoning have no fixed bound: rollout.max_new_tokens must be set

    @property
    def max_new_tokens(self) -> int:
        return 0

    def make_problem(self, rng):  # generate() is overridden: reasoning-gym draws from its own seed
        raise NotImplementedError

    def generate(self, n: int, seed: int) -> list[Problem]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        if n == 0:
            return []
        entries = _dataset(self.dataset, self._options_json(), size=n, seed=seed * SEED_STRIDE)
        return [self._problem(entries[i], f"{self.name}-{seed}-{i}") for i in range(n)]

    def held_out(self, n: int, seed: int, train: list[Problem]) -> list[Problem]:
        """``n`` problems drawn with ``seed``, none of whose questions is among ``train``'s: the first ``n`` of a
        draw of up to ``MAX_HELD_OUT_DRAW`` x n that are not."""
        seen = {_question(p) for p in train}
        drawn = self.generate(MAX_HELD_OUT_DRAW * n, seed)
        kept = [p for p in drawn if _question(p) not in seen][:n]
        if len(kept) < n:
            raise ValueError(f"{self.name}: only {len(kept)} of {len(drawn)} held-out problems differ from the "
                             f"{len(train)} training problems; the task's options leave too few distinct problems "
                             "(lower task.train_size or task.eval_size, or widen the options)")
        return kept

    def _problem(self, entry: dict, pid: str) -> Problem:
        text = f"{entry['question'].rstrip()}\n\n{self.instruction}" if self.instruction else entry["question"]
        prompt: str | list[dict[str, str]] = [{"role": "user", "content": text}] if self.chat else text
        truth = {"answer": str(entry["answer"]), "metadata": _plain(entry.get("metadata", {}))}
        extra = {"question": entry["question"], "dataset": self.dataset, "options": self._options_json()}
        return Problem(id=pid, prompt=prompt, ground_truth=truth, data_source=self.name, extra_info=extra)

    def reward(self, completion: str, ground_truth: Any) -> float:
        return score(self.dataset, self._options_json(), completion, ground_truth, self.partial_credit)

    def reference_completion(self, problem: Problem) -> str:
        return f"\\boxed{{{problem.ground_truth['answer']}}}"


def _question(problem: Problem) -> str:
    return problem.extra_info["question"]


def _plain(value: Any) -> Any:
    """Metadata as JSON-safe plain data (reasoning-gym keeps tuples, sets and numpy values in some)."""
    return json.loads(json.dumps(value, default=lambda o: o.tolist() if hasattr(o, "tolist") else sorted(o)
                                 if isinstance(o, (set, frozenset)) else str(o)))


def final_answer(completion: str) -> str:
    """The content of the last complete ``\\boxed{...}``, else the stripped completion."""
    from vespo.rewards.math import last_boxed

    boxed = last_boxed(completion)
    return boxed[len("\\boxed{"):-1].strip() if boxed is not None else completion.strip()


def numeric_answer(completion: str) -> str | None:
    """The number a completion answers with: the last box's content when it is a number literal (None when it is
    anything else, e.g. an expression), else, with no box, the last number literal of the text."""
    from vespo.rewards.math import last_boxed

    boxed = last_boxed(completion)
    if boxed is not None:
        inner = boxed[len("\\boxed{"):-1].strip()
        return inner if NUMBER.match(inner) else None
    numbers = NUMBER_IN_TEXT.findall(completion)
    return numbers[-1] if numbers else None


def score(dataset: str, options_json: str, completion: str, truth: dict, partial_credit: bool = False) -> float:
    """The reward of ``completion`` (see the module docstring): the dataset's verifier, or for numeric answers the
    number the completion answers with; 0/1 unless ``partial_credit``."""
    entry = {"question": "", "answer": truth["answer"], "metadata": truth.get("metadata", {})}
    try:
        value = float(_dataset(dataset, options_json).score_answer(final_answer(completion), entry) or 0.0)
    except Exception:  # a verifier that cannot read the answer did not verify it
        value = 0.0
    if value < 1.0 and NUMBER.match(truth["answer"]):
        answer = numeric_answer(completion)
        value = max(value, float(answer is not None and Decimal(answer) == Decimal(truth["answer"].strip())))
    return value if partial_credit or value >= 1.0 else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl's reward signature for a file written by :func:`write_verl_parquet`."""
    if not extra_info or "reasoning_gym" not in extra_info:
        raise ValueError(f"row of {data_source!r} has no extra_info['reasoning_gym']; it was not written by "
                         "vespo.tasks.reasoning_gym.write_verl_parquet")
    info = json.loads(extra_info["reasoning_gym"])
    truth = {"answer": str(ground_truth), "metadata": info["metadata"]}
    return score(info["dataset"], info["options"], solution_str, truth, info.get("partial_credit", False))


def write_verl_parquet(task: ReasoningGymTask, problems: list[Problem], path: str | Path, split: str) -> Path:
    """Write ``problems`` as a verl-style parquet (data_source, prompt, ability, reward_model, extra_info)
    that ``vespo.data.load_problems`` and verl read; :func:`compute_score` scores its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i, p in enumerate(problems):
        info = {"dataset": task.dataset, "options": task._options_json(), "metadata": p.ground_truth["metadata"],
                "partial_credit": task.partial_credit}
        rows.append({
            "data_source": p.data_source,
            "prompt": p.prompt if isinstance(p.prompt, list) else [{"role": "user", "content": p.prompt}],
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": p.ground_truth["answer"]},
            "extra_info": {"split": split, "index": p.id, "reasoning_gym": json.dumps(info)},
        })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
