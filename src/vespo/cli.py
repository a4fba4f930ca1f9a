"""The `vespo` command line. Subcommands import their heavy modules only when run.

    vespo train   --config configs/demo.yaml loss.name=gspo staleness.n=32
    vespo kernels --out DIR          the effective coefficient of every loss vs W
    vespo eval    ...                avg@k / pass@k of a policy on a dataset or task
    vespo model   list | get MODEL_PATH   the offline catalogue; a model's local Hugging Face directory
    vespo task    list | export rg:NAME ...   the tasks; a reasoning-gym task's problems as parquet
    vespo plot    RUN_DIR...         reward, KL, grad-norm and length curves of runs
    vespo sweep   ...                the stability lab: a grid of runs
    vespo report  SWEEP_DIR          tables and figures of a sweep

A user error (a bad config value, dataset row, import path, run directory...) prints one line
and exits with status 2; `--debug` anywhere on the command line, or VESPO_DEBUG=1, also prints
its traceback. Any other failure prints its traceback as usual.
"""

from __future__ import annotations

import importlib
import sys
import traceback

from vespo.errors import UserError, debug_requested, one_line

# name -> (its command-line module, one-line help): each command's `main(argv: list[str]) -> int` lives in a module
# named cli, its package's cli.py or, for a top-level module, <module>_cli.py beside it; no other module has a main
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("vespo.trainer.cli", "train a policy (sync or async) from a YAML config"),
    "kernels": ("vespo.coefficients_cli", "plot each loss's effective coefficient on grad log pi vs W"),
    "eval": ("vespo.eval_cli", "avg@k and pass@k of a policy on a dataset or task"),
    "model": ("vespo.models.cli", "list the offline models, or produce a model.path's local directory"),
    "task": ("vespo.tasks.cli", "list the tasks; write a reasoning-gym task as verl-style parquet"),
    "plot": ("vespo.plot_cli", "draw the curves of one or more run directories"),
    "sweep": ("vespo.sweep.cli", "run a grid of experiments (losses x staleness x seeds)"),
    "report": ("vespo.lab.cli", "write the table and figures of a sweep"),
}


def _usage() -> str:
    lines = ["usage: vespo COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`vespo COMMAND --help` shows the options of one command.",
              "`--debug` (or VESPO_DEBUG=1) shows the traceback of an error."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from vespo import __version__

        print(__version__)
        return 0
    from vespo.allocator import return_freed_memory

    return_freed_memory()
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vespo: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except UserError as e:
        if debug:
            traceback.print_exc()
        print(f"vespo {name}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
