"""Sweep files: the grid expands into the Cartesian product of its axes, with labels and overrides."""

from pathlib import Path

import pytest
import yaml

from vespo.config import ConfigError, load_config
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


LAB = Path(__file__).resolve().parents[2] / "configs" / "lab"


@pytest.fixture(scope="module")
def shipped_points(tmp_path_factory):
    """(file stem, point name, resolved config) of every lab sweep file."""
    tmp_path = tmp_path_factory.mktemp("bases")
    out = []
    for f in sorted(LAB.glob("*.yaml")):
        if f.name == "claims.yaml":
            continue
        sweep = load_sweep(f)
        base = tmp_path / f"{f.stem}.yaml"
        base.write_text(yaml.safe_dump(sweep.base))
        for point in sweep.points():
            try:
                out.append((f.stem, point.name, load_config(base, point.overrides)))
            except ConfigError as e:
                raise AssertionError(f"{f.name}: {point.name}: {e}") from None
    return out


def test_every_shipped_lab_config_expands_and_validates(shipped_points):
    points = shipped_points
    stems = {stem for stem, _, _ in points}
    assert stems == {"quick", "staleness", "staleness_short", "length_norm", "asymmetry", "async", "lr_range",
                     "lr_range_async", "mismatch", "mismatch_dense", "adaptive_failure"}
    assert len(points) >= 300
    for stem, name, cfg in points:
        if stem == "adaptive_failure":  # deliberately the earlier, pre-protocol setting it reruns
            assert cfg.staleness.n == 32 and cfg.prompts_per_minibatch == 1, name
            continue
        # the paper's protocol: a fixed mini-batch and a run length in optimizer steps
        assert cfg.staleness.minibatch_prompts > 0 and cfg.run.updates > 0, (stem, name)
        assert cfg.steps * cfg.staleness.n == cfg.run.updates
        # the paper's GRPO baseline: clip-higher
        if cfg.loss.name == "grpo":
            assert (cfg.loss.options["eps_low"], cfg.loss.options["eps_high"]) == (0.2, 0.28), (stem, name)
        if stem != "quick":  # held-out sampling error <= sqrt(0.25 / 1024) = 0.016
            assert cfg.task.eval_size >= 1000, (stem, name)
        if stem not in ("quick", "staleness_short"):  # answers of >= 16 letters + EOS
            assert cfg.task.name == "reverse" and cfg.task.options["length"] >= 16, (stem, name)


def test_the_experiments_vary_what_they_say(shipped_points):
    by = {}
    for stem, name, cfg in shipped_points:
        by.setdefault(stem, []).append(cfg)
    staleness = by["staleness"]
    assert sorted({c.staleness.n for c in staleness}) == [1, 4, 8, 16, 32, 64]
    assert {c.staleness.n * 8 for c in staleness} == {c.prompts_per_step for c in staleness}
    assert {c.run.updates for c in staleness} == {512} and len({c.run.seed for c in staleness}) == 5
    assert {c.loss.options.get("length_norm") for c in by["length_norm"]} == {"none", "sqrt", "linear"}
    for stem in ("async", "lr_range_async"):
        assert {(c.run.mode, c.staleness.behavior, c.async_.sync_every) for c in by[stem]} == {("async", "rollout", 4)}
    for stem in ("lr_range", "lr_range_async"):
        lrs = sorted({c.optim.lr for c in by[stem]})
        assert len(lrs) >= 5 and lrs[-1] / lrs[0] >= 10 and len({c.run.seed for c in by[stem]}) >= 3
    for stem in ("mismatch", "mismatch_dense"):  # mu's source is the same in every row of a comparison
        assert {(c.staleness.behavior, c.rollout.engine_dtype) for c in by[stem]} == {("recompute", "bfloat16")}
    assert {c.model.arch for c in by["mismatch"]} == {"qwen3_moe"} and {c.model.arch for c in by["mismatch_dense"]} == {"qwen3"}


def test_reference_and_cost(tmp_path):
    sweep = load_sweep(_write(tmp_path, {"grid": {"loss.name": ["grpo", "vespo"], "optim.lr": [1e-4],
                                                  "model.arch": ["qwen3"]}, "cost": {"run_s": 30, "jobs": 2}}))
    assert sweep.reference == {"loss": "vespo"}  # the default when the grid has it
    assert [a.label for a in sweep.axes] == ["loss", "lr", "model"]
    assert sweep.cost.wall_s(10) == 150.0
    sweep = load_sweep(_write(tmp_path, {"grid": {"kernel": {"a": ["loss.name=vespo"], "b": ["loss.name=vespo"]}},
                                         "reference": {"kernel": "b"}}))
    assert sweep.reference == {"kernel": "b"} and sweep.cost is None


@pytest.mark.parametrize("data, match", [
    ({"grid": {"staleness.n": [1]}, "reference": {"N": "8"}}, "reference N=8 is not a value of a grid axis"),
    ({"grid": {"staleness.n": [1]}, "reference": {"N": "1", "seed": "0"}}, "reference must be one"),
    ({"grid": {"staleness.n": [1]}, "cost": {"jobs": 2}}, "cost must be a mapping with run_s"),
    ({"grid": {"staleness.n": [1]}, "cost": {"run_s": -1}}, "cost.run_s must be a number > 0"),
])
def test_bad_reference_or_cost_is_named(tmp_path, data, match):
    with pytest.raises(SweepError, match=match):
        load_sweep(_write(tmp_path, data))
