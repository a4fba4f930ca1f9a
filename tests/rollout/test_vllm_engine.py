"""The optional vLLM engine: lazy import on CPU, real generation only with CUDA and vLLM."""

import importlib.util

import pytest
import torch

from vespo.models import build_char_tokenizer, response_logprobs, tiny_model
from vespo.rollout import SamplingParams

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_vllm_engine_imports_lazily():
    from vespo.rollout import VLLMEngine  # must not need vLLM installed

    assert VLLMEngine.__name__ == "VLLMEngine"


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed; this checks the error raised without it")
def test_missing_vllm_error_says_how_to_install():
    from vespo.rollout import VLLMEngine

    tok = build_char_tokenizer()
    with pytest.raises(ImportError, match=r"vespo\[vllm\]"):
        VLLMEngine(tiny_model("qwen3", "nano", tokenizer=tok), tok)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vLLM and a CUDA device")
def test_vllm_logprobs_match_trainer_recompute():
    from vespo.rollout import VLLMEngine

    tok = build_char_tokenizer()
    model = tiny_model("qwen3", "xs", tokenizer=tok)
    engine = VLLMEngine(model, tok, dtype="float32")
    rollout = engine.generate([tok.encode("12+3=")] * 4, SamplingParams(max_new_tokens=8), seed=0)
    with torch.no_grad():
        logp, _ = response_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                    rollout.response_mask)
    assert torch.allclose(rollout.logprobs, logp, atol=1e-3)
