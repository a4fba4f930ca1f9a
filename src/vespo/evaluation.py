"""avg@k and pass@k of a policy per data source, k set per source (as the paper scores AIME, AMC, MATH-500).

The core is pure: `evaluate` takes a `generate_fn(problems, n) -> n completions per problem`, so it
runs without a model; with one, it is a `vespo.rollout.TextGenerator` (the decoding path training
and warm start use too). `heldout_rewards` is the trainer's held-out check on the same core.
`vespo eval` (vespo.eval_cli) wires it to a saved policy:

    vespo eval --model runs/demo --task addition --n-problems 200 --default-k 8
    vespo eval --model DIR --data math.parquet --k aime24=32 --k amc23=16 --k math500=4 \
               --max-new-tokens 4096 --out results.jsonl

Scoring: a sample is correct when its reward is >= `success_threshold` (1.0). avg@k is the mean
reward over a problem's k samples, averaged over problems. A sample whose reward could not be
computed (an exception or non-finite value; see `vespo.rewards.scorer`) counts as reward 0 and
incorrect here, and is counted in the report's `num_errors` column.

`--model` takes a run directory (its `policy/`, else its latest checkpoint), a checkpoint
directory (`RUN_DIR/checkpoints/step-NNNNNN`, its weights in the run's architecture) or any
Hugging Face model directory (see `vespo.trainer.policy_dir.load_trained_policy`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vespo.rewards import RewardScorer
from vespo.types import Problem

GenerateFn = Callable[[list[Problem], int], list[list[str]]]  # (problems, n) -> n completions per problem


# ---- pure estimators ----------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021), computed as a stable product."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise ValueError(f"n, c and k must be integers, got n={n!r}, c={c!r}, k={k!r}")
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def avg_at_k(results: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean reward of each problem's samples."""
    if not results:
        raise ValueError("avg_at_k needs at least one problem's results")
    means = []
    for i, rewards in enumerate(results):
        if not rewards:
            raise ValueError(f"avg_at_k: problem {i} has no samples")
        if any(not math.isfinite(r) for r in rewards):
            raise ValueError(f"avg_at_k: problem {i} has a non-finite reward: {list(rewards)}")
        means.append(sum(rewards) / len(rewards))
    return sum(means) / len(means)


# ---- the evaluation core ------------------------------------------------------------------

@dataclass
class ProblemResult:
    """The k samples of one problem and their rewards."""

    problem_id: str
    data_source: str
    k: int
    completions: list[str]
    rewards: list[float]  # errors already counted as 0.0
    num_correct: int
    num_errors: int


@dataclass
class SourceReport:
    """avg@k and pass@k of one data source."""

    data_source: str
    k: int
    num_problems: int
    avg_at_k: float
    pass_at_1: float
    pass_at_k: float
    num_errors: int


@dataclass
class EvalReport:
    sources: dict[str, SourceReport]
    results: list[ProblemResult]


def evaluate(
    generate_fn: GenerateFn,
    problems: Sequence[Problem],
    reward_fn: Callable[[str, Any], float] | RewardScorer,
    k_by_source: dict[str, int] | None = None,
    default_k: int = 4,
    success_threshold: float = 1.0,
) -> EvalReport:
    """Sample k completions per problem (k from `k_by_source`, else `default_k`), score them,
    and report per data source. `reward_fn` is a plain function (scored in process) or a
    RewardScorer (worker processes with a time limit)."""
    if not problems:
        raise ValueError("evaluate needs at least one problem")
    ks = _resolve_ks(problems, k_by_source or {}, default_k)
    scorer = reward_fn if isinstance(reward_fn, RewardScorer) else RewardScorer(reward_fn, num_workers=0)
    results = []
    for k in sorted(set(ks)):
        group = [p for p, pk in zip(problems, ks) if pk == k]
        completions = _generate(generate_fn, group, k)
        results += _score_group(scorer, group, completions, k, success_threshold)
    order = {p.id: i for i, p in enumerate(problems)}
    results.sort(key=lambda r: order[r.problem_id])
    return EvalReport(sources=_summarize(results), results=results)


def _resolve_ks(problems: Sequence[Problem], k_by_source: dict[str, int], default_k: int) -> list[int]:
    for source, k in {**k_by_source, "default_k": default_k}.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k for {source!r} must be an integer >= 1, got {k!r}")
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError("evaluate needs unique problem ids")
    return [k_by_source.get(p.data_source, default_k) for p in problems]


def _generate(generate_fn: GenerateFn, problems: list[Problem], k: int) -> list[list[str]]:
    completions = generate_fn(problems, k)
    if len(completions) != len(problems) or any(len(c) != k for c in completions):
        shape = [len(c) for c in completions]
        raise ValueError(f"generate_fn must return {k} completions for each of {len(problems)} problems, "
                         f"got {len(completions)} lists of sizes {shape[:8]}")
    return completions


def _score_group(scorer: RewardScorer, group: list[Problem], completions: list[list[str]], k: int,
                 threshold: float) -> list[ProblemResult]:
    flat = [c for per_problem in completions for c in per_problem]
    scored = scorer.score_problems(flat, [p for p in group for _ in range(k)])
    failed = {e.index for e in scored.errors if e.kind != "timeout"}  # timeouts are already 0.0
    rewards = [0.0 if i in failed else r for i, r in enumerate(scored.rewards)]
    errors = {e.index for e in scored.errors}
    results = []
    for j, problem in enumerate(group):
        span = range(j * k, (j + 1) * k)
        mine = [rewards[i] for i in span]
        results.append(ProblemResult(problem.id, problem.data_source, k, completions[j], mine,
                                     num_correct=sum(r >= threshold for r in mine),
                                     num_errors=sum(i in errors for i in span)))
    return results


def heldout_rewards(generate: Callable[..., list[list[str]]], problems: Sequence[Problem],
                    scorer: RewardScorer, sampling: Any, seed: int = 12345,
                    kinds: tuple[str, ...] = ("sampled", "greedy")) -> dict[str, float]:
    """The trainer's held-out check: mean reward of one sample per problem at the training sampling
    settings (``reward_sampled``) and of the greedy answer (``reward_greedy``).

    ``generate(problems, n, sampling, seed)`` is a TextGenerator (or a rollout source's). A fixed
    seed makes the sampled figure comparable across the evaluations of a run. A reward that fails
    counts as 0 (as in `evaluate`).
    """
    from vespo.rollout.text import greedy

    if not problems:
        return {}
    out = {}
    for name in kinds:
        params = greedy(sampling) if name == "greedy" else sampling
        report = evaluate(lambda ps, n: generate(ps, n, params, seed), problems, scorer, default_k=1)
        rewards = [r.rewards[0] for r in report.results]
        out[f"reward_{name}"] = sum(rewards) / len(rewards)
    return out


def _summarize(results: list[ProblemResult]) -> dict[str, SourceReport]:
    sources: dict[str, SourceReport] = {}
    for source in sorted({r.data_source for r in results}):
        mine = [r for r in results if r.data_source == source]
        k = mine[0].k
        sources[source] = SourceReport(
            data_source=source, k=k, num_problems=len(mine),
            avg_at_k=avg_at_k([r.rewards for r in mine]),
            pass_at_1=sum(pass_at_k(k, r.num_correct, 1) for r in mine) / len(mine),
            pass_at_k=sum(pass_at_k(k, r.num_correct, k) for r in mine) / len(mine),
            num_errors=sum(r.num_errors for r in mine),
        )
    return sources


# ---- output -------------------------------------------------------------------------------

def print_report(report: EvalReport) -> None:
    """A rich table, one row per data source."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="vespo eval")
    for column in ("data source", "problems", "k", "avg@k", "pass@1", "pass@k", "errors"):
        table.add_column(column, justify="left" if column == "data source" else "right")
    for s in report.sources.values():
        table.add_row(s.data_source, str(s.num_problems), str(s.k), f"{s.avg_at_k:.4f}",
                      f"{s.pass_at_1:.4f}", f"{s.pass_at_k:.4f}", str(s.num_errors))
    Console().print(table)


def write_jsonl(report: EvalReport, path: str | Path) -> Path:
    """One {"type": "source", ...} line per data source, then one {"type": "problem", ...} per problem."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for s in report.sources.values():
            f.write(json.dumps({"type": "source", **asdict(s)}) + "\n")
        for r in report.results:
            f.write(json.dumps({"type": "problem", **asdict(r)}) + "\n")
    return path


# ---- `vespo eval` -------------------------------------------------------------------------
