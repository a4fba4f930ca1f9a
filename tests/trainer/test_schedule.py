"""The run's schedule is one value made from the config (Run.schedule), read by the loop and both sample sources;
the derived batch sizes and run length are read from the config's derived values, never from the raw fields."""

import ast
from pathlib import Path

from vespo.config import load_config
from vespo.trainer.protocols import Schedule

SRC = Path(__file__).resolve().parents[2] / "src" / "vespo"


def test_a_sync_schedule_counts_steps_of_n_updates_and_lags_up_to_n_minus_1():
    s = Schedule.of(load_config(None, ["staleness.n=4", "run.steps=3", "rollout.prompts_per_step=8"]))
    assert (s.n, s.steps, s.total, s.max_lag) == (4, 3, 12, 3)
    assert [s.step(u) for u in (0, 3, 4, 11, 12)] == [0, 0, 1, 2, 3]
    assert [u for u in range(13) if s.ends_step(u)] == [0, 4, 8, 12]


def test_an_async_schedule_bounds_lag_by_max_staleness_and_run_updates_set_the_length():
    cfg = load_config(None, ["run.mode=async", "staleness.n=2", "async.max_staleness=5", "run.updates=10",
                             "rollout.prompts_per_step=8"])
    assert Schedule.of(cfg) == Schedule(n=2, steps=5, max_lag=5) and Schedule.of(cfg).total == cfg.total_updates


def test_no_module_reads_a_raw_field_that_a_derived_value_replaces():
    """rollout.prompts_per_step and run.steps are what was written; cfg.prompts_per_step and cfg.steps (config.py)
    are what the run uses (staleness.minibatch_prompts, run.updates): only config.py reads the raw fields."""
    raw = {("rollout", "prompts_per_step"), ("run", "steps"), ("staleness", "minibatch_prompts")}
    found = [f"{path.relative_to(SRC)}:{node.lineno}" for path in SRC.rglob("*.py") if path.name != "config.py"
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Attribute) and (node.value.attr, node.attr) in raw]
    assert found == []
