"""run.compile: torch.compile'd decoder layers give the eager log-probs and gradients; eager where it cannot compile."""

import copy

import pytest
import torch

from vespo.models import build_char_tokenizer, compile_decoder_layers, response_logprobs, tiny_model


def grouped_batch(vocab: int, pad: int, groups: int, G: int, P: int, T: int, seed: int):
    """Left-padded prompts repeated G times, right-padded responses of random lengths."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(5, vocab, (groups, P), generator=g)
    prompt_mask = torch.ones(groups, P, dtype=torch.long)
    prompt_ids[0, :2], prompt_mask[0, :2] = pad, 0
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
    lengths = torch.randint(1, T + 1, (groups * G,), generator=g)
    response_mask = (torch.arange(T)[None] < lengths[:, None]).float()  # [B, T]
    response_ids = torch.randint(5, vocab, (groups * G, T), generator=g).masked_fill(response_mask == 0, pad)
    return prompt_ids, prompt_mask, response_ids, response_mask


def logprobs_and_grads(model, batch, share_prompts):
    model.zero_grad(set_to_none=True)
    logp, ent = response_logprobs(model, *batch, share_prompts=share_prompts)
    (logp * batch[3]).sum().backward()
    return logp.detach(), ent, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # 1-1.5 min each on a 2-core CI machine; the fallback to eager below stays in the default run
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_compiled_layers_match_eager(arch):
    tok = build_char_tokenizer()
    eager = tiny_model(arch, "nano", tokenizer=tok, seed=4)
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled)
    # two shapes per path: the layers' graphs are dynamic, and both must stay exact
    for seed, (groups, T) in enumerate([(3, 7), (2, 11)]):
        batch = grouped_batch(len(tok), tok.pad_token_id, groups, 4, 5, T, seed)
        for share_prompts in (True, False):
            want = logprobs_and_grads(eager, batch, share_prompts)
            got = logprobs_and_grads(compiled, batch, share_prompts)
            assert torch.allclose(got[0], want[0], atol=1e-5)
            assert torch.allclose(got[1], want[1], atol=1e-5)
            assert got[2].keys() == want[2].keys()
            for name, grad in want[2].items():
                scale = grad.abs().max().clamp(min=1e-6)
                assert torch.allclose(got[2][name] / scale, grad / scale, atol=1e-5), name


def test_falls_back_to_eager_when_compilation_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    tok = build_char_tokenizer()
    model = tiny_model("qwen3", "nano", tokenizer=tok)
    with pytest.warns(UserWarning, match="running eager"):
        assert compile_decoder_layers(model) is False
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in model.model.layers)
    with torch.no_grad():
        logp, _ = response_logprobs(model, *grouped_batch(len(tok), tok.pad_token_id, 2, 2, 4, 3, 0))
    assert torch.isfinite(logp).all()
