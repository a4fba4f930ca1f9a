"""The locks in locks/ agree with pyproject.toml.

A lock is a pip constraints file (``name==version`` lines) with header lines: ``# install:`` (what
scripts/setup_env.sh installs under it), ``# covers:`` (``dependencies`` for pyproject's main list, and
the optional extras whose requirements the environment holds) and, on the floor lock, ``# floors:``
(packages pinned at exactly pyproject's lower bound, where that bound is tested). Every requirement
of what a lock covers must be pinned in it by a version its range accepts; a floor pin must equal the
bound. The checker is run on the repository's files and on a deliberate mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
LOCKS = sorted((ROOT / "locks").glob("*.txt"))


def read_lock(path: Path) -> tuple[dict[str, list[str]], dict[str, Version]]:
    """(header fields: name -> the words of its lines, pins: canonical name -> version) of a lock."""
    header: dict[str, list[str]] = {}
    pins: dict[str, Version] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep and key.strip() in ("install", "covers", "floors"):
                header.setdefault(key.strip(), []).extend(value.split())
        elif line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{path.name}:{n}: {line!r} is not a name==version pin")
            pins[canonicalize_name(name)] = Version(version)
    return header, pins


def lock_problems(pyproject: Path, lock: Path) -> list[str]:
    """One line per disagreement between ``lock`` and ``pyproject``; empty when they agree."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    header, pins = read_lock(lock)
    problems = [f"{lock.name}: no '# {key}:' line" for key in ("install", "covers") if not header.get(key)]
    requirements: list[str] = []
    for group in header.get("covers", []):
        if group == "dependencies":
            requirements += project["dependencies"]
        elif group in extras:
            requirements += extras[group]
        else:
            problems.append(f"{lock.name}: covers {group!r}, which is neither 'dependencies' nor an extra of "
                            f"pyproject.toml ({', '.join(sorted(extras))})")
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{lock.name}: pyproject requires {text!r}, which the lock does not pin")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{lock.name}: pins {req.name}=={pinned}, outside pyproject's {text!r}")
    for name in header.get("floors", []):
        bounds = [Version(spec.version) for text in project["dependencies"] + sum(extras.values(), [])
                  if canonicalize_name(Requirement(text).name) == canonicalize_name(name)
                  for spec in Requirement(text).specifier if spec.operator == ">="]
        if not bounds:
            problems.append(f"{lock.name}: floors {name}, which pyproject gives no lower bound")
        elif pins.get(canonicalize_name(name)) != bounds[0]:
            problems.append(f"{lock.name}: floors {name} at {pins.get(canonicalize_name(name))}, "
                            f"but pyproject's lower bound is {bounds[0]}")
    return problems


def test_the_locks_needed_by_the_scripts_exist():
    assert {"main", "verl", "floor"} <= {p.stem for p in LOCKS}


@pytest.mark.parametrize("lock", LOCKS, ids=[p.stem for p in LOCKS])
def test_each_lock_agrees_with_pyproject(lock):
    assert lock_problems(ROOT / "pyproject.toml", lock) == []


def test_every_extra_and_the_main_list_is_covered_by_some_lock():
    """pyproject's dependencies and each extra are held by a tested environment, except the optional
    integrations no test environment installs (named here, so a new extra must be placed)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    covered = {group for lock in LOCKS for group in read_lock(lock)[0].get("covers", [])}
    assert set(extras) | {"dependencies"} <= covered | {"vllm", "wandb"}


def test_the_floor_lock_pins_the_transformers_floor():
    header, _ = read_lock(ROOT / "locks" / "floor.txt")
    assert "transformers" in header.get("floors", [])


PYPROJECT = """
[project]
name = "p"
dependencies = ["numpy>=1.24", "transformers>=5.19"]
[project.optional-dependencies]
test = ["pytest>=8"]
"""


@pytest.mark.parametrize("pins,header,expected", [
    ("numpy==2.4.6\ntransformers==5.25.0\npytest==9.0.0\n", "# covers: dependencies test\n", []),
    ("numpy==2.4.6\ntransformers==5.18.0\npytest==9.0.0\n", "# covers: dependencies test\n",
     ["t.txt: pins transformers==5.18.0, outside pyproject's 'transformers>=5.19'"]),
    ("numpy==2.4.6\npytest==9.0.0\n", "# covers: dependencies test\n",
     ["t.txt: pyproject requires 'transformers>=5.19', which the lock does not pin"]),
    ("numpy==2.4.6\ntransformers==5.25.0\n", "# covers: dependencies tset\n",
     ["t.txt: covers 'tset', which is neither 'dependencies' nor an extra of pyproject.toml (test)"]),
    ("numpy==2.4.6\ntransformers==5.20.0\n", "# covers: dependencies\n# floors: transformers\n",
     ["t.txt: floors transformers at 5.20.0, but pyproject's lower bound is 5.19"]),
    ("numpy==2.4.6\ntransformers==5.19.0\n", "# covers: dependencies\n# floors: transformers\n", []),
])
def test_a_mismatch_is_named(tmp_path, pins, header, expected):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "t.txt").write_text("# install: -e .\n" + header + pins)
    assert lock_problems(tmp_path / "pyproject.toml", tmp_path / "t.txt") == expected


def test_a_lock_without_its_header_is_named(tmp_path):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "t.txt").write_text("numpy==2.4.6\n")
    assert lock_problems(tmp_path / "pyproject.toml", tmp_path / "t.txt") == [
        "t.txt: no '# install:' line", "t.txt: no '# covers:' line"]
