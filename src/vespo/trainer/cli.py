"""`vespo train`: train a policy from a YAML config plus dotted overrides.

    vespo train                                   the embedded demo (tiny policy, addition, VESPO, N = 8)
    vespo train --config configs/demo.yaml loss.name=gspo staleness.n=32 run.out_dir=runs/gspo32
    vespo train --config configs/demo.yaml --resume
    vespo train --mode async ...                  rollout and learner as Ray actors
    vespo train --help-config                     every field, its default and its allowed values

A config, dataset or run-directory error prints one line naming the field, file or row and
exits with status 2 (`vespo --debug train ...` shows the traceback; see vespo.cli).
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources


def default_config_path() -> str:
    return str(resources.files("vespo").joinpath("configs/demo.yaml"))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vespo train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (default: the embedded demo)")
    p.add_argument("--resume", action="store_true", help="continue the run in run.out_dir from its latest checkpoint")
    p.add_argument("--mode", choices=["sync", "async"], help="shortcut for run.mode=...")
    p.add_argument("--help-config", action="store_true", help="list every config field and exit")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = p.parse_args(argv)

    from vespo.config import describe, load_config

    if args.help_config:
        for name, default, help_ in describe():
            print(f"{name:<32} {default!r:<28} {help_}")
        return 0
    overrides = list(args.overrides) + ([f"run.mode={args.mode}"] if args.mode else [])
    cfg = load_config(args.config or default_config_path(), overrides)  # a ConfigError is printed by vespo.cli
    from vespo.trainer import train

    try:
        train(cfg, resume=args.resume)
    except KeyboardInterrupt:
        print("vespo train: aborted", file=sys.stderr)
        return 130
    return 0
