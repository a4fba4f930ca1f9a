"""share_prompts: each distinct prompt runs once for all its rows, with the same log-probs and gradients.

The oracle is the plain path: one forward over every position of cat(prompt, response). In float32
(the models' RMSNorm computes in float32 whatever the input dtype) they agree to float32 rounding, not
bit for bit; in float64, with norms that keep float64, to float64 rounding (and activation
checkpointing changes nothing).
"""

import pytest
import torch
import torch.nn.functional as F

from vespo.models import build_char_tokenizer, enable_checkpointing, response_logprobs, tiny_model
from vespo.models import logprobs
from vespo.models.logprobs import distinct_rows, length_groups


def test_distinct_rows_hand_worked():
    # rows a, b, a, c, b: distinct rows a (first at 0), b (at 1), c (at 3); torch.unique sorts them
    a, b, c = [1, 2], [1, 3], [0, 9]
    first, which = distinct_rows(torch.tensor([a, b, a, c, b]))
    assert sorted(first.tolist()) == [0, 1, 3]
    rows = torch.tensor([a, b, a, c, b])
    assert torch.equal(rows[first][which], rows)  # every row is its representative
    assert distinct_rows(torch.tensor([a, b, c])) == (None, None)


def test_length_groups_hand_worked():
    # overhead 8: {64, 60} then {3, 2} costs (8 + 2*64) + (8 + 2*3) = 150; one group 8 + 4*64 = 264;
    # {64}, {60}, {3, 2} 72 + 68 + 14 = 154
    assert length_groups([64, 3, 60, 2], 8) == [([0, 2], 64), ([1, 3], 3)]
    # overhead 200: one group (200 + 4*64 = 456) beats two (400 + 134 = 534)
    assert length_groups([64, 3, 60, 2], 200) == [([0, 2, 1, 3], 64)]  # rows longest first
    assert length_groups([5, 5, 5], 0) == [([0, 1, 2], 5)]  # equal lengths never split
    assert length_groups([], 8) == []


def grouped_batch(tok, groups=4, G=6, T=9, seed=0):
    """Left-padded prompts, each repeated G times, and right-padded responses of random lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 5, 4][:groups]
    P = max(lengths)
    prompt_ids = torch.full((groups, P), tok.pad_token_id)
    prompt_mask = torch.zeros(groups, P, dtype=torch.long)
    for i, n in enumerate(lengths):
        prompt_ids[i, P - n:] = torch.randint(5, len(tok), (n,), generator=g)
        prompt_mask[i, P - n:] = 1
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
    n_resp = torch.randint(1, T + 1, (groups * G,), generator=g)
    response_mask = (torch.arange(T)[None] < n_resp[:, None]).float()  # [B, T]
    response_ids = torch.randint(5, len(tok), (groups * G, T), generator=g).masked_fill(response_mask == 0,
                                                                                         tok.pad_token_id)
    return prompt_ids, prompt_mask, response_ids, response_mask


def logprobs_and_grads(model, batch, share_prompts, coef):
    model.zero_grad(set_to_none=True)
    logp, ent = response_logprobs(model, *batch, share_prompts=share_prompts)
    (logp * coef).sum().backward()
    return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("overhead", [0, 10**9])  # every distinct length its own run / one run for all
def test_shared_prompts_match_one_pass(arch, T, overhead, monkeypatch):
    monkeypatch.setattr(logprobs, "GROUP_OVERHEAD_TOKENS", overhead)
    tok = build_char_tokenizer()
    model = tiny_model(arch, "xs", tokenizer=tok, seed=1)
    batch = grouped_batch(tok, T=T)
    coef = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1)) * batch[3]
    plain = logprobs_and_grads(model, batch, False, coef)
    shared = logprobs_and_grads(model, batch, True, coef)
    assert torch.allclose(shared[0], plain[0], atol=1e-5)
    assert torch.allclose(shared[1], plain[1], atol=1e-5)
    assert (shared[0][batch[3] == 0] == 0).all()
    assert plain[2].keys() == shared[2].keys()
    for name, grad in plain[2].items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert torch.allclose(shared[2][name] / scale, grad / scale, atol=1e-5), name


def float64_model(arch, seed=1):
    """A tiny model in float64 whose RMSNorms stay in float64 (transformers' cast their input to float32, which
    would bound any comparison by float32 rounding)."""
    model = tiny_model(arch, "xs", tokenizer=build_char_tokenizer(), seed=seed).double().train()
    for norm in (m for m in model.modules() if type(m).__name__.endswith("RMSNorm")):
        norm.forward = lambda x, m=norm: F.rms_norm(x, m.weight.shape, m.weight, m.variance_epsilon)
    return model


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # Qwen3-MoE's router softmax is float32 whatever the input
@pytest.mark.parametrize("overhead", [0, 10**9])
def test_shared_prompts_and_checkpointing_match_one_pass_in_float64(arch, overhead, monkeypatch):
    # measured: the shared-prompt path differs by <= 2e-15 in log-probs and entropy and <= 2e-15 of the largest
    # gradient entry; checkpointing by exactly 0
    monkeypatch.setattr(logprobs, "GROUP_OVERHEAD_TOKENS", overhead)
    batch = grouped_batch(build_char_tokenizer(), T=9)
    coef = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * batch[3]
    plain = logprobs_and_grads(float64_model(arch), batch, False, coef)
    assert plain[0].dtype == torch.float64
    for share, checkpointing in [(True, False), (True, True), (False, True)]:
        model = float64_model(arch)
        if checkpointing:
            enable_checkpointing(model)
        ours = logprobs_and_grads(model, batch, share, coef)
        assert torch.allclose(ours[0], plain[0], rtol=0, atol=1e-12)
        assert torch.allclose(ours[1], plain[1], rtol=0, atol=1e-12)
        assert ours[2].keys() == plain[2].keys()
        for name, grad in plain[2].items():
            scale = grad.abs().max()
            assert torch.allclose(ours[2][name] / scale, grad / scale, rtol=0, atol=1e-12), (share, name)


def test_unshared_prompts_and_single_rows():
    # all prompts distinct (no sharing, only the last position is skipped), and a batch of one row
    tok = build_char_tokenizer()
    model = tiny_model("qwen3", "nano", tokenizer=tok, seed=2)
    for batch in (grouped_batch(tok, groups=4, G=1), [x[:1] for x in grouped_batch(tok)]):
        with torch.no_grad():
            plain, _ = response_logprobs(model, *batch)
            shared, _ = response_logprobs(model, *batch, share_prompts=True)
        assert torch.allclose(shared, plain, atol=1e-5)


def test_share_prompts_refuses_router_replay():
    tok = build_char_tokenizer()
    model = tiny_model("qwen3_moe", "nano", tokenizer=tok)
    batch = grouped_batch(tok, groups=1, G=2, T=3)
    routed = torch.zeros(2, batch[0].shape[1] + 3, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="share_prompts cannot replay routed_experts"):
        response_logprobs(model, *batch, routed_experts=routed, share_prompts=True)
