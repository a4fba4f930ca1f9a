"""avg@k and pass@k of a policy per data source, k set per source (as the paper scores AIME, AMC, MATH-500).

The core is pure: `evaluate` takes a `generate_fn(problems, n) -> n completions per problem`, so it
runs without a model; with one, it is a `vespo.rollout.TextGenerator` (the decoding path training
and warm start use too). `heldout_rewards` is the trainer's held-out check on the same core. `main` is `vespo eval`, which wires it to a saved policy:

    vespo eval --model runs/demo --task addition --n-problems 200 --default-k 8
    vespo eval --model DIR --data math.parquet --k aime24=32 --k amc23=16 --k math500=4 \
               --max-new-tokens 4096 --out results.jsonl

Scoring: a sample is correct when its reward is >= `success_threshold` (1.0). avg@k is the mean
reward over a problem's k samples, averaged over problems. A sample whose reward could not be
computed (an exception or non-finite value; see `vespo.rewards.scorer`) counts as reward 0 and
incorrect here, and is counted in the report's `num_errors` column.

`--model` takes a run directory (its `policy/`, else its latest checkpoint), a checkpoint
directory (`RUN_DIR/checkpoints/step-NNNNNN`, its weights in the run's architecture) or any
Hugging Face model directory (see `vespo.trainer.checkpoint.load_trained_policy`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vespo.errors import UsageError
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

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vespo eval", description="avg@k and pass@k of a policy per data source")
    p.add_argument("--model", required=True, help="a run directory (its policy/, else its latest checkpoint), a "
                   "checkpoint directory (RUN_DIR/checkpoints/step-NNNNNN) or a Hugging Face model directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a verl-style .parquet/.jsonl file, or plain jsonl with prompt/answer")
    source.add_argument("--task", help="a built-in task name (see vespo.tasks.task_names())")
    p.add_argument("--n-problems", type=int, default=100, help="problems to generate with --task")
    p.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="task option, e.g. digits=3")
    p.add_argument("--k", action="append", default=[], metavar="SOURCE=K", help="samples per problem of one source")
    p.add_argument("--default-k", type=int, default=4, help="samples per problem of other sources")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the task's max_answer_chars + 1, or 1024 with --data")
    p.add_argument("--reward", default=None,
                   help="'math' (math-verify), 'task', or 'package.module:function'; default: task / math")
    p.add_argument("--timeout-s", type=float, default=10.0, help="time limit of one reward call")
    p.add_argument("--num-workers", type=int, default=2, help="reward worker processes (0: in process)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write per-source and per-problem results as jsonl")
    args = p.parse_args(argv)
    for flag, value, low in (("--n-problems", args.n_problems, 1), ("--default-k", args.default_k, 1),
                             ("--batch-size", args.batch_size, 1), ("--num-workers", args.num_workers, 0)):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    return args


def parse_assignments(items: list[str], flag: str, cast: Callable[[str], Any]) -> dict[str, Any]:
    """["a=1", "b=2"] -> {"a": cast("1"), ...}; a malformed item names the flag."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[key] = cast(value)
        except ValueError as exc:
            raise UsageError(f"{flag} {item!r}: {exc}") from exc
    return out


def _task_value(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


def load_eval_problems(args: argparse.Namespace) -> tuple[list[Problem], Any]:
    """(problems, task or None) from --data or --task."""
    if args.data:
        from vespo.data import load_problems

        return load_problems(args.data), None
    from vespo.tasks import get_task

    options = parse_assignments(args.task_arg, "--task-arg", _task_value)
    try:
        task = get_task(args.task, **options)
    except ValueError as e:  # an unknown task or option, or an option out of range
        raise UsageError(f"--task {args.task!r}: {e}") from None
    return task.generate(args.n_problems, seed=args.seed), task


def build_scorer(args: argparse.Namespace, task: Any) -> RewardScorer:
    """The reward named by --reward: the task's own (in process), math-verify, or an import path."""
    name = args.reward or ("task" if task is not None else "math")
    if name == "task":
        if task is None:
            raise UsageError("--reward task needs --task; with --data use --reward math or 'package.module:function'")
        return RewardScorer(task.reward, num_workers=0)
    from vespo.rewards import load_reward_fn, math_verify_reward

    fn = math_verify_reward if name == "math" else load_reward_fn(name, field="--reward")
    return RewardScorer(fn, timeout_s=args.timeout_s, num_workers=args.num_workers)


def hf_generate_fn(model_dir: str, args: argparse.Namespace, max_new_tokens: int) -> tuple[GenerateFn, Any]:
    """(generate_fn over a saved policy with the HF rollout engine, its tokenizer)."""
    from vespo.rollout import HFEngine, SamplingParams, TextGenerator
    from vespo.trainer.checkpoint import load_trained_policy

    model, tokenizer, loaded = load_trained_policy(model_dir, dtype=args.dtype)
    print(f"policy: {loaded}", file=sys.stderr)
    engine = HFEngine(model, tokenizer, dtype=args.dtype, device=args.device)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=max_new_tokens)
    text = TextGenerator(engine, tokenizer, batch_size=args.batch_size)
    calls = iter(range(0, 10**12, 1_000_003))  # each call its own seeds

    def generate(problems: list[Problem], n: int) -> list[list[str]]:
        return text(problems, n, sampling, seed=args.seed + next(calls))

    return generate, tokenizer


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    problems, task = load_eval_problems(args)
    k_by_source = parse_assignments(args.k, "--k", int)
    max_new = args.max_new_tokens or (task.max_new_tokens if task is not None else 1024)
    generate_fn, tokenizer = hf_generate_fn(args.model, args, max_new)
    with build_scorer(args, task) as scorer:
        report = evaluate(generate_fn, problems, scorer, k_by_source, args.default_k)
    print_report(report)
    if args.out:
        print(f"wrote {write_jsonl(report, args.out)}")
    return 0
