"""Collapses against the learning rate on hand-made sweep directories: per lr the runs, the ones not
finished and the collapsed ones, and the table with each rate's exact interval."""

from vespo.lab import report
from vespo.lab.runs import read_lab
from vespo.lab.runs import lr_points, lr_text

from markdown_table import cells

LRS = {"5e-5": 5e-5, "1e-4": 1e-4, "2e-4": 2e-4}
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
                else:
                    sw.run(labels, DEAD if key in dead else HEALTHY, n=32, lr=lr, eval_sampled=0.0 if key in dead else 0.5)
    return read_lab([sw.dir])


def test_collapses_and_unfinished_runs_per_learning_rate(synthetic):
    dead = {("grpo", "2e-4", s) for s in "012"} | {("grpo", "1e-4", "1")}
    _, runs = _sweep(synthetic, dead, unfinished={("vespo", "2e-4", "0")})
    points = lr_points(runs[runs.loss == "grpo"])
    assert points.index.tolist() == [5e-5, 1e-4, 2e-4]
    assert points[["runs", "collapsed", "missing"]].values.tolist() == [[3, 0, 0], [3, 1, 0], [3, 3, 0]]
    assert lr_points(runs[runs.loss == "vespo"]).missing.tolist() == [0, 0, 1]


def test_the_lr_table(synthetic):
    dead = {("grpo", "2e-4", s) for s in "012"} | {("grpo", "1e-4", "1")}
    sweeps, runs = _sweep(synthetic, dead, unfinished={("vespo", "2e-4", "0")})
    head, vespo, grpo = cells(report.lr_table(sweeps["lr"], runs))
    assert head == ["loss", "5e-5", "1e-4", "2e-4"]
    # 1 of 3: Clopper-Pearson [beta.ppf(0.05, 1, 3), beta.ppf(0.95, 2, 2)] = [0.017, 0.865]; 3 of 3: [0.368, 1]
    assert grpo == ["grpo", "0/3: 0.00 [0.00, 0.63]", "1/3: 0.33 [0.02, 0.86]", "3/3: 1.00 [0.37, 1.00]"]
    assert vespo[3] == "0/2: 0.00 [0.00, 0.78] (+1)"


def test_lr_text():
    assert [lr_text(x) for x in (5e-5, 1e-4, 2.5e-4, 1e-3)] == ["5e-5", "1e-4", "2.5e-4", "1e-3"]
