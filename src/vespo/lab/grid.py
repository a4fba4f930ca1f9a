"""Sweep files (docs/lab.md, Sweep files): a base config plus a grid of overrides, expanded into one run per grid
point, with an optional reference condition, cost assumption, excluded points, description and sizing (the
seeds the report asks for, from the paired SD of those run so far). A sweep directory's sweep.json is
``Sweep.record()``, read back by ``Sweep.from_record``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

from vespo.config import load_yaml
from vespo.errors import UserError

SHORT = {"loss.name": "loss", "staleness.n": "N", "run.seed": "seed", "run.mode": "mode", "optim.lr": "lr",
         "model.arch": "model", "loss.options.length_norm": "length_norm"}
SEED_AXIS = "seed"
RECORD = ("name", "source", "overrides", "axes", "reference", "exclude", "description", "sizing")  # sweep.json
OMITTED = ("description", "sizing")  # left out of the record when empty (a record made before them reads the same)


class SweepError(UserError, ValueError):
    """A sweep file is malformed; the message names the file and the key."""


def one_line(e: ValidationError) -> str:
    """A pydantic error in one line: the first problem, at its dotted place."""
    first = e.errors()[0]
    return ".".join(str(x) for x in first["loc"]) + ": " + first["msg"]


def _override(x: str) -> str:
    if "=" not in x:
        raise ValueError(f"{x!r} is not a 'section.field=value' override")
    return x


Override = Annotated[str, AfterValidator(_override)]


class Cost(BaseModel):
    """The sweep file's assumption of the cost of one run (not a measurement)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    run_s: PositiveFloat  # wall seconds of one run ...
    jobs: PositiveInt = 1  # ... when this many runs share the machine (`--jobs`)
    note: str = ""
    optional: bool = False  # outside the lab's time budget

    def wall_s(self, runs: int) -> float:
        return runs * self.run_s / self.jobs


class Sizing(BaseModel):
    """How many seeds the report asks for (vespo.lab.stats.seeds_needed): enough for a two-sided paired t-test at
    ``alpha`` to detect a difference of ``delta`` from the reference with ``power``, given the paired SD the
    seeds run so far show (docs/lab.md, "The real-model stability sweep")."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    delta: PositiveFloat  # the smallest |difference| on the report's headline metric worth detecting
    power: float = Field(0.8, gt=0, lt=1)
    alpha: float = Field(0.05, gt=0, lt=1)  # two-sided


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    description: str = ""
    base: str | dict = {}
    overrides: list[Override] = []
    reference: Annotated[dict[str, Any], Field(min_length=1, max_length=1)] | None = None  # one axis: value
    cost: Cost | None = None
    sizing: Sizing | None = None
    grid: Annotated[dict[str, Any], Field(min_length=1)]
    exclude: list[dict[str, Any]] = []


@dataclass
class Axis:
    label: str  # "loss", "N", "seed", ...
    values: list[str]  # value labels, in the file's order
    overrides: list[list[str]] = field(default_factory=list)  # overrides of each value

    def __post_init__(self):
        self.overrides = self.overrides or [[] for _ in self.values]  # none given (a record may leave them out)


@dataclass
class GridPoint:
    labels: dict[str, str]  # axis label -> value label
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return ",".join(f"{k}={re.sub(r'[^A-Za-z0-9_.+-]', '_', v)}" for k, v in self.labels.items())


@dataclass
class Sweep:
    name: str
    axes: list[Axis]
    base: dict = field(default_factory=dict)  # the base config as plain data
    overrides: list[str] = field(default_factory=list)
    source: str = ""  # the sweep file
    reference: dict[str, str] = field(default_factory=dict)  # {axis: value} paired against, or {}
    cost: Cost | None = None
    exclude: list[dict[str, list[str]]] = field(default_factory=list)
    description: str = ""
    sizing: Sizing | None = None  # the seed count to ask for, or None
    sessions: list[dict] = field(default_factory=list)  # its directory's sessions.jsonl (vespo.sweep.provenance)

    @property
    def values(self) -> dict[str, list[str]]:
        return {a.label: a.values for a in self.axes}

    @property
    def conditions(self) -> list[str]:
        """The axes that define a condition: every grid axis except the seed."""
        return [a.label for a in self.axes if a.label != SEED_AXIS]

    def points(self) -> list[GridPoint]:
        """Every grid point not excluded, in row-major order of the axes."""
        points = (GridPoint({a.label: a.values[i] for a, i in zip(self.axes, combo)},
                            self.overrides + [o for a, i in zip(self.axes, combo) for o in a.overrides[i]])
                  for combo in itertools.product(*(range(len(a.values)) for a in self.axes)))
        return [p for p in points if not excluded(p.labels, self.exclude)]

    def record(self) -> dict:
        data = asdict(self) | {"sizing": self.sizing and self.sizing.model_dump()}
        return {k: data[k] for k in RECORD if k not in OMITTED or data[k]}

    @classmethod
    def from_record(cls, r: dict, sessions: list[dict] | None = None) -> Sweep:
        given = {k: r[k] for k in RECORD if r.get(k) is not None}
        sizing = {"sizing": Sizing(**given["sizing"])} if "sizing" in given else {}
        return cls(**(given | sizing | {"axes": [Axis(**a) for a in r["axes"]]}), sessions=sessions or [])


def off_grid(values: dict[str, list[str]], where: dict) -> str:
    """What of ``where`` ({axis: value or [values]}) a grid with these axes and values lacks; "" if nothing."""
    for axis, v in where.items():
        bad = sorted({str(x) for x in (v if isinstance(v, list) else [v])} - set(values.get(axis, [])))
        if axis not in values or bad:
            return f"{axis}={bad} is not on the grid; axes: {values}"
    return ""


def excluded(labels: dict[str, str], exclude: list[dict[str, list[str]]]) -> bool:
    return any(all(labels.get(axis) in values for axis, values in entry.items()) for entry in exclude)


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file; a relative ``base`` path is taken from the sweep file's folder."""
    path = Path(path)
    try:
        f = _File.model_validate(load_yaml(path, "sweep", SweepError))
    except ValidationError as e:
        raise SweepError(f"{path}: {one_line(e)}") from None
    if isinstance(f.base, str):
        if not (path.parent / f.base).is_file():
            raise SweepError(f"{path}: base config not found: {path.parent / f.base}")
        f.base = load_yaml(path.parent / f.base, "base config", SweepError)
    axes = _axes(f.grid, path)
    values = {a.label: a.values for a in axes}
    if f.reference is None:  # by default, VESPO where the grid has it
        f.reference = {"loss": "vespo"} if "vespo" in values.get("loss", []) else {}
    reference = {axis: str(value) for axis, value in f.reference.items()}
    exclude = [{axis: [_label(x) for x in (v if isinstance(v, list) else [v])] for axis, v in e.items()}
               for e in f.exclude]
    for where, entry in [("reference", reference), *((f"exclude[{i}]", e) for i, e in enumerate(exclude))]:
        if bad := off_grid(values, entry):
            raise SweepError(f"{path}: {where}: {bad}")
    if f.sizing is not None and (not reference or len(values.get(SEED_AXIS, [])) < 2):
        raise SweepError(f"{path}: sizing: it pairs each condition with the reference on shared seeds, and this sweep "
                         + ("has no reference (give `reference: {axis: value}`)" if not reference else
                            f"has {len(values.get(SEED_AXIS, []))} seed(s) on its grid (run.seed needs at least 2)"))
    return Sweep(f.name or path.stem, axes, f.base, f.overrides, str(path), reference, f.cost, exclude,
                 " ".join(f.description.split()), f.sizing)


def _axes(grid: dict, path: Path) -> list[Axis]:
    axes = []
    for key, spec in grid.items():
        if not spec or not isinstance(spec, (list, dict)):
            raise SweepError(f"{path}: grid.{key} must be a non-empty list of values or a mapping label -> overrides")
        if isinstance(spec, list):
            axes.append(Axis(SHORT.get(key, key), [_label(v) for v in spec],
                             [[f"{key}={_label(v, True)}"] for v in spec]))
            continue
        for k, v in spec.items():
            if not isinstance(v, list) or not all(isinstance(x, str) and "=" in x for x in v):
                raise SweepError(f"{path}: grid.{key}.{k} must be a list of 'section.field=value' strings, got {v!r}")
        axes.append(Axis(str(key), [str(k) for k in spec], list(spec.values())))
    if len({a.label for a in axes}) != len(axes):
        raise SweepError(f"{path}: two grid axes share a label: {[a.label for a in axes]}")
    return axes


def _label(value: Any, override: bool = False) -> str:
    """A grid value as a label (or, for an override, as YAML: booleans and null too)."""
    if isinstance(value, (dict, list)) or (override and (isinstance(value, bool) or value is None)):
        return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return str(value)
