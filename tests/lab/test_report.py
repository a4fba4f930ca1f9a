"""`vespo report` on hand-made sweep directories: aggregation over seeds, collapse counts, layout."""

import json
import math
import statistics

import pytest

from vespo.lab import report


def _sweep(tmp_path, runs):
    """runs: {(loss, N, seed): rewards}; writes sweep.json and one run directory per entry."""
    out = tmp_path / "sw"
    out.mkdir()
    axes = [{"label": "loss", "values": ["grpo", "vespo"]}, {"label": "N", "values": ["1", "8"]},
            {"label": "seed", "values": ["0", "1", "2"]}]
    (out / "sweep.json").write_text(json.dumps({"name": "t", "axes": axes}))
    for (loss, n, seed), rewards in runs.items():
        d = out / f"loss={loss},N={n},seed={seed}"
        d.mkdir()
        (d / "lab.json").write_text(json.dumps({"labels": {"loss": loss, "N": n, "seed": seed}, "returncode": 0}))
        rows = [{"step": i + 1, "reward/mean": r, "kl/k3": 0.1 * (i + 1), "mismatch/k3": 0.0,
                 "optim/grad_norm_max": 2.0 * (i + 1), "is/ess": 0.5, "is/log_w_min": -1.0 - i,
                 "is/log_w_max": 0.5, "rollout/eos_rate": 1.0, "optim/skipped": 0.0} for i, r in enumerate(rewards)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "summary.json").write_text(json.dumps({"status": "done"}))
    return out


def test_final_mean_is_over_the_last_fifth_of_the_steps():
    rows = [{"reward/mean": float(i)} for i in range(10)]  # last 20% of 10 steps = steps 9, 10 -> (8 + 9) / 2
    assert report.final_mean(rows, "reward/mean") == 8.5
    assert report.final_mean(rows[:3], "reward/mean") == 2.0  # fewer than 5 steps: the last one
    assert math.isnan(report.final_mean(rows, "kl/k3"))


def test_condition_rows_aggregate_over_seeds(tmp_path):
    healthy = {("vespo", "8", s): [0.2, 0.3, 0.4, 0.5, 0.4 + 0.1 * int(s)] for s in ("0", "1", "2")}
    collapsed = {("grpo", "8", "0"): [0.4, 0.5, 0.1, 0.0, 0.0], ("grpo", "8", "1"): [0.3, 0.3, 0.3, 0.3, 0.3]}
    out = _sweep(tmp_path, {**healthy, **collapsed})
    record, results = report.read_sweep(out)
    table = report.condition_table(record, results).splitlines()
    assert table[0].startswith("| loss | N | runs | final reward | best reward | collapsed |")
    grpo, vespo = table[2].split(" | "), table[3].split(" | ")
    # vespo: finals (last 1 of 5 steps) 0.4, 0.5, 0.6 -> mean 0.5, sample std 0.1; best 0.5, 0.5, 0.6 -> 0.533
    finals = [0.4, 0.5, 0.6]
    assert vespo[:3] == ["| vespo", "8", "3"]
    assert vespo[3] == f"{statistics.mean(finals):.3f} ± {statistics.stdev(finals):.3f}" == "0.500 ± 0.100"
    assert vespo[4] == "0.533" and vespo[5] == "0/3"
    # grpo: seed 0 falls below half its best (0.25) from step 3 and stays: one collapse out of two runs
    assert grpo[:3] == ["| grpo", "8", "2"] and grpo[5] == "1/2 (reward)"
    assert grpo[3] == "0.150 ± 0.212"  # finals 0.0 and 0.3: std = 0.3 / sqrt(2)
    # final KL = kl/k3 at step 5 = 0.5; max grad norm = 2 x 5; log W range over all rows [-5, 0.5]
    assert grpo[6] == "0.500" and grpo[8] == "10.000" and grpo[10] == "[-5.00, 0.50] |"
    runs = report.run_table(record, results)
    assert "`loss=grpo,N=8,seed=0` | done | 5 | 0.000 | 0.500 | reward at step 3" in runs


def test_report_main_writes_markdown_and_figures(tmp_path):
    out = _sweep(tmp_path, {(l, n, "0"): [0.1, 0.2, 0.3] for l in ("grpo", "vespo") for n in ("1", "8")})
    assert report.main([str(out), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "![reward](reward.png)" in md and "| vespo | 8 | 1 | 0.300 |" in md
    assert sorted(p.name for p in (tmp_path / "rep").glob("*.png")) == [
        "grad_norm.png", "kl.png", "reward.png", "reward_equal_curve.png"]


def test_layout_defaults_and_bad_axes():
    record = {"axes": [{"label": "loss"}, {"label": "N"}, {"label": "seed"}]}
    assert report.layout(record, None, None) == ("loss", ["N"])
    assert report.layout(record, "N", None) == ("N", ["loss"])
    assert report.layout({"axes": [{"label": "kernel"}, {"label": "seed"}]}, None, None) == (None, ["kernel"])
    with pytest.raises(ValueError, match="--panel 'lr' is not a grid axis"):
        report.layout(record, "lr", None)


def test_not_a_sweep_directory_is_named(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "no sweep.json" in capsys.readouterr().err
