"""`vespo plot` on run directories writes a PNG; bad run directories are named in the error."""

import json

from vespo.plot import load_run
from vespo.plot_cli import main


def _run_dir(path, rewards):
    path.mkdir(parents=True)
    rows = [{"step": i + 1, "reward/mean": r, "kl/k3": 0.01 * (i + 1), "mismatch/k3": 1e-6,
             "optim/grad_norm": 1.0 + i, "rollout/response_len": 9.0 - 0.1 * i} for i, r in enumerate(rewards)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_of_two_runs_writes_a_png(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", [0.1, 0.2, 0.4])
    b = _run_dir(tmp_path / "b", [0.3, 0.2, 0.1])
    out = tmp_path / "fig" / "curves.png"
    assert main([str(a), str(b), "--out", str(out), "--kl", "engine", "--title", "t"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000
    assert f"wrote {out}" in capsys.readouterr().out


def test_curve_reads_the_metric_and_skips_rows_without_it(tmp_path):
    run = load_run(_run_dir(tmp_path / "a", [0.1, 0.2]))
    assert run.curve("reward/mean") == ([1, 2], [0.1, 0.2])
    assert run.curve("eval/reward_greedy") == ([], [])
    assert run.summary == {}


def test_the_x_axis_is_optimizer_steps_from_the_runs_config(tmp_path):
    run_dir = _run_dir(tmp_path / "a", [0.1, 0.2, 0.3])
    (run_dir / "config.yaml").write_text("staleness: {n: 16}\n")
    run = load_run(run_dir)
    assert run.n == 16
    # row k is trained after (k - 1) x 16 updates
    assert run.curve("reward/mean", x="updates") == ([0, 16, 32], [0.1, 0.2, 0.3])
    assert run.curve("reward/mean") == ([1, 2, 3], [0.1, 0.2, 0.3])
    assert main([str(run_dir), "--out", str(tmp_path / "x.png"), "--x", "step"]) == 0


def test_a_directory_without_metrics_is_named(tmp_path, capsys):
    assert main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert f"{tmp_path} is not a run directory: no metrics.jsonl" in capsys.readouterr().err


def test_a_broken_metrics_line_is_named(tmp_path, capsys):
    run = _run_dir(tmp_path / "a", [0.1])
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    assert main([str(run)]) == 2
    assert "metrics.jsonl: line 2 is not valid JSON" in capsys.readouterr().err


def test_labels_must_match_the_runs(tmp_path):
    import pytest

    a = _run_dir(tmp_path / "a", [0.1])
    with pytest.raises(SystemExit):
        main([str(a), "--labels", "x", "y"])
