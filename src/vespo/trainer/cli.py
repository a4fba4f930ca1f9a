"""`vespo train`: train a policy from a YAML config plus dotted overrides.

    vespo train                                   the embedded demo (tiny policy, addition, VESPO, N = 8)
    vespo train --config configs/demo.yaml loss.name=gspo staleness.n=32 run.out_dir=runs/gspo32
    vespo train --config configs/demo.yaml --resume
    vespo train --mode async ...                  rollout and learner as Ray actors
    vespo train --nproc 2 ...                     the learner sharded over 2 processes (torchrun, FSDP2)
    vespo train --nproc 8 --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29500 ...   one of 2 nodes
    vespo train --help-config                     every field, its default and its allowed values

Ctrl-C finishes the current step, writes a checkpoint and exits with status 130 (the summary's status
is "interrupted"); a second Ctrl-C aborts at once.

With --nproc the command starts torchrun, which runs `vespo train` once per rank (see
docs/distributed.md); a job launched with torchrun directly (`torchrun ... -m vespo.cli train ...`)
is the same.

A config, dataset or run-directory error prints one line naming the field, file or row and
exits with status 2 (`vespo --debug train ...` shows the traceback; see vespo.cli).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources

from vespo.errors import INTERRUPTED


def default_config_path() -> str:
    return str(resources.files("vespo").joinpath("configs/demo.yaml"))


def print_fields() -> None:
    """Every config field as a reader takes it in: its dotted name, default and what it may be, then its help text
    wrapped and indented below (from the field's pydantic JSON schema: type, enum, minimum, ...)."""
    import textwrap

    from vespo.config import field_schemas

    lines = []
    for section in field_schemas():
        for name, f in field_schemas(section).items():
            lines.append(f"{section}.{name} = {f.get('default')!r}    ({describe_rule(f)})")
            help_ = " ".join(f.get("description", "").split())
            lines += textwrap.wrap(help_, width=100, initial_indent="    ", subsequent_indent="    ")
    try:
        print("\n".join(lines))
    except BrokenPipeError:  # `vespo train --help-config | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


TYPES = {"string": "text", "integer": "an integer", "number": "a number", "boolean": "true or false",
         "object": "a mapping", "array": "a list", "null": "None"}


def describe_rule(schema: dict) -> str:
    """A field's JSON schema in words: "an integer >= 1", "one of: qwen3, llama", "text, or None"."""
    if "anyOf" in schema:
        return ", or ".join(describe_rule(s) for s in schema["anyOf"])
    if "enum" in schema:
        return "one of: " + ", ".join(map(str, schema["enum"]))
    if schema.get("type") == "array" and "items" in schema:
        return f"a list of {describe_rule(schema['items'])}"
    words = [TYPES.get(schema.get("type", ""), schema.get("type", "a value"))]
    bounds = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
    words += [f"{op} {schema[key]}" for key, op in bounds.items() if key in schema]
    if "pattern" in schema:
        words.append(f"matching {schema['pattern']}")
    return " ".join(words)


def check_inherited_task_options(cfg, config_path: str | None, overrides: list[str]) -> None:
    """A task named on the command line with task.options left to the config file (or the embedded demo): options
    of another task that this one does not take are refused saying where they came from."""
    from vespo.config import ConfigError
    from vespo.trainer.run import build_task

    names = {item.partition("=")[0].strip() for item in overrides}
    if "task.name" not in names or any(n.startswith("task.options") for n in names) or not cfg.task.options:
        return
    try:
        build_task(cfg)
    except ConfigError as e:
        base = config_path or "the embedded demo config"
        raise ConfigError(f"{e}; task.options {cfg.task.options} came from {base}, not from your overrides: with "
                          f"task.name={cfg.task.name} set its options too (task.options={{}} for its defaults)"
                          ) from None


def announce_overridden(cfg, overrides: list[str]) -> None:
    """Say so when an override cannot act because another setting decides (run.steps under run.updates)."""
    names = {item.partition("=")[0].strip() for item in overrides}
    if "run.steps" in names and "run.updates" not in names and cfg.run.updates:
        print(f"notice: run.steps has no effect: run.updates={cfg.run.updates} (from the config) sets the run's "
              f"length ({cfg.steps} rollout steps of staleness.n={cfg.staleness.n}); override run.updates instead",
              file=sys.stderr)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (default: the embedded demo)")
    p.add_argument("--resume", action="store_true", help="continue the run in run.out_dir from its latest checkpoint")
    p.add_argument("--mode", choices=["sync", "async"], help="shortcut for run.mode=...")
    p.add_argument("--help-config", action="store_true", help="list every config field and exit")
    p.add_argument("--nproc", type=int, default=1, help="learner processes on this node (torchrun; FSDP2)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of a multi-node job (with --rdzv-endpoint)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index in a multi-node job")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT where the nodes of a multi-node job meet")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = p.parse_intermixed_args(argv)  # options anywhere among the overrides: `... a=1 --resume b=2`

    from vespo.config import ConfigError, check_rules, load_config

    if args.help_config:
        print_fields()
        return 0
    overrides = list(args.overrides) + ([f"run.mode={args.mode}"] if args.mode else [])
    cfg = load_config(args.config or default_config_path(), overrides)  # a ConfigError is printed by vespo.cli
    if args.nproc < 1 or args.nnodes < 1:
        raise ConfigError(f"--nproc and --nnodes must be >= 1, got {args.nproc} and {args.nnodes}")
    if args.nproc * args.nnodes > 1:
        check_rules(cfg, args.nproc * args.nnodes, torchrun=True)
        return launch(args, argv)
    from vespo.trainer import train
    from vespo.trainer.distributed import launched_by_torchrun

    check_inherited_task_options(cfg, args.config, overrides)
    announce_overridden(cfg, overrides)
    try:
        summary = train(cfg, resume=args.resume)
    except KeyboardInterrupt:
        print("vespo train: aborted (a second Ctrl-C); continue with --resume", file=sys.stderr)
        return INTERRUPTED
    if summary["status"] == "interrupted":
        print(f"vespo train: interrupted at step {summary['steps_done']} of {cfg.steps}, checkpoint written; "
              "continue with --resume", file=sys.stderr)
        return INTERRUPTED
    if launched_by_torchrun():  # one rank of several, done and every file written: leave without the interpreter's
        sys.stdout.flush()      # teardown, in which a process-group thread now and then aborts the process
        sys.stderr.flush()      # ("terminate called without an active exception", about 1 run in 10 under load)
        os._exit(0)
    return 0


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this command once per rank under torchrun (one node: --standalone); its exit code."""
    import subprocess

    from vespo.errors import UsageError

    rest = _without_launch_flags(argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
    if args.nnodes == 1:
        cmd.append("--standalone")
    else:
        if not args.rdzv_endpoint:
            raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        cmd += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        if args.node_rank is not None:
            cmd.append(f"--node-rank={args.node_rank}")
    code = subprocess.call(cmd + ["-m", "vespo.cli", "train", *rest])
    if code:
        print(f"vespo train: the {args.nproc * args.nnodes}-process job stopped (exit code {code}); the ranks' "
              "messages are above. Its last checkpoint is in run.out_dir/checkpoints: continue with --resume",
              file=sys.stderr)
    return code


def _without_launch_flags(argv: list[str]) -> list[str]:
    """``argv`` without --nproc, --nnodes, --node-rank and --rdzv-endpoint (and their values)."""
    flags = ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint")
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out
