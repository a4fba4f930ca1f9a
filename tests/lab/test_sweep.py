"""A miniature sweep (2 losses x 2 N x 1 seed, nano model, 2 steps) end to end: `vespo sweep`
runs real `vespo train` processes, a second call skips them, `vespo report` writes the table and
the figures from them."""

import json
from pathlib import Path

import pytest
import yaml

from vespo.lab import report, sweep
from vespo.lab.grid import SweepError, load_sweep

QUICK = Path(__file__).resolve().parents[2] / "configs" / "lab" / "quick.yaml"
SMALL = ["run.steps=2", "task.eval_size=8", "warmstart.steps=10"]


@pytest.fixture(scope="module")
def quick_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    out = root / "quick"
    argv = [str(QUICK), "--out", str(out), "--jobs", "2", f"warmstart.cache_dir={root / 'ws'}", *SMALL]
    assert sweep.main(argv) == 0
    return out, argv


def test_every_grid_point_is_a_finished_run_directory(quick_sweep):
    out, _ = quick_sweep
    names = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert names == ["loss=grpo,N=1,seed=0", "loss=grpo,N=4,seed=0", "loss=vespo,N=1,seed=0", "loss=vespo,N=4,seed=0"]
    for name in names:
        run = out / name
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "done" and summary["steps_done"] == 2
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["loss"]["name"] == name.split(",")[0].split("=")[1]
        assert cfg["staleness"]["n"] == int(name.split(",")[1].split("=")[1])
        assert cfg["run"]["threads"] == 1
        assert json.loads((run / "lab.json").read_text())["returncode"] == 0
    n4 = [json.loads(line) for line in (out / "loss=vespo,N=4,seed=0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness/lag_max"] for r in n4] == [3.0, 3.0]  # mini-batches 0..3 of each rollout batch


def test_a_second_call_skips_the_finished_runs(quick_sweep, capsys):
    out, argv = quick_sweep
    spec = load_sweep(QUICK)
    spec.overrides += argv[5:]  # the cache dir and SMALL, as given on the command line
    jobs = sweep.plan(spec, out)
    assert {j.action for j in jobs} == {"skip"}
    before = (out / "loss=grpo,N=1,seed=0" / "metrics.jsonl").read_text()
    assert sweep.main(argv) == 0
    assert "4 skip" in capsys.readouterr().out
    assert (out / "loss=grpo,N=1,seed=0" / "metrics.jsonl").read_text() == before


def test_report_writes_the_table_and_the_figures(quick_sweep, tmp_path):
    out, _ = quick_sweep
    assert report.main([str(out), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| grpo") or line.startswith("| vespo")]
    assert [r.split(" | ")[:3] for r in rows] == [["| grpo", "1", "1"], ["| grpo", "4", "1"],
                                                  ["| vespo", "1", "1"], ["| vespo", "4", "1"]]
    # the final reward cell of each condition is the mean over the last 20% of steps (here: the last of 2)
    for row in rows:
        loss, n = row.split(" | ")[0][2:], row.split(" | ")[1]
        metrics = (out / f"loss={loss},N={n},seed=0" / "metrics.jsonl").read_text().splitlines()
        assert row.split(" | ")[3] == f"{json.loads(metrics[-1])['reward/mean']:.3f}"
    for png in ("reward.png", "kl.png", "grad_norm.png", "reward_equal_curve.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_changed_base_config_is_refused(quick_sweep, tmp_path):
    out, _ = quick_sweep
    changed = yaml.safe_load(QUICK.read_text())
    changed["base"]["optim"]["lr"] = 5e-4
    other = tmp_path / "quick.yaml"
    other.write_text(yaml.safe_dump(changed))
    with pytest.raises(SweepError, match="base.yaml differs"):
        sweep.plan(load_sweep(other), out)


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "dry"
    assert sweep.main([str(QUICK), "--out", str(out), "--dry-run", "--only", "N=4"]) == 0
    printed = capsys.readouterr().out
    assert "2 runs (2 start)" in printed
    assert printed.count("-m vespo.cli train") == 2 and "staleness.n=4" in printed and "run.threads=1" in printed
    assert not [p for p in out.iterdir() if p.is_dir()]


def test_only_rejects_values_outside_the_grid(tmp_path, capsys):
    assert sweep.main([str(QUICK), "--out", str(tmp_path / "x"), "--dry-run", "--only", "N=64"]) == 2
    assert "not in grid axis N" in capsys.readouterr().err


def test_a_failing_run_is_recorded_and_kept_as_failed(tmp_path):
    spec = yaml.safe_load(QUICK.read_text())
    spec["grid"] = {"run.seed": [0]}
    spec["overrides"] = ["model.path=/nonexistent/model"]  # the process fails while loading the policy
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "bad"
    assert sweep.main([str(path), "--out", str(out), "--jobs", "1"]) == 1
    lab = json.loads((out / "seed=0" / "lab.json").read_text())
    assert lab["status"] == "failed" and lab["returncode"] != 0
    assert [j.action for j in sweep.plan(load_sweep(path), out)] == ["failed"]
    assert [j.action for j in sweep.plan(load_sweep(path), out, retry_failed=True)] == ["start"]
