"""`vespo eval`: avg@k and pass@k of a saved policy on a dataset or a built-in task (vespo.evaluation's core).

    vespo eval --model runs/demo --task addition --n-problems 200 --default-k 8
    vespo eval --model DIR --data math.parquet --k aime24=32 --k amc23=16 --k math500=4 \\
               --max-new-tokens 4096 --out results.jsonl

`--model` takes a run directory (its `policy/`, else its latest checkpoint), a checkpoint
directory (`RUN_DIR/checkpoints/step-NNNNNN`, its weights in the run's architecture) or any
Hugging Face model directory (see `vespo.trainer.policy_dir.load_trained_policy`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from vespo.errors import UsageError
from vespo.evaluation import GenerateFn, evaluate, print_report, write_jsonl
from vespo.rewards import RewardScorer
from vespo.types import Problem


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vespo eval", description="avg@k and pass@k of a policy per data source")
    p.add_argument("--model", required=True, help="a run directory (its policy/, else its latest checkpoint), a "
                   "checkpoint directory (RUN_DIR/checkpoints/step-NNNNNN) or a Hugging Face model directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a verl-style .parquet/.jsonl file, or plain jsonl with prompt/answer")
    source.add_argument("--task", help="a built-in task name (see vespo.tasks.task_names()) or rg:NAME, a "
                        "reasoning-gym dataset (`vespo task list`)")
    p.add_argument("--n-problems", type=int, default=100, help="problems to generate with --task")
    p.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="task option, e.g. digits=3")
    p.add_argument("--k", action="append", default=[], metavar="SOURCE=K", help="samples per problem of one source")
    p.add_argument("--default-k", type=int, default=4, help="samples per problem of other sources")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the task's max_answer_chars + 1 (built-in tasks), else 1024")
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
    from vespo.trainer.policy_dir import load_trained_policy

    model, tokenizer, loaded = load_trained_policy(model_dir, dtype=args.dtype)
    print(f"policy: {loaded}", file=sys.stderr)
    engine = HFEngine(model, tokenizer, dtype=args.dtype, device=args.device)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=max_new_tokens)
    text = TextGenerator(engine, tokenizer, batch_size=args.batch_size,
                         on_batch=lambda done, total: print(f"vespo eval: {done}/{total} completions", file=sys.stderr))
    calls = iter(range(0, 10**12, 1_000_003))  # each call its own seeds

    def generate(problems: list[Problem], n: int) -> list[list[str]]:
        return text(problems, n, sampling, seed=args.seed + next(calls))

    return generate, tokenizer


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    problems, task = load_eval_problems(args)
    k_by_source = parse_assignments(args.k, "--k", int)
    max_new = args.max_new_tokens or (task.max_new_tokens if task is not None else 0) or 1024
    generate_fn, tokenizer = hf_generate_fn(args.model, args, max_new)
    with build_scorer(args, task) as scorer:
        report = evaluate(generate_fn, problems, scorer, k_by_source, args.default_k)
    print_report(report)
    if args.out:
        print(f"wrote {write_jsonl(report, args.out)}")
    return 0
