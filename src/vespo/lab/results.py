"""A sweep directory's results: one RunResult per run, its scalar results, and conditions of runs.

    record, results = read_sweep("runs/staleness")
    cells = group(results, conditions(record))            {("vespo", "32"): [RunResult per seed], ...}
    by_seed(cells[("vespo", "32")], "eval_sampled")       {"0": 0.61, "1": 0.55, ...}

What "final" means (the same at every N under the paper's protocol of equal optimizer steps):

    eval_sampled   held-out accuracy after the last update, one sample per problem at the training
                   temperature, on task.eval_size problems (summary.json eval_after.reward_sampled)
    eval_greedy    the same with greedy decoding
    train_last     training reward over the rollout steps whose samples were drawn in the last
                   quarter of the run's optimizer steps: the same number of samples at every N
                   when N divides a quarter of the run

Beside "final", the speed to get there (time to accuracy): the optimizer steps and the training
wall time until the training reward, averaged over a window of 64 updates (the same samples at
every N), first reaches TARGET_REWARD; nan for a run that never does.

A run the trainer stopped for non-finite updates has no evaluation; it counts as reward 0 (its
policy is broken). A run that failed otherwise, or has not finished, is left out of the statistics
and listed as such.

A sweep's **archive** (runs.json.gz, which `vespo report --page` writes beside each sweep's report)
holds what the lab reads of every run: lab.json, config.yaml, summary.json, eval_before.json and
the ARCHIVED metrics of each logged row, plus sweep.json and sessions.jsonl. Run directories hold
checkpoints and are not committed; the archive is, so the page can be regenerated from it later
(`vespo report docs/results/staleness ...`) and sweeps run in different sessions combined.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vespo.lab.collapse import RULE, Collapse, collapse_of_rows
from vespo.lab.grid import SEED_AXIS, excluded
from vespo.metrics import read_jsonl
from vespo.plot import Run, load_run

ARCHIVE = "runs.json.gz"
ARCHIVE_FORMAT = 1
ARCHIVED = ("step", "reward/mean", "kl/k3", "mismatch/k3", "is/ess", "is/log_w_min", "is/log_w_max",
            "optim/grad_norm", "optim/grad_norm_max", "optim/n_skipped", "perf/step_s",
            "rollout/eos_rate", "rollout/response_len", "policy/version", "staleness/lag_mean")
# ... and every held-out evaluation logged during training (keys starting with this)
ARCHIVED_PREFIX = "eval/"

LAST_SHARE = 0.25  # train_last: the last quarter of the optimizer steps
TARGET_REWARD = 0.6  # time to accuracy: the training reward to reach
TARGET_WINDOW = RULE.every  # ... averaged over windows of this many updates

METRICS = {  # name -> what it is (the report's definitions)
    "eval_sampled": "held-out accuracy after the last update, one sample per problem",
    "eval_greedy": "held-out accuracy after the last update, greedy",
    "train_last": "training reward over the last quarter of the optimizer steps",
    "best_reward": "best training reward of a rollout step",
    "collapsed": "1 if the run collapsed, else 0",
    "updates_to_target": f"optimizer steps until the training reward over a window of {TARGET_WINDOW} updates "
                         f"first reaches {TARGET_REWARD:g}",
    "seconds_to_target": "training wall seconds (without evaluations) until then",
    "max_grad_norm": "largest gradient norm (before clipping) of any update",
    "max_kl": "largest per-step stale KL k3 (behavior policy vs the updated policy)",
    "final_kl": "stale KL k3 over the last quarter",
    "final_engine_kl": "engine KL k3 (rollout engine vs trainer) over the last quarter",
    "ess": "mean effective sample size of the sequence weights",
    "log_w_min": "smallest sequence log-weight log W",
    "log_w_max": "largest sequence log-weight log W",
    "final_eos": "share of responses ending with EOS over the last quarter",
}


@dataclass
class RunResult:
    name: str
    labels: dict[str, str]
    status: str  # done, interrupted, failed, unfinished
    run: Run | None  # None when the run wrote no metrics
    collapse: Collapse
    stats: dict[str, float] = field(default_factory=dict)  # METRICS of this run ({} if none)
    config: dict = field(default_factory=dict)  # the run's resolved config.yaml ({} if absent)
    lab: dict = field(default_factory=dict)  # its lab.json (labels, overrides, exit status)
    eval_before: dict = field(default_factory=dict)  # its eval_before.json ({} if absent)

    @property
    def usable(self) -> bool:
        """Counted in the statistics: finished, or stopped for non-finite updates (reward 0)."""
        return self.status == "done" or (self.collapse.reason == "nonfinite" and bool(self.stats))

    @property
    def seed(self) -> str:
        return self.labels.get(SEED_AXIS, "")


# ---------------------------------------------------------------- reading


def read_sweep(path: str | Path) -> tuple[dict, list[RunResult]]:
    """A sweep's record (sweep.json plus its sessions) and one RunResult per run of its grid, in grid order, from a
    sweep directory or from its archive (a runs.json.gz file, or a report folder holding one)."""
    path = Path(path)
    if not (path / "sweep.json").is_file():
        archive = path if path.is_file() else path / ARCHIVE
        if archive.is_file():
            return read_archive(archive)
        raise FileNotFoundError(f"{path} is not a sweep directory: no sweep.json (run `vespo sweep` first) and "
                                f"no {ARCHIVE} archive")
    record = json.loads((path / "sweep.json").read_text())
    record["dir"] = str(path)
    record["sessions"] = read_sessions(path)
    # a run directory of a grid point the sweep file has since excluded stays on disk but out of the results
    labs = {d: read_lab(d) for d in sorted(path.iterdir()) if (d / "lab.json").is_file()}
    results = [read_run(d, lab) for d, lab in labs.items() if not excluded(lab["labels"], record.get("exclude", []))]
    return record, _in_grid_order(record, results, path)


def _in_grid_order(record: dict, results: list[RunResult], where: Path) -> list[RunResult]:
    if not results:
        raise FileNotFoundError(f"{where}: no run directories yet")
    axes = [a["label"] for a in record["axes"]]
    return sorted(results, key=lambda r: order(record, axes, tuple(r.labels.get(a) for a in axes)))


def read_sessions(sweep_dir: Path) -> list[dict]:
    path = sweep_dir / "sessions.jsonl"
    return read_jsonl(path) if path.is_file() else []


def read_lab(run_dir: Path) -> dict:
    """A run directory's lab.json (its grid labels and how the sweep ran it), without its metrics."""
    lab = json.loads((run_dir / "lab.json").read_text())
    if "labels" not in lab:
        raise ValueError(f"{run_dir / 'lab.json'} has no 'labels'")
    return lab


def read_run(run_dir: Path, lab: dict) -> RunResult:
    """A run's result from its directory, given its lab.json (read_lab)."""
    run = load_run(run_dir) if (run_dir / "metrics.jsonl").is_file() else None
    config = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}) if (run_dir / "config.yaml").is_file() else {}
    return run_result(run_dir.name, lab, run, config, _eval_before(run_dir))


def run_result(name: str, lab: dict, run: Run | None, config: dict, eval_before: dict) -> RunResult:
    """A run's result from what its directory (or the sweep's archive) holds."""
    stopped = bool(lab.get("stopped_nonfinite"))
    status = _status(lab, run)
    if run is None or not run.rows:
        collapse = Collapse(True, "nonfinite", 1) if stopped else Collapse(False)
        stats = _dead_run_stats() if stopped else {}
        return RunResult(name, lab["labels"], status, None, collapse, stats, config, lab, eval_before)
    before = (run.summary.get("eval_before") or eval_before).get("reward_sampled")
    collapse = collapse_of_rows(run.rows, run.updates_per_step, before, stopped)
    return RunResult(name, lab["labels"], status, run, collapse, run_stats(run, collapse), config, lab, eval_before)


# ---------------------------------------------------------------- the archive


def write_archive(record: dict, results: list[RunResult], path: Path) -> Path:
    """The sweep's archive at ``path`` (gzip'd JSON, written with a fixed mtime so that the same runs give
    the same bytes)."""
    keep = set(ARCHIVED)
    runs = [{"name": r.name, "lab": r.lab, "config": r.config,
             "summary": r.run.summary if r.run is not None else None,
             "eval_before": r.eval_before,
             "rows": None if r.run is None else [{k: v for k, v in row.items()
                                                  if k in keep or k.startswith(ARCHIVED_PREFIX)} for row in r.run.rows]}
            for r in results]
    body = {"format": ARCHIVE_FORMAT, "record": {k: v for k, v in record.items() if k != "dir"}, "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(body, separators=(",", ":"), allow_nan=True).encode()
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(data)
    return path


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
        missing = [k for k in ("name", "lab", "config", "summary", "eval_before", "rows") if k not in item]
        if missing or "labels" not in (item.get("lab") or {}):
            raise ValueError(f"{path}: run {i + 1} lacks {missing or ['lab.labels']}")
    return body


def read_archive(path: Path) -> tuple[dict, list[RunResult]]:
    body = read_archive_body(path)
    record = {**body["record"], "dir": str(path)}
    results = []
    for item in body["runs"]:
        rows = item["rows"]
        run = None if rows is None else Run(path / item["name"], rows, item["summary"] or {}, item["config"])
        results.append(run_result(item["name"], item["lab"], run, item["config"], item["eval_before"]))
    return record, _in_grid_order(record, results, path)


def write_run(item: dict, run_dir: Path) -> None:
    """The inverse of ``read_run`` for one run of an archive: its directory with the files the lab reads
    (config.yaml, summary.json, eval_before.json, metrics.jsonl with the archived metrics, and lab.json
    last, the file that marks the directory as a run)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(item["config"], sort_keys=False))
    if item["summary"]:
        (run_dir / "summary.json").write_text(json.dumps(item["summary"], indent=2))
    if item["eval_before"]:
        (run_dir / "eval_before.json").write_text(json.dumps(item["eval_before"], indent=2))
    if item["rows"] is not None:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in item["rows"]))
    (run_dir / "lab.json").write_text(json.dumps(item["lab"], indent=2))


def _eval_before(run_dir: Path) -> dict:
    path = run_dir / "eval_before.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _status(lab: dict, run: Run | None) -> str:
    if lab.get("returncode", 0) != 0:
        return "failed"
    if run is not None and run.summary.get("status") in ("done", "interrupted"):
        return run.summary["status"]
    return "unfinished"


# ---------------------------------------------------------------- per-run results


def planned_updates(run: Run) -> int:
    """The run's length in optimizer steps: run.steps x N from its config, else what it logged."""
    steps = (run.config.get("run") or {}).get("steps") or len(run.rows)
    return int(steps) * run.updates_per_step


def update_axis(run: Run) -> list[int]:
    """Per logged row, the optimizer steps taken before its samples were trained: (step - 1) x N."""
    return run.curve("step", x="updates")[0]


def last_share_mean(run: Run, key: str, share: float = LAST_SHARE) -> float:
    """Mean of a metric over the rows trained in the last ``share`` of the run's optimizer steps."""
    start = (1.0 - share) * planned_updates(run)
    values = [float(r[key]) for x, r in zip(update_axis(run), run.rows) if x >= start - 1e-9 and key in r]
    return _mean(values)


def run_stats(run: Run, collapse: Collapse) -> dict[str, float]:
    """The METRICS of one run."""
    rows = run.rows
    after = run.summary.get("eval_after") or {}
    stats = {
        "eval_sampled": float(after.get("reward_sampled", math.nan)),
        "eval_greedy": float(after.get("reward_greedy", math.nan)),
        "train_last": last_share_mean(run, "reward/mean"),
        "best_reward": max(float(r["reward/mean"]) for r in rows),
        "collapsed": float(collapse.collapsed),
        **time_to_target(run),
        "max_grad_norm": _max(rows, "optim/grad_norm_max", "optim/grad_norm"),
        "max_kl": _max(rows, "kl/k3"),
        "final_kl": last_share_mean(run, "kl/k3"),
        "final_engine_kl": last_share_mean(run, "mismatch/k3"),
        "ess": _mean([float(r["is/ess"]) for r in rows if "is/ess" in r]),
        "log_w_min": min((float(r["is/log_w_min"]) for r in rows if "is/log_w_min" in r), default=math.nan),
        "log_w_max": max((float(r["is/log_w_max"]) for r in rows if "is/log_w_max" in r), default=math.nan),
        "final_eos": last_share_mean(run, "rollout/eos_rate"),
    }
    if collapse.reason == "nonfinite" and not after:  # stopped by the trainer: a broken policy scores 0
        stats.update(eval_sampled=0.0, eval_greedy=0.0, train_last=0.0)
    return stats


def time_to_target(run: Run, target: float = TARGET_REWARD, window: int = TARGET_WINDOW) -> dict[str, float]:
    """updates_to_target and seconds_to_target: the end of the first window of ``window`` updates whose
    mean training reward reaches ``target``, and the rows' perf/step_s summed up to it."""
    updates = [x + run.updates_per_step for x in update_axis(run)]  # updates done after each row
    windows: dict[int, list[float]] = {}
    for u, row in zip(updates, run.rows):
        windows.setdefault(math.ceil(u / window), []).append(float(row["reward/mean"]))
    for w in sorted(windows):
        if _mean(windows[w]) >= target:
            end = min(w * window, updates[-1])
            seconds = sum(float(r.get("perf/step_s", math.nan)) for u, r in zip(updates, run.rows) if u <= end)
            return {"updates_to_target": float(end), "seconds_to_target": seconds}
    return {"updates_to_target": math.nan, "seconds_to_target": math.nan}


def _dead_run_stats() -> dict[str, float]:
    return {**{k: math.nan for k in METRICS}, "eval_sampled": 0.0, "eval_greedy": 0.0, "train_last": 0.0,
            "collapsed": 1.0}


def _max(rows: list[dict], key: str, fallback: str | None = None) -> float:
    values = [float(r[key]) for r in rows if key in r]
    if not values and fallback:
        values = [float(r[fallback]) for r in rows if fallback in r]
    return max(values, default=math.nan)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


# ---------------------------------------------------------------- conditions


def conditions(record: dict) -> list[str]:
    """The axes that define a condition: every grid axis except the seed."""
    return [a["label"] for a in record["axes"] if a["label"] != SEED_AXIS]


def group(results: list[RunResult], axes: list[str]) -> dict[tuple, list[RunResult]]:
    """Runs by condition (their labels on ``axes``), in the order they come."""
    out: dict[tuple, list[RunResult]] = {}
    for r in results:
        out.setdefault(tuple(r.labels.get(a) for a in axes), []).append(r)
    return out


def order(record: dict, axes: list[str], key: tuple) -> tuple:
    """Sort key of a condition: the grid's order of each axis's values."""
    values = {a["label"]: a["values"] for a in record["axes"]}
    return tuple(values[a].index(k) if k in values.get(a, []) else len(values.get(a, [])) for a, k in zip(axes, key))


def by_seed(runs: list[RunResult], metric: str) -> dict[str, float]:
    """{seed: value} of the usable runs of one condition."""
    return {r.seed: r.stats.get(metric, math.nan) for r in runs if r.usable}


def select(record: dict, results: list[RunResult], where: dict[str, object]) -> list[RunResult]:
    """The runs whose labels match ``where`` ({axis: value or [values]}); unknown axes or values are named."""
    values = {a["label"]: a["values"] for a in record["axes"]}
    wanted = {}
    for axis, v in where.items():
        if axis not in values:
            raise ValueError(f"sweep {record['name']!r} has no axis {axis!r}; axes: {list(values)}")
        vs = [str(x) for x in (v if isinstance(v, list) else [v])]
        bad = [x for x in vs if x not in values[axis]]
        if bad:
            raise ValueError(f"sweep {record['name']!r}: {axis}={bad} not in the grid's values {values[axis]}")
        wanted[axis] = set(vs)
    return [r for r in results if all(r.labels.get(a) in vs for a, vs in wanted.items())]
