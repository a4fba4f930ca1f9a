"""The page's evaluation-noise paragraph reads the sweeps that evaluate on the problem count most runs have; a sweep
on fewer problems (the real model's 256 beside the tiny lab's 1024) is named apart, not averaged in, and the
collapse check names each sweep's count."""

import math

from vespo.lab import report
from vespo.lab.runs import read_lab


def test_a_sweep_on_fewer_problems_is_named_apart_not_averaged_in(synthetic):
    tiny = synthetic("tiny", {"loss": ["vespo", "grpo"], "seed": ["0", "1", "2"]}, reference={"loss": "vespo"})
    real = synthetic("real", {"loss": ["vespo", "grpo"], "seed": ["0", "1"]}, reference={"loss": "vespo"})
    for seed, v, g in (("0", 0.60, 0.50), ("1", 0.70, 0.68), ("2", 0.50, 0.53)):
        tiny.run({"loss": "vespo", "seed": seed}, [0.5], eval_sampled=v, eval_size=1024)
        tiny.run({"loss": "grpo", "seed": seed}, [0.5], eval_sampled=g, eval_size=1024)
    for seed, v, g in (("0", 0.10, 0.02), ("1", 0.20, 0.40)):
        real.run({"loss": "vespo", "seed": seed}, [0.1], eval_sampled=v, eval_size=256)
        real.run({"loss": "grpo", "seed": seed}, [0.1], eval_sampled=g, eval_size=256)
    sweeps, runs = read_lab([tiny.dir, real.dir])
    said = report.noise(sweeps, runs)
    p = (0.60 + 0.50 + 0.70 + 0.68 + 0.50 + 0.53) / 6  # the tiny sweep's six runs only: 0.585
    assert f"at the lab's mean accuracy {p:.2f}" in said["noise"] and f"{math.sqrt(p * (1 - p) / 1024):.3f}" in \
        said["noise"]
    # the tiny sweep's one reference difference (-0.030), not the real sweep's (+0.060)
    assert "1 of the 1 differences" in said["noise"] and "their median 0.030" in said["noise"]
    assert "(256 in `real`) are left out of these figures" in said["noise"]
    assert said["problems"] == "its sweep's held-out problems (1024; 256 in `real`)"


def test_one_problem_count_names_no_other(synthetic):
    tiny = synthetic("tiny", {"loss": ["vespo", "grpo"], "seed": ["0", "1"]}, reference={"loss": "vespo"})
    for seed in ("0", "1"):
        for loss, value in (("vespo", 0.6), ("grpo", 0.5)):
            tiny.run({"loss": loss, "seed": seed}, [0.5], eval_sampled=value, eval_size=1024)
    said = report.noise(*read_lab([tiny.dir]))
    assert said["problems"] == "its sweep's held-out problems (1024)" and "left out" not in said["noise"]
