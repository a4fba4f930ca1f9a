"""The learning-rate range on hand-made sweep directories: the widest run of learning rates where no
seed collapsed, its width and reward, and what breaks it (one collapsed seed, an unfinished run)."""

import pandas as pd

from vespo.lab import tables
from vespo.lab.runs import read_lab
from vespo.lab.tables import lr_points, lr_text, widest_stable

from conftest import cells

LRS = {"5e-5": 5e-5, "1e-4": 1e-4, "2e-4": 2e-4, "3e-4": 3e-4, "5e-4": 5e-4}
HEALTHY, DEAD = [0.3, 0.4, 0.5, 0.55], [0.3, 0.4, 0.05, 0.0]  # DEAD falls below 0.6 x its best at row 3


def _sweep(synthetic, dead, unfinished=()):
    """dead / unfinished: sets of (loss, lr label, seed)."""
    sw = synthetic("lr", {"seed": ["0", "1", "2"], "lr": list(LRS), "loss": ["vespo", "grpo"]})
    for seed in "012":
        for label, lr in LRS.items():
            for loss in ("vespo", "grpo"):
                key, labels = (loss, label, seed), {"seed": seed, "lr": label, "loss": loss}
                if key in unfinished:
                    sw.run(labels, HEALTHY[:2], n=32, lr=lr, steps=4, status="running")
                else:  # higher lr, higher reward while it holds
                    sw.run(labels, DEAD if key in dead else HEALTHY, n=32, lr=lr,
                           eval_sampled=0.0 if key in dead else 0.4 + 100 * lr + 0.01 * int(seed))
    return read_lab([sw.dir])


def _ranges(runs):
    return {loss: widest_stable(lr_points(runs[runs.loss == loss])) for loss in ("vespo", "grpo")}


def test_widest_interval_without_a_collapsed_seed(synthetic):
    # vespo: every seed dies at 5e-4 only -> stable 5e-5 .. 3e-4 (6x).
    # grpo: one seed of three dies at 2e-4, all die at 5e-4 -> stable runs [5e-5, 1e-4] (2x) and [3e-4] (1x).
    dead = {("vespo", "5e-4", s) for s in "012"} | {("grpo", "5e-4", s) for s in "012"} | {("grpo", "2e-4", "1")}
    _, runs = _sweep(synthetic, dead)
    assert _ranges(runs) == {"vespo": (5e-5, 3e-4), "grpo": (5e-5, 1e-4)}
    points = lr_points(runs[runs.loss == "grpo"])
    assert points[["collapsed", "runs"]].values.tolist() == [[0, 3], [0, 3], [1, 3], [0, 3], [3, 3]]


def test_an_unfinished_run_breaks_the_interval(synthetic):
    _, runs = _sweep(synthetic, dead=set(), unfinished={("vespo", "2e-4", "0")})
    # vespo's stable points: 5e-5, 1e-4 | (2e-4 incomplete) | 3e-4, 5e-4: 2x beats 5e-4 / 3e-4 = 1.67x
    assert _ranges(runs) == {"vespo": (5e-5, 1e-4), "grpo": (5e-5, 5e-4)}
    assert lr_points(runs[runs.loss == "vespo"]).missing.tolist() == [0, 0, 1, 0, 0]


def test_no_stable_learning_rate():
    assert widest_stable(pd.DataFrame({"stable": [False, False]}, index=[1e-4, 2e-4])) is None


def test_the_lr_table(synthetic):
    dead = {("vespo", "5e-4", s) for s in "012"} | {("grpo", "2e-4", "1")}
    sweeps, runs = _sweep(synthetic, dead)
    head, vespo, grpo = cells(tables.lr_table(sweeps["lr"], runs))
    assert head == ["loss", "stable lr range", "width", "best held-out sampled in it",
                    "per lr: collapsed/runs, rate [90% exact interval]"]
    assert vespo[:3] == ["vespo", "5e-5 to 3e-4", "6x"] and vespo[3].startswith("0.440 [") and vespo[3].endswith("at 3e-4")
    assert grpo[:3] == ["grpo", "5e-5 to 1e-4", "2x"]  # beats 3e-4 to 5e-4 (1.67x)
    # 1 of 3: Clopper-Pearson [beta.ppf(0.05, 1, 3), beta.ppf(0.95, 2, 2)] = [0.017, 0.865]; 3 of 3: [0.368, 1]
    assert "2e-4: 1/3 [0.02, 0.86]" in grpo[4] and "5e-4: 3/3 [0.37, 1.00]" in vespo[4]


def test_lr_text():
    assert [lr_text(x) for x in (5e-5, 1e-4, 2.5e-4, 1e-3)] == ["5e-5", "1e-4", "2.5e-4", "1e-3"]
