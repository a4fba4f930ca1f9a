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


@_tests.needs_env
def test_an_async_run_with_a_vllm_rollout_worker():
    """sync_every=1 and max_staleness=0: every mini-batch is sampled by the weights just pushed to the worker's
    engine, so its behaviour log-probs equal the learner's recompute to rounding (a stale engine would not)."""
    _tests._assert_short_run(_tests.run_check("async")["async"], updates=4)


@pytest.mark.slow
@_tests.needs_env
def test_an_async_run_on_the_real_model_with_a_vllm_rollout_worker():
    r = _tests.run_check("real_async", timeout=1800)["real_async"]
    assert r["status"] == "done" and r["version"] == 2 and r["weights_moved"] > 0 and r["checkpoints"]
    assert r["mismatch_max"] and max(r["mismatch_max"]) < _tests.REAL_SAME, r["mismatch_max"]
