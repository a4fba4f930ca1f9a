"""`vespo task`: list the tasks, or write a reasoning-gym task's problems as verl-style parquet files.

    vespo task list
    vespo task export rg:chain_sum --option min_terms=2 --option max_terms=2 --train 20000 --test 256 \\
        --seed 0 --out data/chain_sum          # data/chain_sum/train.parquet, test.parquet

The files hold the same problems ``vespo train task.name=... run.seed=...`` trains and evaluates on
(training problems from the seed, held-out ones disjoint from them), so a run elsewhere (verl, or
``vespo train task.dataset=.../train.parquet task.reward=vespo.tasks.reasoning_gym:compute_score``)
sees what vespo's does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vespo.errors import UsageError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vespo task", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the built-in tasks and the reasoning-gym datasets")
    e = sub.add_parser("export", help="write train.parquet and test.parquet of a reasoning-gym task")
    e.add_argument("task", help="rg:NAME, a reasoning-gym dataset")
    e.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option (the dataset's, or chat/partial_credit/instruction), value parsed as YAML")
    e.add_argument("--train", type=int, default=20000, help="training problems (task.train_size)")
    e.add_argument("--test", type=int, default=256, help="held-out problems (task.eval_size)")
    e.add_argument("--seed", type=int, default=0, help="the run seed the problems are drawn from (run.seed)")
    e.add_argument("--out", required=True, help="output directory")
    return p


def main(argv: list[str]) -> int:
    import yaml

    from vespo.tasks import ReasoningGymTask, get_task, task_names
    from vespo.tasks.base import HELD_OUT_SEED_OFFSET
    from vespo.tasks.reasoning_gym import dataset_names, write_verl_parquet

    args = _parser().parse_args(argv)
    if args.command == "list":
        print("built-in (tiny character models):", ", ".join(task_names()))
        print("reasoning-gym (rg:NAME):", ", ".join(dataset_names()))
        return 0
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--option {item!r} must look like KEY=VALUE")
        options[key] = yaml.safe_load(value)
    try:
        task = get_task(args.task, **options)
    except ValueError as e:
        raise UsageError(f"task {args.task!r}: {e}") from None
    if not isinstance(task, ReasoningGymTask):
        raise UsageError(f"task {args.task!r} is a built-in task of the tiny character models; export takes rg:NAME")
    train = task.generate(args.train, seed=args.seed)
    test = task.held_out(args.test, seed=args.seed + HELD_OUT_SEED_OFFSET, train=train)
    out = Path(args.out)
    for split, problems in (("train", train), ("test", test)):
        print(write_verl_parquet(task, problems, out / f"{split}.parquet", split))
    return 0
