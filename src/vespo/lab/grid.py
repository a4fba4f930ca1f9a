"""Sweep files: a base config plus a grid of overrides, expanded into one run per grid point.

A sweep file (YAML):

    name: staleness
    description: "why the grid is what it is"   # printed above the sweep's tables (optional)
    base: ../demo.yaml             # a config file (relative to this file) or an inline mapping
    overrides: [task.name=reverse]  # applied to every run
    reference: {loss: vespo}        # the condition every other is paired against, per seed (optional)
    cost: {run_s: 65, jobs: 2, note: "why"}   # wall seconds of one run when `jobs` share the machine
                                    # (optional: true = outside the lab's time budget)
    grid:                           # the runs are the Cartesian product of the axes, in this order
      loss.name: [grpo, gspo, sapo, vespo]       # a config field and its values
      staleness.n: [1, 8, 32]
      variant:                                   # or a named axis: label -> list of overrides
        asym: [loss.options.k_pos=2.0, loss.options.lambda_pos=3.0]
        sym: [loss.options.k_pos=2.0, loss.options.lambda_pos=2.0]
      run.seed: [0, 1, 2]
    exclude:                        # grid points left out: any point matching one entry (optional)
      - {loss: [gspo, sapo], seed: ["5", "6", "7", "8", "9"]}    # e.g. 5 seeds for some losses, 10 for others

Each grid point gets labels (axis label -> value) and a directory name built from them, e.g.
``loss=vespo,N=32,seed=0``. Axis labels: ``loss.name`` -> loss, ``staleness.n`` -> N,
``run.seed`` -> seed, ``optim.lr`` -> lr, ``model.arch`` -> model, ``loss.options.length_norm`` ->
length_norm, any other field -> its dotted name, a named axis -> its own name.

``reference`` names one value of one axis (default: ``loss: vespo`` when the grid has that value):
`vespo report` gives every other value's difference from it, seed by seed. ``cost`` is the sweep
file's own assumption of what one run costs, which `vespo sweep --dry-run` turns into an expected
wall time.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vespo.errors import UserError

SHORT = {"loss.name": "loss", "staleness.n": "N", "run.seed": "seed", "run.mode": "mode", "optim.lr": "lr",
         "model.arch": "model", "loss.options.length_norm": "length_norm"}
KEYS = ("base", "cost", "description", "exclude", "grid", "name", "overrides", "reference")
SEED_AXIS = "seed"


class SweepError(UserError, ValueError):
    """A sweep file is malformed; the message names the file and the key."""


@dataclass
class Axis:
    label: str  # "loss", "N", "seed", "variant", ...
    values: list[str]  # value labels, in the file's order
    overrides: list[list[str]]  # overrides of each value

    def pick(self, i: int) -> tuple[str, list[str]]:
        return self.values[i], self.overrides[i]


@dataclass(frozen=True)
class Cost:
    """The sweep file's assumption of the cost of one run (not a measurement)."""

    run_s: float  # wall seconds of one run ...
    jobs: int  # ... when this many runs share the machine (`--jobs`)
    note: str = ""  # what the number rests on
    optional: bool = False  # outside the lab's time budget

    def wall_s(self, runs: int) -> float:
        return runs * self.run_s / self.jobs


@dataclass
class Sweep:
    name: str
    base: dict  # the base config as plain data
    overrides: list[str]
    axes: list[Axis]
    source: str = ""  # the sweep file, for error messages
    reference: dict[str, str] = field(default_factory=dict)  # {axis label: value} paired against, or {}
    cost: Cost | None = None
    exclude: list[dict[str, list[str]]] = field(default_factory=list)  # points matching one entry are left out
    description: str = ""  # the file's own words on its grid, printed above the sweep's tables

    def points(self) -> list[GridPoint]:
        """Every grid point not excluded, in row-major order of the axes."""
        out = []
        for combo in itertools.product(*(range(len(a.values)) for a in self.axes)):
            labels, overrides = {}, list(self.overrides)
            for axis, i in zip(self.axes, combo):
                value, ov = axis.pick(i)
                labels[axis.label] = value
                overrides += ov
            if not excluded(labels, self.exclude):
                out.append(GridPoint(labels, overrides))
        return out


def excluded(labels: dict[str, str], exclude: list[dict[str, list[str]]]) -> bool:
    """Whether a grid point's labels match one of the sweep's ``exclude`` entries."""
    return any(all(labels.get(axis) in values for axis, values in entry.items()) for entry in exclude)


def planned(record: dict) -> int:
    """How many runs a sweep directory's grid (its sweep.json record) holds, exclusions left out."""
    axes = record["axes"]
    combos = itertools.product(*(a["values"] for a in axes))
    return sum(not excluded(dict(zip([a["label"] for a in axes], c)), record.get("exclude", [])) for c in combos)


@dataclass
class GridPoint:
    labels: dict[str, str]  # axis label -> value label
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return ",".join(f"{k}={_safe(v)}" for k, v in self.labels.items())


def _safe(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", str(value))


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file; a relative ``base`` path is taken from the sweep file's folder."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise SweepError(f"{path}: the top level must be a mapping")
    unknown = set(data) - set(KEYS)
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {sorted(unknown)}; valid: {', '.join(KEYS)}")
    axes = _axes(data.get("grid"), path)
    return Sweep(name=str(data.get("name") or path.stem), base=_base(data.get("base"), path),
                 overrides=_str_list(data.get("overrides", []), f"{path}: overrides"), axes=axes, source=str(path),
                 reference=_reference(data.get("reference"), axes, path), cost=_cost(data.get("cost"), path),
                 exclude=_exclude(data.get("exclude"), axes, path),
                 description=_description(data.get("description"), path))


def _base(base: Any, path: Path) -> dict:
    if base is None:
        return {}
    if isinstance(base, dict):
        return base
    if not isinstance(base, str):
        raise SweepError(f"{path}: base must be a config path or a mapping, got {base!r}")
    file = (path.parent / base) if not Path(base).is_absolute() else Path(base)
    if not file.is_file():
        raise SweepError(f"{path}: base config not found: {file}")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise SweepError(f"{file}: the top level must be a mapping of sections")
    return data


def _axes(grid: Any, path: Path) -> list[Axis]:
    if not isinstance(grid, dict) or not grid:
        raise SweepError(f"{path}: grid must be a non-empty mapping of axes")
    axes = []
    for key, spec in grid.items():
        if isinstance(spec, list) and spec:
            values = [_label(v) for v in spec]
            axes.append(Axis(SHORT.get(key, key), values, [[f"{key}={_yaml_value(v)}"] for v in spec]))
        elif isinstance(spec, dict) and spec:
            axes.append(Axis(str(key), [str(k) for k in spec],
                             [_str_list(v, f"{path}: grid.{key}.{k}") for k, v in spec.items()]))
        else:
            raise SweepError(f"{path}: grid.{key} must be a non-empty list of values or a mapping label -> overrides")
    labels = [a.label for a in axes]
    if len(set(labels)) != len(labels):
        raise SweepError(f"{path}: two grid axes share a label: {labels}")
    return axes


def _reference(ref: Any, axes: list[Axis], path: Path) -> dict[str, str]:
    values = {a.label: a.values for a in axes}
    if ref is None:
        return {"loss": "vespo"} if "vespo" in values.get("loss", []) else {}
    if not isinstance(ref, dict) or len(ref) != 1:
        raise SweepError(f"{path}: reference must be one 'axis: value' pair, e.g. {{loss: vespo}}; got {ref!r}")
    (axis, value), = ref.items()
    if axis not in values or str(value) not in values[axis]:
        raise SweepError(f"{path}: reference {axis}={value} is not a value of a grid axis; axes: {values}")
    return {axis: str(value)}


def _exclude(exclude: Any, axes: list[Axis], path: Path) -> list[dict[str, list[str]]]:
    if exclude is None:
        return []
    values = {a.label: a.values for a in axes}
    if not isinstance(exclude, list) or not all(isinstance(e, dict) and e for e in exclude):
        raise SweepError(f"{path}: exclude must be a list of {{axis: value or [values]}} mappings, got {exclude!r}")
    out = []
    for i, entry in enumerate(exclude):
        checked = {}
        for axis, v in entry.items():
            vs = [_label(x) for x in (v if isinstance(v, list) else [v])]
            bad = [x for x in vs if x not in values.get(axis, [])]
            if axis not in values or bad:
                raise SweepError(f"{path}: exclude[{i}]: {axis}={bad or vs} is not on the grid; axes: {values}")
            checked[axis] = vs
        out.append(checked)
    return out


def _description(description: Any, path: Path) -> str:
    if description is None:
        return ""
    if not isinstance(description, str):
        raise SweepError(f"{path}: description must be text, got {description!r}")
    return " ".join(description.split())


def _cost(cost: Any, path: Path) -> Cost | None:
    if cost is None:
        return None
    if not isinstance(cost, dict) or set(cost) - {"run_s", "jobs", "note", "optional"} or "run_s" not in cost:
        raise SweepError(f"{path}: cost must be a mapping with run_s (and optional jobs, note, optional), got {cost!r}")
    run_s, jobs = cost["run_s"], cost.get("jobs", 1)
    if not isinstance(run_s, (int, float)) or run_s <= 0 or not isinstance(jobs, int) or jobs < 1:
        raise SweepError(f"{path}: cost.run_s must be a number > 0 and cost.jobs an integer >= 1, got {cost!r}")
    return Cost(float(run_s), jobs, str(cost.get("note", "")), bool(cost.get("optional", False)))


def budget_table(paths: list[Path], repo: Path, out_root: str = "runs/lab") -> tuple[str, float]:
    """(markdown table, minutes of the budgeted sweeps): per sweep file (its path shown relative to
    ``repo``) its command, runs, assumed cost per run and expected wall time, from the files' `cost`;
    optional sweeps are marked and left out of the total."""
    rows, total = [], 0.0
    for path in paths:
        sweep = load_sweep(path)
        if sweep.cost is None:
            continue
        c, runs = sweep.cost, len(sweep.points())
        minutes = c.wall_s(runs) / 60
        total += 0.0 if c.optional else minutes
        rows.append(f"| `{sweep.name}`{' (optional)' if c.optional else ''} | `vespo sweep {path.relative_to(repo).as_posix()} --out "
                    f"{out_root}/{sweep.name} --jobs {c.jobs}` | {runs} | {c.run_s:g} s, {c.jobs} at a time | "
                    f"{minutes:.0f} min |")
    head = ["| sweep | command | runs | assumed per run | expected wall |", "| --- | --- | --- | --- | --- |"]
    tail = f"| total, without the optional sweeps | | | | {total:.0f} min = {total / 60:.1f} h |"
    return "\n".join(head + rows + [tail]), total


def _label(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip() \
        if isinstance(value, (dict, list)) else str(value)


def _yaml_value(value: Any) -> str:
    if isinstance(value, (dict, list, bool)) or value is None:
        return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return str(value)


def _str_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise SweepError(f"{where} must be a list of 'section.field=value' strings, got {value!r}")
    return list(value)
