"""An async run whose Ray rollout worker samples with vLLM on the CPU (tests/rollout/vllm_check.py's async mode,
run in .venv-vllm; scripts/setup_vllm_env.sh builds it). In its own file, so the test suite's workers run it beside
the engine checks of tests/rollout/test_vllm_engine.py (each loads vLLM: about a minute)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "vllm_engine_tests", Path(__file__).resolve().parents[1] / "rollout" / "test_vllm_engine.py")
_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests)


def _assert_weights_reached_the_worker(r: dict, updates: int) -> None:
    """Every update's weights were pushed, and each mini-batch (ticket t, trained at learner version t) was sampled by
    the worker's engine holding version t: the versions it stamps are those of its last ``load_weights``."""
    assert r["weight_pushes"] >= updates
    tickets = r["tickets"]
    assert [t["ticket"] for t in tickets] == list(range(updates))
    for t in tickets:
        assert t["token_version_min"] == t["token_version_max"] == t["learner_version"] == t["ticket"], t
    assert all(t["token_version_min"] > 0 for t in tickets[1:])  # the later samples came from pushed weights


@_tests.needs_env
def test_an_async_run_with_a_vllm_rollout_worker():
    """sync_every=1 and max_staleness=0: every mini-batch is sampled by the weights just pushed to the worker's
    engine, so its behaviour log-probs equal the learner's recompute to rounding (a stale engine would not)."""
    r = _tests.run_check("async")["async"]
    _tests._assert_short_run(r, updates=4)  # 4 updates done, the mismatch of every step within SAME
    _assert_weights_reached_the_worker(r, updates=4)


@pytest.mark.slow
@_tests.needs_env
def test_an_async_run_on_the_real_model_with_a_vllm_rollout_worker():
    r = _tests.run_check("real_async", timeout=1800)["real_async"]
    assert r["status"] == "done" and r["version"] == 2 and r["weights_moved"] > 0 and r["checkpoints"]
    assert r["mismatch_max"] and max(r["mismatch_max"]) < _tests.REAL_SAME, r["mismatch_max"]
    _assert_weights_reached_the_worker(r, updates=2)
