"""Runs of one seed pair only where they trained from the same shared start: a seed whose two runs record different
on-policy starts (the start's updates and held-out accuracy, as the runs' summaries hold them) is left out of that
comparison, and the report says which and why."""

from vespo.lab import report
from vespo.lab.runs import read_lab

from markdown_table import cells


def _paired(text: str) -> list[list[str]]:
    return cells(text.split("Paired differences against")[1].split("\n\n")[1])


def test_a_seed_whose_runs_started_apart_is_not_a_pair(synthetic):
    sw = synthetic("st", {"loss": ["vespo", "grpo", "dppo_tv"], "seed": ["0", "1", "2"]}, reference={"loss": "vespo"})
    # seeds 0 and 1: every run from the seed's one start; seed 2: grpo's run from a start remade elsewhere
    starts = {"0": (24, 0.207), "1": (16, 0.223), "2": (12, 0.234)}
    for seed, v, g, t in (("0", 0.30, 0.20, 0.35), ("1", 0.40, 0.36, 0.45), ("2", 0.50, 0.90, 0.55)):
        sw.run({"loss": "vespo", "seed": seed}, [0.3], eval_sampled=v, start=starts[seed])
        sw.run({"loss": "grpo", "seed": seed}, [0.3], eval_sampled=g,
               start=(48, 0.109) if seed == "2" else starts[seed])
        sw.run({"loss": "dppo_tv", "seed": seed}, [0.3], eval_sampled=t, start=starts[seed])
    sweeps, runs = read_lab([sw.dir])
    text = report.sweep_tables(sweeps["st"], runs)
    rows = {r[0]: r for r in _paired(text)[1:]}
    # grpo - vespo on seeds 0 and 1 only: -0.10, -0.04 -> mean -0.070 (seed 2's +0.40 would make it +0.087)
    assert rows["grpo"][1].startswith("-0.070") and rows["grpo"][-2:] == ["2", "0/2"]
    assert rows["dppo_tv"][1].startswith("+0.050") and rows["dppo_tv"][-2:] == ["3", "3/3"]
    assert ("Seed 2 is left out of loss = grpo against loss = vespo: its two runs trained from different shared "
            "starts (48 updates, 0.109 against 12 updates, 0.234;") in text
    assert text.count("is left out of") == 1


def test_runs_without_a_recorded_start_pair_as_before(synthetic):
    sw = synthetic("st", {"loss": ["vespo", "grpo"], "seed": ["0", "1"]}, reference={"loss": "vespo"})
    for seed, v, g in (("0", 0.3, 0.2), ("1", 0.4, 0.5)):
        sw.run({"loss": "vespo", "seed": seed}, [0.3], eval_sampled=v, start=(8, 0.2) if seed == "0" else None)
        sw.run({"loss": "grpo", "seed": seed}, [0.3], eval_sampled=g)
    sweeps, runs = read_lab([sw.dir])
    text = report.sweep_tables(sweeps["st"], runs)
    assert _paired(text)[1][-2:] == ["2", "1/2"] and "is left out of" not in text
