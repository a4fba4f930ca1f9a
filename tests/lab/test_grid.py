"""Sweep files: the grid expands into the Cartesian product of its axes, with labels and overrides."""

from pathlib import Path

import pytest
import yaml

from vespo.config import to_dict
from vespo.lab.collapse import RULE
from vespo.lab.grid import Sweep, SweepError, load_sweep
from vespo.trainer.warmstart import on_policy_dir


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
    ({"grid": {}}, "grid: Dictionary should have at least 1 item"),
    ({"grid": {"staleness.n": []}}, "grid.staleness.n must be a non-empty list"),
    ({"grid": {"v": {"a": "loss.name=grpo"}}}, "grid.v.a must be a list"),
    ({"grid": {"staleness.n": [1]}, "overrides": ["nonsense"]}, "overrides.0: .*'nonsense' is not a 'section.field"),
    ({"grid": {"staleness.n": [1]}, "bogus": 1}, "bogus: Extra inputs are not permitted"),
    ({"grid": {"staleness.n": [1]}, "base": "missing.yaml"}, "base config not found"),
    ({"grid": {"loss.name": ["grpo"], "loss": {"x": ["loss.name=vespo"]}}}, "two grid axes share a label"),
])
def test_malformed_sweep_files_name_the_key(tmp_path, data, match):
    with pytest.raises(SweepError, match=match):
        load_sweep(_write(tmp_path, data))


LAB = Path(__file__).resolve().parents[2] / "configs" / "lab"
STEMS = sorted(f.stem for f in LAB.glob("*.yaml") if f.name != "claims.yaml")

@pytest.fixture(scope="module")
def shipped_points(shipped):
    """(file stem, point name, resolved config) of every lab sweep point that validates."""
    return [(stem, name, cfg) for stem, (ok, _, _) in shipped.items() for name, cfg in ok]


@pytest.mark.parametrize("stem", STEMS)
def test_every_shipped_point_validates_but_for_methods_not_yet_registered(shipped, stem):
    ok, pending, errors = shipped[stem]
    assert not errors, f"{stem}.yaml: {errors[0][0]}: {errors[0][1]}"
    assert ok, f"{stem}.yaml: no grid point validates"
    if pending:
        waiting = sorted({method for _, method in pending})
        pytest.xfail(f"{stem}.yaml: {len(pending)} of {len(ok) + len(pending)} points wait for {', '.join(waiting)} "
                     "to be registered")


def test_every_shipped_lab_config_follows_the_protocol(shipped_points):
    points = shipped_points
    assert {stem for stem, _, _ in points} == {"quick", "staleness", "staleness_short", "length_norm", "asymmetry",
                                               "async", "lr_range", "lr_range_async", "mismatch", "mismatch_dense",
                                               "adaptive_failure", "endpoint", "staleness_peers", "async_peers",
                                               "mismatch_peers", "staleness_newer", "async_newer", "real_staleness",
                                               "real_stability", "real_mismatch", "real_mismatch_bf16",
                                               "real_reference", "real_stability_v2"}
    for stem, name, cfg in points:
        # the collapse rule's evidence: held-out evaluations after the same updates at every N
        assert cfg.run.eval_every_updates > 0 and cfg.run.eval_every_updates % cfg.staleness.n == 0, (stem, name)
        if stem == "adaptive_failure":  # deliberately the earlier, pre-protocol setting it reruns
            assert cfg.staleness.n == 32 and cfg.prompts_per_minibatch == 1, name
            continue
        # the paper's protocol: a fixed mini-batch and a run length in optimizer steps
        assert cfg.staleness.minibatch_prompts > 0 and cfg.run.updates > 0, (stem, name)
        assert cfg.steps * cfg.staleness.n == cfg.run.updates
        # the paper's GRPO baseline: clip-higher
        if cfg.loss.name == "grpo":
            assert (cfg.loss.options.eps_low, cfg.loss.options.eps_high) == (0.2, 0.28), (stem, name)
        if stem.startswith("real_"):  # the real-model recipe: its own task,
            assert cfg.task.name == "rg:chain_sum" and cfg.task.eval_size >= 256, name  # a smaller held-out set
            if stem.startswith("real_stability"):  # a stability test: a shared on-policy start, >= 8 rollout batches
                assert cfg.warmstart.enabled and cfg.warmstart.kind == "on_policy", name
                assert cfg.steps >= 8 or cfg.staleness.n == 1, name
            if stem in ("real_reference", "real_stability_v2"):  # at a smaller step, from the first pilot's starts
                pilot = {c.run.seed: c for st, _, c in points if st == "real_stability"}
                if cfg.run.seed in pilot:  # seeds past the first pilot's grid make their start by the same settings
                    assert on_policy_dir(cfg) == on_policy_dir(pilot[cfg.run.seed]), name
                assert cfg.optim.lr < cfg.warmstart.start_lr == 3e-5 and cfg.run.updates == 128, name
            if stem == "real_reference":  # the reference alone
                assert (cfg.staleness.n, cfg.loss.name) == (1, "vespo"), name
            if stem == "real_stability_v2":  # real_stability but the step after the start, and the floor enforced
                assert cfg.optim.lr == 1e-5 and cfg.warmstart.min_accuracy == 0.05, name
                same = name.split(",", 1)[1]  # the first pilot's point of the same N and loss (seed 0 past its grid)
                first = next(c for st, n, c in points if st == "real_stability"
                             and n == (name if cfg.run.seed in pilot else f"seed=0,{same}"))
                assert _but_the_step(first, cfg.run.seed) == _but_the_step(cfg), name
            if stem.startswith("real_mismatch"):  # the engine's bf16 against the learner is the only gap: N = 1
                assert cfg.warmstart.enabled and cfg.warmstart.kind == "on_policy", name
                autocast = stem == "real_mismatch_bf16"  # a float32 learner, or bf16-mixed in the second arm
                assert (cfg.rollout.engine, cfg.rollout.engine_dtype, cfg.model.autocast) == ("vllm", "bfloat16", autocast)
                assert cfg.staleness.n == 1, name
            continue
        if stem != "quick":  # held-out sampling error <= sqrt(0.25 / 1024) = 0.016; every 64 updates on 256
            assert cfg.task.eval_size >= 1000, (stem, name)
            assert (cfg.run.eval_every_updates, cfg.run.eval_every_size) == (RULE.every, 256), (stem, name)
        if stem not in ("quick", "staleness_short"):  # answers of >= 16 letters + EOS
            assert cfg.task.name == "reverse" and cfg.task.options["length"] >= 16, (stem, name)


def _but_the_step(cfg, seed: int | None = None) -> dict:
    """A config without the step size after the start and the start's floor (what real_stability_v2 changes),
    at ``seed`` when given."""
    data = to_dict(cfg)
    data["optim"].pop("lr"), data["warmstart"].pop("start_lr"), data["warmstart"].pop("min_accuracy")
    if seed is not None:
        data["run"]["seed"] = seed
    return data


def _seeds_per(stem: str, axis: str = "loss") -> dict[str, int]:
    counts: dict[str, set] = {}
    for point in load_sweep(LAB / f"{stem}.yaml").points():
        counts.setdefault(point.labels[axis], set()).add(point.labels["seed"])
    return {k: len(v) for k, v in counts.items()}


def test_ten_seeds_where_the_headline_rests():
    headline = {"vespo", "grpo", "dppo_tv", "m2po", "vespo_ess_lr"}
    for stem in ("staleness", "async"):
        seeds = _seeds_per(stem)
        assert {k for k, n in seeds.items() if n == 10} == headline, (stem, seeds)
        assert {k for k, n in seeds.items() if n != 10} == {"gspo", "sapo", "dppo_kl", "grpo_ess_lr"}, (stem, seeds)
        assert all(n >= 5 for n in seeds.values())
    assert {p.labels["N"] for p in load_sweep(LAB / "staleness.yaml").points()} == {"1", "8", "64"}
    for stem in ("length_norm", "asymmetry", "mismatch", "mismatch_dense", "endpoint"):
        assert len({p.labels["seed"] for p in load_sweep(LAB / f"{stem}.yaml").points()}) == 5, stem


def test_the_experiments_vary_what_they_say(shipped_points):
    by = {}
    for stem, name, cfg in shipped_points:
        by.setdefault(stem, []).append(cfg)
    staleness = by["staleness"]
    assert sorted({c.staleness.n for c in staleness}) == [1, 8, 64]
    assert {c.staleness.n * 8 for c in staleness} == {c.prompts_per_step for c in staleness}
    assert {c.run.updates for c in staleness} == {512}
    assert {c.loss.options.length_norm for c in by["length_norm"]} == {"none", "sqrt", "linear"}
    for stem in ("async", "lr_range_async", "async_peers", "async_newer"):
        assert {(c.run.mode, c.staleness.behavior, c.async_.sync_every) for c in by[stem]} == {("async", "rollout", 4)}
    for stem in ("lr_range", "lr_range_async"):  # 8 learning rates, evenly spaced in log (1.5x-1.7x apart)
        lrs = sorted({c.optim.lr for c in by[stem]})
        steps = [b / a for a, b in zip(lrs, lrs[1:])]
        assert len(lrs) == 8 and all(1.5 <= x <= 1.7 for x in steps) and lrs[-1] >= 1e-3, lrs
        assert len({c.run.seed for c in by[stem]}) >= 3
    # the end point: 4x the staleness sweep's updates at N = 1 and 64
    assert {(c.staleness.n, c.run.updates) for c in by["endpoint"]} == {(1, 2048), (64, 2048)}
    for stem in ("mismatch", "mismatch_dense"):  # mu's source is the same in every row of a comparison
        assert {c.staleness.behavior for c in by[stem]} == {"recompute"}
        # the mismatch, and a control without it
        assert {c.rollout.engine_dtype for c in by[stem]} == {"bfloat16", "float32"}
    assert {c.model.arch for c in by["mismatch"]} == {"qwen3_moe"}
    assert {c.model.arch for c in by["mismatch_dense"]} == {"qwen3"}


def test_exclude_leaves_out_matching_points(tmp_path):
    sweep = load_sweep(_write(tmp_path, {"grid": {"run.seed": [0, 1, 2], "loss.name": ["grpo", "vespo"]},
                                         "exclude": [{"loss": "grpo", "seed": [1, 2]}]}))
    assert [p.name for p in sweep.points()] == ["seed=0,loss=grpo", "seed=0,loss=vespo", "seed=1,loss=vespo",
                                                "seed=2,loss=vespo"]
    record = {"name": "s", "axes": [{"label": a.label, "values": a.values} for a in sweep.axes], "exclude": sweep.exclude}
    assert len(Sweep.from_record(record).points()) == 4 and len(Sweep.from_record({**record, "exclude": []}).points()) == 6
    with pytest.raises(SweepError, match=r"exclude\[0\]: loss=\['sapo'\] is not on the grid"):
        load_sweep(_write(tmp_path, {"grid": {"loss.name": ["grpo"]}, "exclude": [{"loss": "sapo"}]}))
    with pytest.raises(SweepError, match="exclude: Input should be a valid list"):
        load_sweep(_write(tmp_path, {"grid": {"loss.name": ["grpo"]}, "exclude": {"loss": "grpo"}}))


def test_a_sweep_files_description_is_text_and_reaches_its_record(tmp_path):
    sweep = load_sweep(_write(tmp_path, {"grid": {"loss.name": ["grpo"]}, "description": "why\n  this grid"}))
    assert sweep.description == "why this grid"
    assert load_sweep(_write(tmp_path, {"grid": {"loss.name": ["grpo"]}})).description == ""
    with pytest.raises(SweepError, match="description: Input should be a valid string"):
        load_sweep(_write(tmp_path, {"grid": {"loss.name": ["grpo"]}, "description": ["a"]}))


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
    ({"grid": {"staleness.n": [1]}, "reference": {"N": "8"}}, r"reference: N=\['8'\] is not on the grid"),
    ({"grid": {"staleness.n": [1]}, "reference": {"N": "1", "seed": "0"}},
     "reference: Dictionary should have at most 1"),
    ({"grid": {"staleness.n": [1]}, "cost": {"jobs": 2}}, "cost.run_s: Field required"),
    ({"grid": {"staleness.n": [1]}, "cost": {"run_s": -1}}, "cost.run_s: Input should be greater than 0"),
])
def test_bad_reference_or_cost_is_named(tmp_path, data, match):
    with pytest.raises(SweepError, match=match):
        load_sweep(_write(tmp_path, data))


def budget_table(paths: list[Path], repo: Path, out_root: str = "runs/lab") -> tuple[str, float]:
    """(markdown table, minutes of the budgeted sweeps): per sweep file its command, runs, assumed cost per
    run and expected wall time, from the files' `cost`; optional sweeps are left out of the total."""
    rows, total = [], 0.0
    for path in paths:
        sweep = load_sweep(path)
        c, runs = sweep.cost, len(sweep.points())
        minutes = c.wall_s(runs) / 60
        total += 0.0 if c.optional else minutes
        rows.append(f"| `{sweep.name}`{' (optional)' if c.optional else ''} | `vespo sweep "
                    f"{path.relative_to(repo).as_posix()} --out {out_root}/{sweep.name} --jobs {c.jobs}` | {runs} | "
                    f"{c.run_s:g} s, {c.jobs} at a time | {minutes:.0f} min |")
    head = ["| sweep | command | runs | assumed per run | expected wall |", "| --- | --- | --- | --- | --- |"]
    tail = f"| total, without the optional sweeps | | | | {total:.0f} min = {total / 60:.1f} h |"
    return "\n".join(head + rows + [tail]), total


BUDGET_ORDER = ["staleness", "async", "lr_range", "lr_range_async", "endpoint", "length_norm", "asymmetry", "mismatch",
                "mismatch_dense", "staleness_short", "adaptive_failure", "quick", "staleness_peers", "async_peers",
                "mismatch_peers", "staleness_newer", "async_newer", "real_staleness", "real_stability", "real_mismatch",
                "real_mismatch_bf16", "real_reference", "real_stability_v2"]


def test_the_budget_table_in_the_docs_is_the_sweep_files_and_fits_8_hours():
    """docs/lab.md shows the table the sweep files' `cost` fields give, and the lab fits 8 hours with
    --jobs 2 (with 10 minutes left for the warm starts)."""
    assert sorted(BUDGET_ORDER) == STEMS
    repo = LAB.parents[1]
    table, minutes = budget_table([LAB / f"{stem}.yaml" for stem in BUDGET_ORDER], repo)
    assert table in (repo / "docs" / "lab.md").read_text(), "regenerate the table in docs/lab.md:\n" + table
    assert minutes <= 8 * 60 - 10


def test_sizing_reaches_the_record_with_its_defaults(tmp_path):
    grid = {"run.seed": [0, 1], "loss.name": ["grpo", "vespo"]}
    sweep = load_sweep(_write(tmp_path, {"grid": grid, "sizing": {"delta": 0.05}}))
    assert sweep.sizing.model_dump() == {"delta": 0.05, "power": 0.8, "alpha": 0.05}
    assert sweep.record()["sizing"] == {"delta": 0.05, "power": 0.8, "alpha": 0.05}
    assert Sweep.from_record(sweep.record()).sizing == sweep.sizing
    plain = load_sweep(_write(tmp_path, {"grid": grid}))
    assert plain.sizing is None and "sizing" not in plain.record()  # a record without it reads as before
    for stem in ("real_stability", "real_mismatch", "real_mismatch_bf16", "real_stability_v2"):
        assert load_sweep(LAB / f"{stem}.yaml").sizing.delta == 0.05


@pytest.mark.parametrize("data, match", [
    ({"grid": {"run.seed": [0, 1], "loss.name": ["grpo", "sapo"]}, "sizing": {"delta": 0.05}},
     "sizing: .* this sweep has no reference"),
    ({"grid": {"loss.name": ["grpo", "vespo"]}, "sizing": {"delta": 0.05}}, r"sizing: .* has 0 seed\(s\) on its grid"),
    ({"grid": {"run.seed": [0], "loss.name": ["grpo", "vespo"]}, "sizing": {"delta": 0.05}},
     r"sizing: .* has 1 seed\(s\) on its grid \(run.seed needs at least 2\)"),
    ({"grid": {"run.seed": [0, 1], "loss.name": ["vespo"]}, "sizing": {}}, "sizing.delta: Field required"),
    ({"grid": {"run.seed": [0, 1], "loss.name": ["vespo"]}, "sizing": {"delta": -0.1}},
     "sizing.delta: Input should be greater than 0"),
    ({"grid": {"run.seed": [0, 1], "loss.name": ["vespo"]}, "sizing": {"delta": 0.1, "power": 1}},
     "sizing.power: Input should be less than 1"),
    ({"grid": {"run.seed": [0, 1], "loss.name": ["vespo"]}, "sizing": {"delta": 0.1, "beta": 0.2}},
     "sizing.beta: Extra inputs are not permitted"),
])
def test_sizing_that_cannot_act_or_is_malformed_is_named(tmp_path, data, match):
    with pytest.raises(SweepError, match=match):
        load_sweep(_write(tmp_path, data))
