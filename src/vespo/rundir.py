"""A run directory's layout: the one home of its file names, and the readers and writers of its records.

    RUN_DIR/config.yaml        CONFIG       the resolved config
    RUN_DIR/metrics.jsonl      METRICS      one row per rollout step ("step" = rollout steps done)
    RUN_DIR/samples.jsonl      SAMPLES      a few rows per run.log_samples_every steps: prompt, completion, reward, ...
    RUN_DIR/eval_before.json   EVAL_BEFORE  the held-out evaluation before RL
    RUN_DIR/summary.json       SUMMARY      reward before and after, timings, and "status": why the run stopped (Stop)
    RUN_DIR/versions.jsonl     VERSIONS     async: per update, the learner version and each row's token versions
    RUN_DIR/tb/                TB           TensorBoard events
    RUN_DIR/checkpoints/       CHECKPOINTS  see vespo.trainer.checkpoint
    RUN_DIR/policy/            POLICY       see vespo.trainer.policy_dir
    RUN_DIR/.lock              LOCK         held (fcntl) by the process running the run: one process per run directory

A run of a sweep (vespo.sweep) also has:

    RUN_DIR/lab.json           LAB          its labels and overrides, and how its process ended
    RUN_DIR/train.log          TRAIN_LOG    its process's output
    RUN_DIR/restarted/<time>/  RESTARTED    the files of a start killed before its first checkpoint

The trainer writes these (vespo.trainer.runlog), `vespo sweep` plans and launches by them, and the lab and
`vespo plot` read them back as ``RunFiles``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vespo.config import load_yaml
from vespo.metrics import read_jsonl

CONFIG, METRICS, SAMPLES = "config.yaml", "metrics.jsonl", "samples.jsonl"
EVAL_BEFORE, SUMMARY, VERSIONS = "eval_before.json", "summary.json", "versions.jsonl"
TB, CHECKPOINTS, POLICY, LOCK = "tb", "checkpoints", "policy", ".lock"
LAB, TRAIN_LOG, RESTARTED = "lab.json", "train.log", "restarted"


class Stop:
    """summary.json's "status": why the run stopped."""

    DONE = "done"  # its updates are done (or its stop rule ended it)
    INTERRUPTED = "interrupted"  # Ctrl-C stopped it at a rollout step, checkpointed: resumable
    NON_FINITE = "non_finite"  # too many updates in a row had a non-finite loss or gradient (the learner's guard)


STOPS = (Stop.DONE, Stop.INTERRUPTED, Stop.NON_FINITE)


@dataclass
class RunFiles:
    """What a run directory holds of a run, as the lab and `vespo plot` read it."""

    config: dict  # config.yaml ({} when absent)
    summary: dict  # summary.json ({} while the run is unfinished)
    eval_before: dict  # eval_before.json ({} when absent)
    rows: list[dict] | None  # metrics.jsonl (None when it wrote none)

    @property
    def n(self) -> int:
        """Optimizer steps per logged row: staleness.n of the run's config (else its summary's, else 1)."""
        return int((self.config.get("staleness") or {}).get("n") or self.summary.get("staleness_n") or 1)


def stopped_nonfinite(summary: dict, lab: dict | None = None) -> bool:
    """The learner's non-finite guard stopped the run: its summary says so, or, for a run recorded before
    summaries said it, its sweep's lab.json does ("stopped_nonfinite", which the sweep then read off the run's log)."""
    return summary.get("status") == Stop.NON_FINITE or bool((lab or {}).get("stopped_nonfinite"))


def read_run_files(run_dir: str | Path) -> RunFiles:
    """A run directory's config, summary, evaluation before RL and metrics rows (each empty or None when absent)."""
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / METRICS) if (run_dir / METRICS).is_file() else None
    config = load_yaml(run_dir / CONFIG, "run config", ValueError) if (run_dir / CONFIG).is_file() else {}
    return RunFiles(config, read_json(run_dir / SUMMARY), read_json(run_dir / EVAL_BEFORE), rows)


def write_run_files(files: RunFiles, run_dir: Path) -> None:
    """The inverse of ``read_run_files`` (an empty record, or rows of None, is not written)."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG).write_text(yaml.safe_dump(files.config, sort_keys=False))
    for name, data in ((SUMMARY, files.summary), (EVAL_BEFORE, files.eval_before)):
        if data:
            (run_dir / name).write_text(json.dumps(data, indent=2))
    if files.rows is not None:
        (run_dir / METRICS).write_text("".join(json.dumps(row) + "\n" for row in files.rows))


def read_json(path: Path) -> dict:
    """A JSON record of a run directory ({} when absent)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def read_summary(run_dir: str | Path) -> dict:
    return read_json(Path(run_dir) / SUMMARY)


def write_summary(run_dir: str | Path, summary: dict) -> None:
    if summary.get("status") not in STOPS:
        raise ValueError(f"a summary's status is one of {', '.join(STOPS)}, not {summary.get('status')!r}")
    write_atomic(Path(run_dir) / SUMMARY, json.dumps(summary, indent=2))


def started(run_dir: str | Path) -> bool:
    """The directory holds a run that was started: its metrics file, or anything under checkpoints/."""
    run_dir = Path(run_dir)
    return (run_dir / METRICS).exists() or any((run_dir / CHECKPOINTS).glob("*"))


def write_atomic(path: Path, text: str) -> None:
    """Write a file so that a crash leaves the old content or the new, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
