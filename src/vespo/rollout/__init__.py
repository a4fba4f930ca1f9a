"""Rollout: the engine protocol, sampling parameters and the Hugging Face backend.

    from vespo.rollout import SamplingParams, RolloutEngine, HFEngine
    engine = HFEngine(model, tokenizer, dtype="float32")
    rollout = engine.generate(prompt_ids, SamplingParams(max_new_tokens=32), seed=0)
    completions = TextGenerator(engine, tokenizer)(problems, n=4, sampling=params, seed=0)

``VLLMEngine`` (``vespo.rollout.vllm``) is imported lazily: ``from vespo.rollout import VLLMEngine``
works without vLLM installed and fails only when the engine is built.
"""

from vespo.rollout.base import RolloutEngine, SamplingParams, sampling_logprobs
from vespo.rollout.hf import GenerationState, HFEngine
from vespo.rollout.text import TextGenerator, decode_responses, encode_problems, greedy

__all__ = ["GenerationState", "HFEngine", "RolloutEngine", "SamplingParams", "TextGenerator", "VLLMEngine",
           "decode_responses", "encode_problems", "greedy", "sampling_logprobs"]


def __getattr__(name: str):
    if name == "VLLMEngine":
        from vespo.rollout.vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module 'vespo.rollout' has no attribute {name!r}")
