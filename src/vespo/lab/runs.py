"""What the lab reads of a run, from its directory or a sweep's archive (runs.json.gz), as one table of runs.

    sweeps, runs = read_lab(["runs/lab/staleness", "docs/results/async"])
    runs[runs.sweep == "staleness"]     one row per run: its labels (a column per grid axis), status, usable,
                                        collapse (vespo.lab.collapse), the METRICS, and `record` (the Run)

METRICS is the one home of a per-run result; ROW_KEYS (with every eval/ key) is what an archive keeps of
each logged row. A run's quarters are quarters of its optimizer steps, the same at every N.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pandas as pd
from vespo.errors import INTERRUPTED
from vespo.lab.collapse import RULE, Collapse, collapse_of_rows
from vespo.lab.grid import SEED_AXIS, Sweep, excluded
from vespo.metrics import read_jsonl
from vespo.rundir import LAB, RunFiles, Stop, read_run_files, stopped_nonfinite, write_run_files

ARCHIVE, ARCHIVE_FORMAT = "runs.json.gz", 1
SESSIONS = "sessions.jsonl"  # a sweep directory's record of its `vespo sweep` calls (vespo.sweep.provenance)
LR_AXIS = "lr"
EVAL = "eval/reward_sampled"  # a held-out evaluation during training (256 problems in the lab)
TARGET_REWARD, TARGET_WINDOW = 0.6, RULE.every  # time to accuracy: the training reward over windows of updates


@dataclass
class Run(RunFiles):
    """One run's files (config, summary, eval_before, rows: vespo.rundir), as its directory or the archive holds
    them, with its name and its sweep's lab.json."""

    name: str
    lab: dict  # lab.json: labels, overrides, exit status

    @property
    def updates(self) -> int:
        """Planned optimizer steps: run.steps x N from its config, else what it logged."""
        return int((self.config.get("run") or {}).get("steps") or len(self.rows or [])) * self.n

    @property
    def status(self) -> str:  # done, interrupted, failed, unfinished
        if self.lab.get("returncode", 0) not in (0, INTERRUPTED):  # Ctrl-C (130) stops a run at a checkpoint
            return "failed"
        status = self.summary.get("status")
        return status if status in (Stop.DONE, Stop.INTERRUPTED) else "unfinished"

    @property
    def stopped_nonfinite(self) -> bool:
        return stopped_nonfinite(self.summary, self.lab)

    @property
    def before(self) -> float:
        return float((self.summary.get("eval_before") or self.eval_before).get("reward_sampled", math.nan))

    def after(self, key: str) -> float:
        return float((self.summary.get("eval_after") or {}).get(key, math.nan))

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(updates, values) of a logged key: an evaluation after its row's updates, a training metric at the
        updates taken before its row's samples were trained."""
        shift = 0 if "eval/" in key else -1
        pts = [((int(r["step"]) + shift) * self.n, float(r[key])) for r in self.rows or [] if key in r]
        return np.array([u for u, _ in pts]), np.array([v for _, v in pts])  # [k] each

    def quarter(self, key: str, q: int = 3, how: str = "mean") -> float:
        """``how`` (mean, max, min) of a key over the q-th quarter (0..3) of the optimizer steps; q=None: all rows."""
        x, y = self.series(key)
        if q is not None:
            lo, hi = q * self.updates / 4, (q + 1) * self.updates / 4
            y = y[(x > lo) & (x <= hi) if "eval/" in key else (x >= lo - 1e-9) & (x < hi - 1e-9)]
        return float(getattr(y, how)()) if len(y) else math.nan


METRICS: dict[str, Callable[[Run], float]] = {  # "quarter": of the updates; "of any": over all logged rows
    "eval_sampled": lambda r: r.after("reward_sampled"),  # held-out accuracy after training, one sample per problem
    "eval_greedy": lambda r: r.after("reward_greedy"),  # the same, greedy
    "eval_last": lambda r: r.quarter(EVAL),  # mean of the held-out evaluations during the last quarter
    "eval_rise": lambda r: r.quarter(EVAL) - r.quarter(EVAL, 2),  # that minus the same of the quarter before
    "train_last": lambda r: r.quarter("reward/mean"),  # training reward over the last quarter
    "best_reward": lambda r: r.quarter("reward/mean", None, "max"),  # best training reward of a rollout step
    "updates_to_target": lambda r: time_to_target(r)[0],  # optimizer steps until TARGET_REWARD (time_to_target)
    "seconds_to_target": lambda r: time_to_target(r)[1],  # training wall seconds (without evaluations) until then
    "max_grad_norm": lambda r: next((x for x in (r.quarter(k, None, "max") for k in (  # before clipping, of any update
        "optim/grad_norm_max", "optim/grad_norm")) if x == x), math.nan),
    "max_kl": lambda r: r.quarter("kl/k3", None, "max"),  # stale KL k3 (behavior vs updated policy) of any step
    "final_kl": lambda r: r.quarter("kl/k3"),  # stale KL k3 over the last quarter
    "final_engine_kl": lambda r: r.quarter("mismatch/k3"),  # engine KL k3 (rollout engine vs trainer), last quarter
    "ess": lambda r: r.quarter("is/ess", None),  # mean effective sample size of the sequence weights
    "log_w_min": lambda r: r.quarter("is/log_w_min", None, "min"),  # smallest sequence log-weight log W
    "log_w_max": lambda r: r.quarter("is/log_w_max", None, "max"),  # largest sequence log-weight log W
    "final_eos": lambda r: r.quarter("rollout/eos_rate"),  # share of responses ending with EOS, last quarter
    "warm_start": lambda r: r.before,  # held-out accuracy before training
    "seconds": lambda r: float(r.summary.get("seconds") or math.nan),  # the run's wall seconds
}
ROW_KEYS = ("step", "reward/mean", "kl/k3", "mismatch/k3", "is/ess", "is/log_w_min", "is/log_w_max",
            "optim/grad_norm", "optim/grad_norm_max", "optim/n_skipped", "perf/step_s", "rollout/eos_rate",
            "rollout/response_len", "policy/version", "staleness/lag_mean")


def time_to_target(run: Run, target: float = TARGET_REWARD, window: int = TARGET_WINDOW) -> tuple[float, float]:
    """(updates, seconds): the end of the first window of ``window`` updates whose mean training reward
    reaches ``target``, and the rows' perf/step_s summed up to it; nan for a run that never does."""
    done = np.array([int(r["step"]) * run.n for r in run.rows or []])
    rewards = pd.Series([r["reward/mean"] for r in run.rows or []])
    reached = rewards.groupby(np.ceil(done / window)).mean().loc[lambda s: s >= target]
    if reached.empty:
        return math.nan, math.nan
    end = min(reached.index[0] * window, done[-1])
    return float(end), sum(float(r.get("perf/step_s", math.nan)) for u, r in zip(done, run.rows) if u <= end)


def result(run: Run) -> dict:
    """A run's row of the table: status, collapse and METRICS (a broken policy scores 0)."""
    stopped = run.stopped_nonfinite
    c = collapse_of_rows(run.rows, run.n, run.before, stopped) if run.rows else \
        Collapse(True, "nonfinite", 1) if stopped else Collapse(False)
    stats = {k: f(run) if run.rows else math.nan for k, f in METRICS.items()}
    if c.reason == "nonfinite" and not run.summary.get("eval_after"):
        stats.update(eval_sampled=0.0, eval_greedy=0.0, eval_last=0.0, train_last=0.0)
    usable = run.status == "done" or (c.reason == "nonfinite" and stopped)
    return {"run": run.name, "status": run.status, "usable": usable,
            **run.lab["labels"], "n": run.n, "updates": run.updates, "collapsed": c.collapsed, "reason": c.reason,
            "collapse_update": c.update, "evidence": c.evidence, **stats, "start": start_of(run), "record": run}


def start_of(run: Run) -> str:
    """The shared on-policy start a run trained from, as its summary records it (the start's updates and its
    held-out sampled accuracy: every run of a seed that read the same cached start records the same two); "" for a
    run with no such start. Two runs of one seed with different starts did not start from the same weights."""
    return start_text(run.summary.get("warmstart") or {})


def start_text(stats: dict) -> str:
    """An on-policy start as a run's summary records it (its ``warmstart`` figures): "24 updates, 0.207"; "" where
    they hold none."""
    if "warmstart/updates" not in stats:
        return ""
    return f"{stats['warmstart/updates']:.0f} updates, {stats.get('warmstart/sampled_accuracy', math.nan):.3f}"


def read_lab(paths: list[str | Path]) -> tuple[dict[str, Sweep], pd.DataFrame]:
    """The sweeps by name and one table of all their runs, one row per run in grid order (column `sweep` names
    each run's)."""
    sweeps, frames = {}, []
    for path in paths:
        sweep, runs = read_sweep(path)
        if sweep.name in sweeps:
            raise ValueError(f"two sweep directories are named {sweep.name!r}: {sweeps[sweep.name].source} and {path}")
        if not runs:
            raise FileNotFoundError(f"{sweep.source or sweep.name}: no run directories yet")
        sweeps[sweep.name] = sweep
        frame = pd.DataFrame([result(r) for r in runs]).assign(sweep=sweep.name)
        order = [frame[a.label].astype(str).map({v: i for i, v in enumerate(a.values)}).fillna(len(a.values))
                 for a in sweep.axes]
        frames.append(frame.iloc[np.lexsort(order[::-1])])
    return sweeps, pd.concat(frames, ignore_index=True)


def read_sweep(path: str | Path) -> tuple[Sweep, list[Run]]:
    """A sweep's record and runs from its directory or its archive (a runs.json.gz, or a folder holding one);
    a run the sweep file has since excluded stays out."""
    path, archive = Path(path), Path(path) if Path(path).is_file() else Path(path) / ARCHIVE
    if (path / "sweep.json").is_file():
        sessions = read_jsonl(path / SESSIONS) if (path / SESSIONS).is_file() else []
        sweep = Sweep.from_record(json.loads((path / "sweep.json").read_text()), sessions)
        runs = [read_run(d) for d in sorted(path.iterdir()) if (d / LAB).is_file()]
    elif archive.is_file():
        body = read_archive_body(archive)
        sweep = Sweep.from_record({"source": str(archive), **body["record"]}, body["record"].get("sessions") or [])
        runs = [Run(**{**x, "summary": x["summary"] or {}}) for x in body["runs"]]
    else:
        raise FileNotFoundError(f"{path} is not a sweep directory: no sweep.json (run `vespo sweep` first) and no "
                                f"{ARCHIVE} archive")
    return sweep, [r for r in runs if not excluded(r.lab["labels"], sweep.exclude)]


def read_run(run_dir: Path) -> Run:
    lab = json.loads((run_dir / LAB).read_text())
    if "labels" not in lab:
        raise ValueError(f"{run_dir / LAB} has no 'labels'")
    return Run(**vars(read_run_files(run_dir)), name=run_dir.name, lab=lab)


def write_archive(sweep: Sweep, runs: list[Run], path: Path) -> Path:
    """The sweep's archive (gzip'd JSON with a fixed mtime: the same runs give the same bytes)."""
    body = {"format": ARCHIVE_FORMAT, "record": {**sweep.record(), "sessions": sweep.sessions},
            "runs": [{**archived(r), "summary": None if r.rows is None else r.summary, "rows": None if r.rows is None else
                      [{k: v for k, v in row.items() if k in ROW_KEYS or k.startswith("eval/")} for row in r.rows]}
                     for r in runs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(json.dumps(body, separators=(",", ":"), allow_nan=True).encode())
    return path


def archived(run: Run) -> dict:
    """A run's fields in the archive's order (name, lab, config, summary, eval_before, rows)."""
    return {"name": run.name, "lab": run.lab, **{k: v for k, v in vars(run).items() if k not in ("name", "lab")}}


def read_archive_body(path: Path) -> dict:
    """The archive's contents ({"format", "record", "runs"}), every run checked for the fields it must hold."""
    try:
        body = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a sweep archive ({ARCHIVE}): {e}") from None
    if not isinstance(body, dict) or body.get("format") != ARCHIVE_FORMAT:
        raise ValueError(f"{path}: unknown archive format {body.get('format') if isinstance(body, dict) else None!r} "
                         f"(this vespo reads format {ARCHIVE_FORMAT})")
    for i, item in enumerate(body["runs"]):
        missing = [f.name for f in fields(Run) if f.name not in item]  # an archived run holds Run's fields
        if missing or "labels" not in (item["lab"] or {}):
            raise ValueError(f"{path}: run {i + 1} lacks {missing or ['labels']}")
    return body


def write_run(item: dict, run_dir: Path) -> None:
    """The inverse of ``read_run`` for one run of an archive (lab.json last: it marks a run directory)."""
    run_dir.mkdir(parents=True)
    write_run_files(RunFiles(item["config"], item["summary"], item["eval_before"], item["rows"]), run_dir)
    (run_dir / LAB).write_text(json.dumps(item["lab"], indent=2))


def by_seed(runs: pd.DataFrame, metric: str) -> pd.Series:
    """{seed: value} of the usable runs of one condition."""
    return runs[runs.usable].set_index(SEED_AXIS)[metric].astype(float)


def select(runs: pd.DataFrame, where: dict) -> pd.DataFrame:
    """The runs whose labels match ``where`` ({axis: value or [values]})."""
    for axis, v in where.items():
        values = [str(x) for x in (v if isinstance(v, list) else [v])]
        runs = runs[runs[axis].isin(values)] if axis in runs else runs[:0]
    return runs


def conditions(sweep: Sweep, runs: pd.DataFrame, axes: list[str] | None = None,
               grid: bool = False) -> list[tuple[tuple, pd.DataFrame]]:
    """(labels, runs) per condition (the sweep's axes but the seed, or ``axes``), in grid order; ``grid``: the
    grid's conditions without runs too (no rows)."""
    axes = sweep.conditions if axes is None else axes
    if not axes:
        return [((), runs)]
    order = [{v: i for i, v in enumerate(sweep.values.get(a, []))} for a in axes]
    groups = {k: g for k, g in runs.groupby(axes, sort=False)}  # keys are tuples: grouped by a list
    for key in (tuple(p.labels[a] for a in axes) for p in sweep.points()) if grid else []:
        groups.setdefault(key, runs.iloc[:0])
    return sorted(groups.items(), key=lambda kg: tuple(o.get(v, len(o)) for o, v in zip(order, kg[0])))


def lr_text(lr: float) -> str:
    """5e-05 -> "5e-5", 0.00025 -> "2.5e-4"."""
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def lr_of(runs: pd.DataFrame) -> pd.Series:
    """Each run's learning rate: its config's optim.lr, else its lr label."""
    lr = runs.record.map(lambda r: float((r.config.get("optim") or {}).get("lr", math.nan)))
    return lr.fillna(pd.to_numeric(runs[LR_AXIS], errors="coerce"))


def lr_points(runs: pd.DataFrame) -> pd.DataFrame:
    """Per learning rate (ascending): usable runs, runs not finished, collapsed runs."""
    out = runs.assign(lr_value=lr_of(runs), dead=runs.collapsed & runs.usable).groupby("lr_value").agg(
        runs=("usable", "sum"), total=("usable", "size"), collapsed=("dead", "sum"))
    return out.assign(missing=out.total - out.runs)
