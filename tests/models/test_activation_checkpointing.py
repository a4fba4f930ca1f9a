"""Activation checkpointing (model.gradient_checkpointing): every decoder layer is recomputed in backward,
and the log-probs and gradients are those of the plain forward, on the shared-prompt path (whose KV cache
a recomputed layer reads again: PrefixCache) and the one-pass path."""

import pytest
import torch
from test_shared_prompts import grouped_batch

from vespo.config import ConfigError
from vespo.models import PrefixCache, build_char_tokenizer, enable_checkpointing, response_logprobs, tiny_model


def logprobs_grads_and_mlp_calls(arch, share_prompts, checkpointing):
    tok = build_char_tokenizer()
    model = tiny_model(arch, "xs", tokenizer=tok, seed=1).train()
    if checkpointing:
        enable_checkpointing(model)
    calls = []  # a pre-hook: a recompute that stops once it has what backward needs still enters the MLP
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    batch = grouped_batch(tok, T=9)
    coef = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1)) * batch[3]
    logp, _ = response_logprobs(model, *batch, share_prompts=share_prompts)
    (logp * coef).sum().backward()
    return logp.detach(), {n: p.grad for n, p in model.named_parameters()}, len(calls)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
@pytest.mark.parametrize("share_prompts", [True, False])
def test_checkpointing_recomputes_every_layer_with_the_same_gradients(arch, share_prompts):
    plain_logp, plain_grads, plain_calls = logprobs_grads_and_mlp_calls(arch, share_prompts, False)
    logp, grads, calls = logprobs_grads_and_mlp_calls(arch, share_prompts, True)
    assert calls == 2 * plain_calls  # each forward of the layer ran again in backward
    assert torch.allclose(logp, plain_logp, rtol=0, atol=1e-6)
    for name, grad in plain_grads.items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert torch.allclose(grads[name] / scale, grad / scale, rtol=0, atol=1e-6), name


def test_prefix_cache_updates_are_repeatable_and_select_gathers_rows():
    tok = build_char_tokenizer()
    model = tiny_model("qwen3", "nano", tokenizer=tok)
    k, v = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)  # [rows, kv heads, positions, head dim]
    prompts = PrefixCache(model.config)
    assert prompts.update(k, v, 0) == (k, v)  # nothing before the prompts
    rows = torch.tensor([2, 0])
    prompts.written = {i: (k, v) for i in range(len(prompts.layers))}
    cache = prompts.select(rows)
    new = torch.randn(2, 2, 1, 8)
    first, again = cache.update(new, new, 0), cache.update(new, new, 0)
    assert torch.equal(first[0], again[0]) and torch.equal(first[0], torch.cat([k[rows], new], dim=2))
    assert cache.get_seq_length() == 4  # the prefix alone: masks are sized for prefix + the new positions


def test_checkpointing_is_refused_where_it_cannot_act():
    tok = build_char_tokenizer()
    with pytest.raises(ConfigError, match="router replay"):
        enable_checkpointing(tiny_model("qwen3_moe", "nano", tokenizer=tok), replays=True)
    model = tiny_model("qwen3", "nano", tokenizer=tok)
    model.supports_gradient_checkpointing = False
    with pytest.raises(ConfigError, match="does not support activation checkpointing"):
        enable_checkpointing(model)
