"""A run directory's record: metric sinks, resume-safe metrics.jsonl, progress bar, summary.

    RUN_DIR/config.yaml         the resolved config
    RUN_DIR/metrics.jsonl       one row per rollout step ("step" = rollout steps done)
    RUN_DIR/tb/                 TensorBoard events
    RUN_DIR/summary.json        reward before and after, collapse flags, timings
    RUN_DIR/checkpoints/        see vespo.trainer.checkpoint
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vespo.config import Config, to_dict
from vespo.errors import RunDirError
from vespo.metrics import JsonlSink, MetricSink, TensorBoardSink, WandbSink, read_jsonl

console = Console(stderr=True)


class RunLog:
    def __init__(self, cfg: Config, resume_step: int | None):
        self.dir = Path(cfg.run.out_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        if resume_step is None and self.metrics_path.exists():
            raise RunDirError(f"run directory {self.dir} already holds a run ({self.metrics_path.name}); pass --resume "
                              "to continue it, or choose another run.out_dir")
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(self.metrics_path, resume_step)
        (self.dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        self.sinks: list[MetricSink] = []
        for name in cfg.run.loggers:
            if name == "jsonl":
                self.sinks.append(JsonlSink(self.metrics_path))
            elif name == "tensorboard":
                self.sinks.append(TensorBoardSink(self.dir / "tb"))
            elif name == "wandb":
                self.sinks.append(WandbSink(self.dir, to_dict(cfg), name=self.dir.name))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def write_summary(self, summary: dict) -> None:
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def truncate_metrics(path: Path, step: int) -> None:
    """Drop rows after ``step`` (written after the checkpoint a resume starts from)."""
    if not path.exists():
        return
    rows = [r for r in read_jsonl(path) if r["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def progress_bar(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"),
                    TimeRemainingColumn(), console=console, disable=not enabled, transient=False)


class GracefulInterrupt:
    """The first Ctrl-C asks the loop to stop after the current step (and checkpoint);
    a second one interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> "GracefulInterrupt":
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not in the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        console.print("[yellow]interrupt: finishing this step and writing a checkpoint (Ctrl-C again to abort)")

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
