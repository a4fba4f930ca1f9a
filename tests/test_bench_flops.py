"""bench/real_model.py counts a decoder's forward FLOPs from its config; torch's own FLOP counter, run on a real
(tiny) Hugging Face model's forward, is the independent reference."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

spec = importlib.util.spec_from_file_location("real_model", Path(__file__).parents[1] / "bench" / "real_model.py")
real_model = sys.modules["real_model"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(real_model)


@pytest.mark.parametrize("kv_heads,tokens", [(4, 7), (2, 16)])
def test_forward_flops_match_torch_flop_counter(kv_heads, tokens):
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=kv_heads, attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    arch = real_model.ArchFlops.of(config)
    linear = sum(m.weight.numel() for name, m in model.model.layers[0].named_modules()
                 if isinstance(m, torch.nn.Linear))
    assert arch.linear_weights == linear
    ids = torch.randint(0, 97, (1, tokens))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, use_cache=False)
    # eager attention multiplies the full tokens x tokens score matrix (the causal mask saves it nothing)
    assert arch.body(tokens, tokens * tokens) + arch.head(tokens) == counter.get_total_flops()


def test_batch_forward_flops_by_hand():
    """One prompt of 3 tokens shared by two responses of 2 and 1 tokens, worked out by hand."""
    arch = real_model.ArchFlops(layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=3, vocab=5)
    w = 2 * 4 + 2 * 4 + 3 * 6  # q, o (2x2 each), k, v (2x2 each), the MLP's three 2x3: 34 weights
    assert arch.linear_weights == w
    prompt_ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1], [1, 0]])
    prompt = 2 * w * 3 + 4 * 2 * (1 + 2 + 3)  # once: 3 positions attending to 1, 2, 3 keys
    first = 2 * w * 1 + 4 * 2 * 4 + 2 * 5 * 2 * 2  # response 1: one position on 4 keys, the head on 2 tokens
    second = 2 * 5 * 2 * 1  # response 2: no position runs through the body, the head on its one token
    assert real_model.batch_forward_flops(arch, prompt_ids, prompt_mask, response_mask) == prompt + first + second


def test_engine_weight_bytes_of_an_engine_without_a_module():
    """The rollout bound reads the engine's weights once per decode step: an HF engine's own module as it is held,
    vLLM's (inside its engine core) as the learner's parameter count at the engine's dtype."""
    params = [torch.zeros(3, 4), torch.zeros(5)]
    learner = type("Learner", (), {"params": params})()
    hf = type("HF", (), {"model": torch.nn.Linear(4, 2, dtype=torch.bfloat16)})()
    assert real_model.engine_weight_bytes(hf, learner, "float32") == (8 + 2) * 2
    vllm = object()
    assert real_model.engine_weight_bytes(vllm, learner, "bfloat16") == 17 * 2
    assert real_model.engine_weight_bytes(vllm, learner, "float32") == 17 * 4
