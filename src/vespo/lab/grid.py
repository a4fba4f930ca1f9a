"""Sweep files: a base config plus a grid of overrides, expanded into one run per grid point.

A sweep file (YAML):

    name: staleness
    base: ../demo.yaml             # a config file (relative to this file) or an inline mapping
    overrides: [task.name=reverse]  # applied to every run
    grid:                           # the runs are the Cartesian product of the axes, in this order
      loss.name: [grpo, gspo, sapo, vespo]       # a config field and its values
      staleness.n: [1, 8, 32]
      variant:                                   # or a named axis: label -> list of overrides
        asym: [loss.options.k_pos=2.0, loss.options.lambda_pos=3.0]
        sym: [loss.options.k_pos=2.0, loss.options.lambda_pos=2.0]
      run.seed: [0, 1, 2]

Each grid point gets labels (axis label -> value) and a directory name built from them, e.g.
``loss=vespo,N=32,seed=0``. Axis labels: ``loss.name`` -> loss, ``staleness.n`` -> N,
``run.seed`` -> seed, any other field -> its dotted name, a named axis -> its own name.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vespo.errors import UserError

SHORT = {"loss.name": "loss", "staleness.n": "N", "run.seed": "seed", "run.mode": "mode"}
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


@dataclass
class Sweep:
    name: str
    base: dict  # the base config as plain data
    overrides: list[str]
    axes: list[Axis]
    source: str = ""  # the sweep file, for error messages

    def points(self) -> list["GridPoint"]:
        """Every grid point, in row-major order of the axes."""
        out = []
        for combo in itertools.product(*(range(len(a.values)) for a in self.axes)):
            labels, overrides = {}, list(self.overrides)
            for axis, i in zip(self.axes, combo):
                value, ov = axis.pick(i)
                labels[axis.label] = value
                overrides += ov
            out.append(GridPoint(labels, overrides))
        return out


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
    unknown = set(data) - {"name", "base", "overrides", "grid", "description"}
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {sorted(unknown)}; valid: base, description, grid, name, overrides")
    return Sweep(name=str(data.get("name") or path.stem), base=_base(data.get("base"), path),
                 overrides=_str_list(data.get("overrides", []), f"{path}: overrides"),
                 axes=_axes(data.get("grid"), path), source=str(path))


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
