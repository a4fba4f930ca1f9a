"""Sweep files: the grid expands into the Cartesian product of its axes, with labels and overrides."""

import pytest
import yaml

from vespo.lab.grid import SweepError, load_sweep


def _write(tmp_path, data, name="s.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_grid_points_are_the_product_of_the_axes_in_file_order(tmp_path):
    sweep = load_sweep(_write(tmp_path, {"name": "t", "base": {"run": {"steps": 2}}, "overrides": ["optim.lr=1e-4"],
                                         "grid": {"loss.name": ["grpo", "vespo"], "staleness.n": [1, 8],
                                                  "run.seed": [0]}}))
    points = sweep.points()
    assert [p.name for p in points] == ["loss=grpo,N=1,seed=0", "loss=grpo,N=8,seed=0",
                                        "loss=vespo,N=1,seed=0", "loss=vespo,N=8,seed=0"]
    assert points[2].labels == {"loss": "vespo", "N": "1", "seed": "0"}
    assert points[2].overrides == ["optim.lr=1e-4", "loss.name=vespo", "staleness.n=1", "run.seed=0"]
    assert sweep.base == {"run": {"steps": 2}}


def test_named_axis_of_override_bundles_and_a_base_file(tmp_path):
    _write(tmp_path, {"run": {"steps": 3}}, "base.yaml")
    sweep = load_sweep(_write(tmp_path, {"base": "base.yaml", "grid": {
        "kernel": {"asym": ["loss.options.k_pos=2.0"], "sym": ["loss.options.k_pos=3.0", "loss.options.k_neg=3.0"]},
        "loss.options": [{"length_norm": "sqrt"}]}}))
    assert sweep.name == "s" and sweep.base == {"run": {"steps": 3}}
    points = sweep.points()
    assert [p.labels["kernel"] for p in points] == ["asym", "sym"]
    assert points[1].overrides == ["loss.options.k_pos=3.0", "loss.options.k_neg=3.0", "loss.options={length_norm: sqrt}"]


@pytest.mark.parametrize("data, match", [
    ({"grid": {}}, "grid must be a non-empty mapping"),
    ({"grid": {"staleness.n": []}}, "grid.staleness.n must be a non-empty list"),
    ({"grid": {"v": {"a": "loss.name=grpo"}}}, "grid.v.a must be a list"),
    ({"grid": {"staleness.n": [1]}, "overrides": ["nonsense"]}, "overrides must be a list"),
    ({"grid": {"staleness.n": [1]}, "bogus": 1}, r"unknown key\(s\) \['bogus'\]"),
    ({"grid": {"staleness.n": [1]}, "base": "missing.yaml"}, "base config not found"),
    ({"grid": {"loss.name": ["grpo"], "loss": {"x": ["loss.name=vespo"]}}}, "two grid axes share a label"),
])
def test_malformed_sweep_files_name_the_key(tmp_path, data, match):
    with pytest.raises(SweepError, match=match):
        load_sweep(_write(tmp_path, data))


def test_every_shipped_lab_config_expands_and_validates():
    from pathlib import Path

    from vespo.config import load_config
    from vespo.lab.sweep import write_record

    files = sorted(Path(__file__).resolve().parents[2].joinpath("configs/lab").glob("*.yaml"))
    assert {f.stem for f in files} >= {"quick", "staleness", "length_norm", "asymmetry", "async", "mismatch"}
    for f in files:
        sweep = load_sweep(f)
        base = Path(f"/tmp/vespo-lab-test-{f.stem}.yaml")
        base.write_text(yaml.safe_dump(sweep.base))
        for point in sweep.points():
            load_config(base, point.overrides)  # raises ConfigError naming the field
