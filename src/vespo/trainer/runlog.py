"""A run directory's record as a run writes it: the metric sinks (jsonl, TensorBoard, W&B), resume-safe
metrics.jsonl, progress bar, summary, and the lock one process holds on the directory. The layout (file names,
readers, the summary's stop reasons) is vespo.rundir's.

Without a terminal (nohup, a batch job, CI) the progress bar gives way to one plain line per step (or
every few steps): step, reward, loss, ESS, seconds per step; no line is wrapped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vespo.config import Config, to_dict
from vespo.errors import DISK_FULL, FREE_AND_RESUME, DiskFullError, RunDirError
from vespo.rundir import CONFIG, LOCK, METRICS, SAMPLES, TB, write_atomic, write_summary

console = Console(stderr=True, soft_wrap=True)  # a path stays whole in a log file, whatever its length


class MetricSink(Protocol):
    """Where a step's metrics go (jsonl, TensorBoard, W&B); a sink that shows text may also have log_samples."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"step": k, ...metrics}. Non-finite values are written as null."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab", buffering=0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (v if isinstance(v, (int, str)) or math.isfinite(v) else None)
                                for k, v in metrics.items()}}
        append_rows(self._f, self.path, step, json.dumps(row) + "\n")

    def close(self) -> None:
        self._f.close()


def append_rows(f, path: Path, step: int, text: str, unit: str = "step") -> None:
    """Append ``text`` (whole lines) to ``f`` (opened "ab" unbuffered) and sync it. A full disk (or quota, or file
    size limit) takes back what part of it was written, so the file keeps whole rows only, and raises DiskFullError
    naming the step (or ``unit``: "update") and the file: the run stops before the step's checkpoint, and
    --resume repeats the step."""
    start = os.lseek(f.fileno(), 0, os.SEEK_END)
    data = memoryview(text.encode())
    try:
        while data:
            data = data[f.write(data):]
        os.fsync(f.fileno())
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        with contextlib.suppress(OSError):
            os.ftruncate(f.fileno(), start)
        raise DiskFullError(f"no room to append {unit} {step} to {path} ({e.strerror}): {FREE_AND_RESUME}") from e


class TensorBoardSink:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Samples as a markdown table under the "samples" text tag."""
        if not rows:
            return
        keys = list(rows[0])
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_cell(r[k]) for k in keys) + " |" for r in rows]
        self._w.add_text("samples", "\n".join(lines), step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


class WandbSink:
    def __init__(self, run_dir: str | Path, config: dict, name: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("run.loggers includes 'wandb' but wandb is not installed (pip install wandb)") from e
        self._run = wandb.init(dir=str(run_dir), config=config, name=name, reinit=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        import wandb

        if rows:
            keys = list(rows[0])
            self._run.log({"samples": wandb.Table(columns=keys, data=[[r[k] for k in keys] for r in rows])}, step=step)

    def close(self) -> None:
        self._run.finish()


class RunLog:
    """The run directory's files and sinks; ``writes=False`` (a rank other than 0) writes nothing."""

    def __init__(self, cfg: Config, resume_step: int | None, writes: bool = True):
        self.dir = Path(cfg.run.out_dir)
        self.metrics_path = self.dir / METRICS
        self.samples_path = self.dir / SAMPLES
        self.writes = writes
        self.sinks: list[MetricSink] = []
        if not writes:
            return
        if resume_step is None:
            check_new_run_dir(cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:  # rows written after the checkpoint the run resumes from
            truncate_metrics(self.metrics_path, resume_step)
            truncate_metrics(self.samples_path, resume_step)
        (self.dir / CONFIG).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        for name in cfg.run.loggers:
            if name == "jsonl":
                self.sinks.append(JsonlSink(self.metrics_path))
            elif name == "tensorboard":
                self.sinks.append(TensorBoardSink(self.dir / TB))
            elif name == "wandb":
                self.sinks.append(WandbSink(self.dir, to_dict(cfg), name=self.dir.name))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Rows of one step to samples.jsonl, and as text to the sinks that show text."""
        if not self.writes:
            return
        with open(self.samples_path, "ab", buffering=0) as f:
            append_rows(f, self.samples_path, step, "".join(json.dumps({"step": step, **r}) + "\n" for r in rows))
        for sink in self.sinks:
            log_text = getattr(sink, "log_samples", None)
            if log_text is not None:
                log_text(step, rows)

    def write_summary(self, summary: dict) -> None:
        if self.writes:
            write_summary(self.dir, summary)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def check_new_run_dir(cfg: Config) -> None:
    """A new run must not write into a directory that holds another run (its metrics or checkpoints)."""
    from vespo.trainer.checkpoint import run_record

    held = run_record(cfg.run.out_dir)
    if held:
        raise RunDirError(f"run directory {cfg.run.out_dir} already holds a run ({held}); pass --resume to continue "
                          "it, or choose another run.out_dir")


@contextmanager
def hold_run_dir(out_dir: str | Path):
    """Hold ``RUN_DIR/.lock`` (an fcntl lock, released when the process ends however it ends) for the run; a run
    directory another process holds is refused in one line. A directory made here and left with nothing but the
    lock (the run refused before writing anything) is removed again."""
    import fcntl

    out = Path(out_dir)
    made = out.absolute()
    while not made.parent.exists():  # the outermost directory this makes
        made = made.parent
    made = None if out.exists() else made
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / LOCK, "a+")
    except OSError as e:
        raise RunDirError(f"run.out_dir {out} cannot be written ({e.strerror}); choose a writable run.out_dir"
                          ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        by = f" (pid {holder})" if holder else ""
        raise RunDirError(f"run directory {out} is in use by another vespo process{by}; wait for it to end, or stop "
                          "it, before running this one") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    try:
        yield out
    except BaseException:
        if made is not None and [p.name for p in made.rglob("*") if p.is_file()] == [LOCK]:
            shutil.rmtree(made, ignore_errors=True)
        raise
    finally:
        lock.close()


def truncate_metrics(path: Path, step: int) -> None:
    """Drop rows after ``step`` (written after the checkpoint a resume starts from), and a torn last
    line (a process killed mid-write)."""
    if not path.exists():
        return
    lines = path.read_text().split("\n")[:-1]  # only lines that were written whole
    rows = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def step_line(step: int, steps: int, row: dict[str, float]) -> str:
    """One plain line of a step for a log file: step, reward, loss, ESS, seconds per step."""
    def value(key: str, fmt: str) -> str:
        v = row.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "-"

    return (f"step {step}/{steps}  reward {value('reward/mean', '.3f')}  loss {value('loss/total', '.4g')}  "
            f"ess {value('is/ess', '.3f')}  {value('perf/step_s', '.2f')} s/step")


def plain_every(steps: int) -> int:
    """How often a run without a terminal prints its step line: every step up to 100 steps, else ~100 lines."""
    return max(1, steps // 100)


def progress_bar(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"),
                    TimeRemainingColumn(), console=console, disable=not enabled, transient=False)


class GracefulInterrupt:
    """The first Ctrl-C (SIGINT) or SIGTERM (what a scheduler or `kill` sends) asks the loop to stop after the
    current step (and checkpoint); a second one of either interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict = {}

    def __enter__(self) -> "GracefulInterrupt":
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        except ValueError:  # not in the main thread: leave signals alone
            self._previous = {}
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        console.print(f"[yellow]interrupt ({name}): finishing this step and writing a checkpoint (again to abort)")

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
