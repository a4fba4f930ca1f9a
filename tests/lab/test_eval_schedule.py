"""Held-out evaluations after the same optimizer steps at every N (run.eval_every_updates): real tiny
runs of the trainer at N = 1 and N = 2 are evaluated after updates 2 and 4 alike, on the first
run.eval_every_size held-out problems; the collapse rule reads those points."""

import pytest

from vespo.config import ConfigError, load_config
from vespo.lab.collapse import evidence_of_rows
from vespo.metrics import read_jsonl
from vespo.trainer import train

TINY = ["model.arch=qwen3", "model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=500",
        "task.eval_size=8", "rollout.group_size=4", "staleness.minibatch_prompts=2", "staleness.behavior=recompute",
        "warmstart.steps=10", "run.updates=4", "run.checkpoint_every=0", "run.loggers=[jsonl]", "run.progress=false",
        "run.threads=1", "run.eval_every_updates=2", "run.eval_every_size=4"]


@pytest.mark.parametrize("n", [1, 2])
def test_evaluations_fall_after_the_same_updates_at_every_n(tmp_path, n):
    cfg = load_config(None, TINY + [f"staleness.n={n}", f"run.out_dir={tmp_path / 'run'}",
                                    f"warmstart.cache_dir={tmp_path / 'ws'}"])
    train(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evaluated = [int(r["step"]) * n for r in rows if "eval/reward_sampled" in r]
    assert evaluated == [2, 4]
    # 4 problems: each accuracy is a multiple of 1/4
    assert all((4 * r["eval/reward_sampled"]).is_integer() for r in rows if "eval/reward_sampled" in r)
    ev = evidence_of_rows(rows, n)
    assert ev.source == "held-out" and ev.updates == [2, 4]


def test_an_evaluation_schedule_that_n_does_not_divide_is_refused():
    with pytest.raises(ConfigError, match=r"run.eval_every_updates=3 must be a multiple of staleness.n=2"):
        load_config(None, TINY + ["staleness.n=2", "run.eval_every_updates=3"])
