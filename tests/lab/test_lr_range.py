"""The learning-rate range on hand-made sweep directories: the widest run of learning rates where no
seed collapsed, its width and reward, and what breaks it (one collapsed seed, an unfinished run)."""

import pytest

from vespo.lab import tables
from vespo.lab.lr_range import lr_ranges, lr_text, widest_stable
from vespo.lab.results import read_sweep
from vespo.lab.stats import mean_ci

LRS = {"5e-5": 5e-5, "1e-4": 1e-4, "2e-4": 2e-4, "3e-4": 3e-4, "5e-4": 5e-4}
HEALTHY, DEAD = [0.3, 0.4, 0.5, 0.55], [0.3, 0.4, 0.05, 0.0]  # DEAD falls below half its best (0.2) at row 3


def _sweep(synthetic, dead, unfinished=()):
    """dead / unfinished: sets of (loss, lr label, seed)."""
    sw = synthetic("lr", {"seed": ["0", "1", "2"], "lr": list(LRS), "loss": ["vespo", "grpo"]})
    for seed in "012":
        for label, lr in LRS.items():
            for loss in ("vespo", "grpo"):
                key = (loss, label, seed)
                reward = 0.4 + 100 * lr + 0.01 * int(seed)  # higher lr, higher reward while it holds
                if key in unfinished:
                    sw.run({"seed": seed, "lr": label, "loss": loss}, HEALTHY[:2], n=32, lr=lr, steps=4,
                           status="running")
                else:
                    sw.run({"seed": seed, "lr": label, "loss": loss}, DEAD if key in dead else HEALTHY, n=32, lr=lr,
                           eval_sampled=0.0 if key in dead else reward)
    return read_sweep(sw.dir)


def test_widest_interval_without_a_collapsed_seed(synthetic):
    # vespo: every seed dies at 5e-4 only -> stable 5e-5 .. 3e-4 (6x).
    # grpo: one seed of three dies at 2e-4, all die at 5e-4 -> stable runs [5e-5, 1e-4] (2x) and [3e-4] (1x).
    dead = {("vespo", "5e-4", s) for s in "012"} | {("grpo", "5e-4", s) for s in "012"} | {("grpo", "2e-4", "1")}
    record, results = _sweep(synthetic, dead)
    vespo, grpo = lr_ranges(record, results)
    assert vespo.condition == {"loss": "vespo"} and grpo.condition == {"loss": "grpo"}
    assert (vespo.low, vespo.high, vespo.width) == (5e-5, 3e-4, pytest.approx(6.0))
    assert (grpo.low, grpo.high, grpo.width) == (5e-5, 1e-4, pytest.approx(2.0))
    # its reward: the best mean over seeds inside the interval, with its interval
    assert vespo.best.lr == 3e-4 and vespo.best.reward == mean_ci([0.4 + 100 * 3e-4 + 0.01 * s for s in range(3)])
    assert [(p.lr, p.collapsed, p.runs) for p in grpo.points] == [
        (5e-5, 0, 3), (1e-4, 0, 3), (2e-4, 1, 3), (3e-4, 0, 3), (5e-4, 3, 3)]


def test_an_unfinished_run_breaks_the_interval(synthetic):
    record, results = _sweep(synthetic, dead=set(), unfinished={("vespo", "2e-4", "0")})
    vespo, grpo = lr_ranges(record, results)
    # vespo's stable points: 5e-5, 1e-4 | (2e-4 incomplete) | 3e-4, 5e-4: 2x beats 5e-4 / 3e-4 = 1.67x
    assert (vespo.low, vespo.high) == (5e-5, 1e-4) and vespo.points[2].missing == 1
    assert (grpo.low, grpo.high, grpo.width) == (5e-5, 5e-4, pytest.approx(10.0))


def test_no_stable_learning_rate():
    assert widest_stable([]) == (None, None, None)


def test_the_lr_table(synthetic):
    dead = {("vespo", "5e-4", s) for s in "012"} | {("grpo", "2e-4", "1")}
    record, results = _sweep(synthetic, dead)
    table = tables.lr_table(record, results).splitlines()
    assert table[0] == ("| loss | stable lr range | width | best held-out sampled in it | per lr: collapsed/runs, "
                        "rate [90% exact interval] |")
    assert table[2].startswith("| vespo | 5e-5 to 3e-4 | 6x | 0.440 [")
    assert table[3].startswith("| grpo | 5e-5 to 1e-4 | 2x |")  # beats 3e-4 to 5e-4 (1.67x)
    # 1 of 3: Clopper-Pearson [beta.ppf(0.05, 1, 3), beta.ppf(0.95, 2, 2)] = [0.017, 0.865]; 3 of 3: [0.368, 1]
    assert "2e-4: 1/3 [0.02, 0.86]" in table[3] and "5e-4: 3/3 [0.37, 1.00]" in table[2]


def test_lr_text():
    assert [lr_text(x) for x in (5e-5, 1e-4, 2.5e-4, 1e-3)] == ["5e-5", "1e-4", "2.5e-4", "1e-3"]
