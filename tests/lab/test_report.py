"""`vespo report` on hand-made sweep directories: what "final" means at every N, the intervals over
seeds, the paired differences against the reference, collapse counts, and the files written."""

import math

import pytest

from vespo.lab import figures, report
from vespo.lab import cli as report_cli
from vespo.lab.grid import Axis, Sweep
from vespo.lab.runs import by_seed, read_lab
from vespo.lab.stats import ci_text, mean_ci, paired

from markdown_table import cells

PNG = b"\x89PNG\r\n\x1a\n"


def test_train_last_is_the_last_quarter_of_the_updates_at_every_n(synthetic):
    sw = synthetic("t", {"N": ["1", "4"], "seed": ["0"]})
    # 16 updates. N = 1: 16 rows, the last quarter = rows trained after >= 12 updates = rows 13..16.
    sw.run({"N": "1", "seed": "0"}, [float(i) for i in range(16)], n=1, eval_sampled=0.5)
    # N = 4: 4 rows trained after 0, 4, 8, 12 updates; the last quarter = row 4 alone (same 4 x 64 samples).
    sw.run({"N": "4", "seed": "0"}, [0.1, 0.2, 0.3, 0.7], n=4, eval_sampled=0.5)
    _, runs = read_lab([sw.dir])
    n1, n4 = runs.itertuples()
    assert n1.train_last == (12 + 13 + 14 + 15) / 4 and n4.train_last == 0.7
    assert n4.record.quarter("reward/mean", 2) == 0.3
    # the evaluations (one after each row): the last quarter = those after 13..16 updates (rows 13..16) at N = 1,
    # the one after 16 at N = 4
    assert n1.eval_last == (12 + 13 + 14 + 15) / 4 and n4.eval_last == 0.7
    assert n4.eval_rise == pytest.approx(0.7 - 0.3)  # the quarter before: the evaluation after 12 updates
    assert n1.eval_sampled == n4.eval_sampled == 0.5


def test_an_unfinished_run_has_no_last_quarter_yet(synthetic):
    sw = synthetic("t", {"seed": ["0"]})
    sw.run({"seed": "0"}, [0.1, 0.2], n=1, steps=16, status="running")
    _, runs = read_lab([sw.dir])
    r = runs.iloc[0]
    assert r.status == "unfinished" and not r.usable and math.isnan(r.train_last)


def _staleness(synthetic):
    """loss x N x 3 seeds; vespo = grpo + 0.05 on every seed; grpo seed 2 at N = 8 collapses."""
    sw = synthetic("st", {"loss": ["vespo", "grpo"], "N": ["1", "8"], "seed": ["0", "1", "2"]},
                   reference={"loss": "vespo"})
    evals = {}
    for seed, base in (("0", 0.40), ("1", 0.30), ("2", 0.50)):
        for n in ("1", "8"):
            g = base - (0.1 if n == "8" else 0.0)
            evals[("grpo", n, seed)], evals[("vespo", n, seed)] = g, g + 0.05
            rewards = [0.4, 0.5, 0.6, 0.6] if not (n == "8" and seed == "2") else [0.4, 0.5, 0.1, 0.0]
            sw.run({"loss": "grpo", "N": n, "seed": seed}, rewards, n=int(n), eval_sampled=g, eval_greedy=g + 0.3)
            sw.run({"loss": "vespo", "N": n, "seed": seed}, [0.4, 0.5, 0.6, 0.7], n=int(n), eval_sampled=g + 0.05,
                   eval_greedy=g + 0.3)
    return sw, evals


def test_condition_rows_give_the_mean_over_seeds_with_its_interval(synthetic):
    sw, evals = _staleness(synthetic)
    sweeps, runs = read_lab([sw.dir])
    head, *rows = cells(report.condition_table(sweeps["st"], runs))
    assert head[:9] == ["loss", "N", "runs", "held-out sampled", "held-out greedy", "train (last quarter)",
                        "updates to 0.6", "seconds to 0.6", "collapsed"]
    rows = {tuple(r[:2]): r for r in rows}
    vespo8 = rows[("vespo", "8")]
    ci = mean_ci([evals[("vespo", "8", s)] for s in "012"])
    assert vespo8[2] == "3" and vespo8[3] == ci_text(ci) == f"{ci.mean:.3f} [{ci.low:.3f}, {ci.high:.3f}]"
    assert vespo8[8] == "0/3"
    assert vespo8[6] == vespo8[7] == "never (0/3)"  # one window of 64 updates, mean training reward 0.55 < 0.6
    grpo8 = rows[("grpo", "8")]
    assert grpo8[8] == "1/3 (fell)"  # seed 2 fell below 0.6 x its best (0.3) at its last 2 of 4 evaluations
    assert grpo8[5] == ci_text(mean_ci([0.6, 0.6, 0.0]))  # train = the last quarter of 4 rows at N = 8 = row 4
    assert grpo8[9] == "8.000" and grpo8[11] == "[-4.00, 0.50]"  # max grad norm 2 x 4 rows; log W over all rows


def test_time_to_the_target_reward_is_the_same_measure_at_every_n(synthetic):
    """Windows of 64 updates of training reward (the same samples at every N): the first whose mean
    reaches 0.6 ends after 192 updates at N = 1 (rows 129..192) and at N = 64 (row 3)."""
    sw = synthetic("t", {"N": ["1", "64"], "seed": ["0"]})
    per_window = [0.3, 0.5, 0.62, 0.7]
    sw.run({"N": "1", "seed": "0"}, [per_window[k // 64] for k in range(256)], n=1, eval_sampled=0.6, step_s=0.5)
    sw.run({"N": "64", "seed": "0"}, per_window, n=64, eval_sampled=0.6, step_s=40.0)
    _, runs = read_lab([sw.dir])
    n1, n64 = runs.itertuples()
    assert n1.updates_to_target == n64.updates_to_target == 192.0
    assert n1.seconds_to_target == 192 * 0.5 and n64.seconds_to_target == 3 * 40.0
    sw2 = synthetic("u", {"seed": ["0"]})
    sw2.run({"seed": "0"}, [0.3, 0.5, 0.55, 0.59], n=64, eval_sampled=0.6)
    never = read_lab([sw2.dir])[1].iloc[0]
    assert math.isnan(never.updates_to_target) and math.isnan(never.seconds_to_target)


def test_paired_differences_against_vespo_seed_by_seed(synthetic):
    sw, evals = _staleness(synthetic)
    sweeps, runs = read_lab([sw.dir])
    head, *rows = cells(report.paired_table(sweeps["st"], runs))
    assert head == ["N", "loss", "Δ held-out sampled", "Δ held-out greedy", "Δ train (last quarter)", "seeds",
                    "higher in"]
    assert len(rows) == 2  # grpo at N = 1 and N = 8
    p = paired(by_seed(runs[(runs.loss == "grpo") & (runs.N == "8")], "eval_sampled"),
               by_seed(runs[(runs.loss == "vespo") & (runs.N == "8")], "eval_sampled"))
    assert p.diff.mean == pytest.approx(-0.05)
    assert rows[1][:2] == ["8", "grpo"] and rows[1][2] == ci_text(p.diff, signed=True) == "-0.050 [-0.050, -0.050]"
    assert rows[1][5:] == ["3", "0/3"]


def test_a_run_stopped_for_nonfinite_updates_counts_as_reward_zero(synthetic):
    sw = synthetic("t", {"loss": ["vespo"], "seed": ["0", "1"]})
    sw.run({"loss": "vespo", "seed": "0"}, [0.4, 0.5], eval_sampled=0.6)
    sw.run({"loss": "vespo", "seed": "1"}, [0.4, 0.5], returncode=1, stopped_nonfinite=True, status="failed")
    _, runs = read_lab([sw.dir])
    assert by_seed(runs, "eval_sampled").to_dict() == {"0": 0.6, "1": 0.0}
    assert runs.collapsed.tolist() == [False, True] and runs.reason.iloc[1] == "nonfinite"


def test_a_run_that_failed_otherwise_is_left_out_and_counted(synthetic):
    sw = synthetic("t", {"loss": ["vespo"], "seed": ["0", "1"]})
    sw.run({"loss": "vespo", "seed": "0"}, [0.4, 0.5], eval_sampled=0.6)
    sw.run({"loss": "vespo", "seed": "1"}, [0.4], returncode=1, status="failed")
    sweeps, runs = read_lab([sw.dir])
    assert by_seed(runs, "eval_sampled").to_dict() == {"0": 0.6}
    row = cells(report.condition_table(sweeps["t"], runs))[1]
    assert row[1] == "1 of 2 (1 not finished)" and row[2] == "0.600"


def test_report_main_writes_markdown_and_figures(synthetic, tmp_path):
    sw, _ = _staleness(synthetic)
    out = tmp_path / "rep"
    assert report_cli.main([str(sw.dir), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "![headline](headline.png)" in md and "Paired differences against loss = vespo" in md
    assert sorted(p.name for p in out.glob("*.png")) == ["grad_norm.png", "headline.png", "kl.png", "reward.png"]
    for png in out.glob("*.png"):
        data = png.read_bytes()
        assert data[:8] == PNG and len(data) > 5000


def test_layout_defaults_and_bad_axes():
    sweep = Sweep("s", [Axis("loss", ["a"]), Axis("N", ["1"]), Axis("seed", ["0"])])
    assert figures.layout(sweep, None, None) == ("loss", ["N"])
    assert figures.layout(sweep, "N", None) == ("N", ["loss"])
    assert figures.layout(Sweep("s", [Axis("kernel", ["a"]), Axis("seed", ["0"])]), None, None) == (None, ["kernel"])
    with pytest.raises(ValueError, match="--panel 'lr' is not a grid axis"):
        figures.layout(sweep, "lr", None)


def test_not_a_sweep_directory_is_named(tmp_path, capsys):
    assert report_cli.main([str(tmp_path)]) == 2
    assert "no sweep.json" in capsys.readouterr().err


def test_several_sweeps_need_a_page(tmp_path):
    with pytest.raises(SystemExit):
        report_cli.main([str(tmp_path / "a"), str(tmp_path / "b")])
