"""Chunked response log-probs and entropy against naive and float64 references."""

import math

import pytest
import torch

from vespo.models import (
    build_char_tokenizer,
    chunked_logprobs,
    positions_from_mask,
    response_logprobs,
    tiny_model,
)
from vespo.models import chunked as chunked_module
from vespo.models.chunked import chunk_shape


def test_hand_worked_two_token_vocab():
    # h = [1], W = [[1], [0]] -> logits z = [1, 0]; lse = log(e + 1) = 1.3132617
    # logp(token 0) = 1 - 1.3132617 = -0.3132617; logp(token 1) = -1.3132617
    # entropy = lse - sum(p * z) = 1.3132617 - 0.7310586 * 1 = 0.5822031
    h = torch.tensor([[1.0], [1.0]])
    w = torch.tensor([[1.0], [0.0]])
    logp, ent = chunked_logprobs(h, w, None, torch.tensor([0, 1]), temperature=1.0, chunk_size=1)
    assert torch.allclose(logp, torch.tensor([-0.3132617, -1.3132617]), atol=1e-6)
    assert torch.allclose(ent, torch.tensor([0.5822031, 0.5822031]), atol=1e-6)
    # temperature 2: z = [0.5, 0]; logp(0) = 0.5 - log(e^0.5 + 1) = 0.5 - 0.9740770 = -0.4740770
    logp2, _ = chunked_logprobs(h[:1], w, None, torch.tensor([0]), temperature=2.0, chunk_size=4)
    assert math.isclose(logp2.item(), -0.4740770, abs_tol=1e-6)


def reference_logprobs(h, w, b, targets, temperature):
    """Float64 log-softmax and entropy, the obvious way: [N], [N]."""
    z = (h.double() @ w.double().T + (0 if b is None else b.double())) / temperature  # [N, V]
    logsm = torch.log_softmax(z, dim=-1)
    return logsm.gather(-1, targets[:, None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


def assert_matches_oracle(h, w, b, targets, temp, chunk_size, coef):
    """Chunked log-probs, entropy and the gradients of sum(coef * logp) equal the float64 oracle's."""
    logp, ent = chunked_logprobs(h, w, b, targets, temp, chunk_size)
    (logp * coef).sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    ref_logp, ref_ent = reference_logprobs(h64, w64, b64, targets, temp)
    (ref_logp * coef.double()).sum().backward()

    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)
    assert not ent.requires_grad
    assert torch.allclose(h.grad.double(), h64.grad, atol=1e-5)
    assert torch.allclose(w.grad.double(), w64.grad, atol=1e-5)
    if b is not None:
        assert torch.allclose(b.grad.double(), b64.grad, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_matches_float64_oracle_values_and_grads(chunk_size, with_bias):
    g = torch.Generator().manual_seed(chunk_size)
    N, H, V, temp = 23, 16, 50, 0.7
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g).mul(0.5).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if with_bias else None
    targets = torch.randint(V, (N,), generator=g)
    coef = torch.randn(N, generator=g)  # a random upstream gradient

    assert_matches_oracle(h, w, b, targets, temp, chunk_size, coef)


def test_autograd_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.tensor([0, 5, 2, 2, 1])
    assert torch.autograd.gradcheck(lambda h, w: chunked_logprobs(h, w, None, targets, 1.3, 2)[0], (h, w))


def test_chunk_shape_caps_the_block_at_chunk_elements():
    # 2^25 = 33554432 logits per block; V = 151936 (Qwen-size vocab)
    assert chunk_shape(1024, 151936) == (1024, 32768)  # 2^25 / 1024 = 32768 entries: 5 blocks of the vocab
    assert chunk_shape(10_000, 151936) == (4096, 8192)  # tokens capped at 4096; 2^25 / 4096 = 8192
    assert chunk_shape(3, 50) == (3, 50)  # small problems: one block, the whole vocab
    assert chunk_shape(3, 151936, chunk_size=256) == (256, 131072)  # 2^25 / 256
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_shape(3, 50, chunk_size=0)
    with pytest.raises(ValueError, match="vocab"):
        chunk_shape(3, 0)


@pytest.mark.parametrize("chunk_elements", [7, 60, 1 << 25])  # vocab blocks of 1, 8 (last one 2) and all 50
@pytest.mark.parametrize("with_bias", [False, True])
def test_vocab_blocks_match_float64_oracle(monkeypatch, chunk_elements, with_bias):
    for name in ("CHUNK_ELEMENTS", "CPU_CHUNK_ELEMENTS"):  # the GPU cap and the CPU one
        monkeypatch.setattr(chunked_module, name, chunk_elements)
    g = torch.Generator().manual_seed(chunk_elements)
    N, H, V, temp = 23, 16, 50, 0.7
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g).mul(0.5).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if with_bias else None
    targets = torch.cat([torch.tensor([0, V - 1, 7, 8]), torch.randint(V, (N - 4,), generator=g)])  # block edges
    coef = torch.randn(N, generator=g)
    assert chunk_shape(N, V, 7)[1] == min(V, max(1, chunk_elements // 7))

    assert_matches_oracle(h, w, b, targets, temp, 7, coef)


def test_large_logits_entropy_and_block_maxima_in_later_blocks(monkeypatch):
    # logits of size ~40 with the largest in the last vocab block: the running max must be rescaled
    for name in ("CHUNK_ELEMENTS", "CPU_CHUNK_ELEMENTS"):  # the GPU cap and the CPU one
        monkeypatch.setattr(chunked_module, name, 4 * 10)  # 4 tokens per chunk -> 10 entries per block
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, 8, generator=g)
    w = torch.randn(35, 8, generator=g) * 4
    w[30:] *= 3  # the last block holds the largest logits
    targets = torch.randint(35, (9,), generator=g)
    logp, ent = chunked_logprobs(h, w, None, targets, 1.0, 4)
    ref_logp, ref_ent = reference_logprobs(h, w, None, targets, 1.0)
    assert (h @ w.T).abs().max() > 40
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)


def test_without_entropy_same_logp_and_grads():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(11, 6, generator=g)
    w = torch.randn(20, 6, generator=g)
    targets = torch.randint(20, (11,), generator=g)
    grads = []
    for with_entropy in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = chunked_logprobs(hh, ww, None, targets, 0.9, 4, with_entropy=with_entropy)
        assert (ent is None) == (not with_entropy)
        logp.sum().backward()
        grads.append((logp.detach(), hh.grad, ww.grad))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_no_tokens_gives_empty_logp_and_zero_weight_grad():
    h = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    logp, ent = chunked_logprobs(h, w, None, torch.zeros(0, dtype=torch.long), 1.0, None)
    assert logp.shape == (0,) and ent.shape == (0,)
    logp.sum().backward()
    assert torch.equal(w.grad, torch.zeros(6, 4))


def test_bfloat16_weights_are_computed_in_float32_and_grads_come_back_in_bfloat16():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(5, 8, generator=g).bfloat16().requires_grad_()
    w = torch.randn(12, 8, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(12, (5,), generator=g)
    logp, _ = chunked_logprobs(h, w, None, targets, 1.0, 2)
    ref_logp, _ = reference_logprobs(h.detach(), w.detach(), None, targets, 1.0)  # same bf16 values, float64
    assert logp.dtype == torch.float32 and torch.allclose(logp.double(), ref_logp, atol=1e-5)
    logp.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="weight"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 6), None, torch.zeros(3, dtype=torch.long), 1.0, 2)
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), None, torch.zeros(2, dtype=torch.long), 1.0, 2)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ragged_batch(vocab: int, seed: int = 0):
    """Left-padded prompts and right-padded responses of different lengths."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [5, 2, 4], [6, 1, 3]
    P, T = max(prompt_lens), max(response_lens)
    prompt_ids = torch.zeros(3, P, dtype=torch.long)
    prompt_mask = torch.zeros(3, P, dtype=torch.long)
    response_ids = torch.zeros(3, T, dtype=torch.long)
    response_mask = torch.zeros(3, T)
    for i, (p, t) in enumerate(zip(prompt_lens, response_lens)):
        prompt_ids[i, P - p:] = torch.randint(4, vocab, (p,), generator=g)
        prompt_mask[i, P - p:] = 1
        response_ids[i, :t] = torch.randint(4, vocab, (t,), generator=g)
        response_mask[i, :t] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


def naive_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature):
    """The whole [B, T, V] float32 log-softmax at once, straight from model(...).logits."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask.long()], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    P, T = prompt_ids.shape[1], response_ids.shape[1]
    logsm = torch.log_softmax(logits[:, P - 1 : P + T - 1].float() / temperature, dim=-1)  # [B, T, V]
    logp = logsm.gather(-1, response_ids[..., None]).squeeze(-1) * response_mask
    entropy = -(logsm.exp() * logsm).sum(-1) * response_mask
    return logp, entropy


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "llama"])
def test_response_logprobs_match_naive_values_and_grads(arch, tok):
    batch = ragged_batch(len(tok))
    coef = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (lambda m: response_logprobs(m, *batch, temperature=0.8, chunk_size=3),
               lambda m: naive_logprobs(m, *batch, temperature=0.8)):
        model = tiny_model(arch, "nano", tokenizer=tok, seed=2)
        logp, entropy = fn(model)
        (logp * coef).sum().backward()
        results.append((logp.detach(), entropy.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (lp, ent, grads), (lp_ref, ent_ref, grads_ref) = results
    assert torch.allclose(lp, lp_ref, atol=1e-5)
    assert torch.allclose(ent, ent_ref, atol=1e-5)
    assert (lp[batch[3] == 0] == 0).all() and (ent[batch[3] == 0] == 0).all()
    for name, grad in grads.items():
        assert torch.allclose(grad, grads_ref[name], atol=1e-5), name


def test_grad_mode_and_entropy_flag(tok):
    model = tiny_model("qwen3", "nano", tokenizer=tok)
    batch = ragged_batch(len(tok))
    logp, entropy = response_logprobs(model, *batch)
    assert logp.requires_grad and logp.dtype == torch.float32 and not entropy.requires_grad
    with torch.no_grad():
        logp2, none = response_logprobs(model, *batch, with_entropy=False)
    assert not logp2.requires_grad and none is None
    assert torch.equal(logp.detach(), logp2)


def test_bad_inputs_are_named(tok):
    model = tiny_model("qwen3", "nano", tokenizer=tok)
    p_ids, p_mask, r_ids, r_mask = ragged_batch(len(tok))
    with pytest.raises(ValueError, match="response_mask"):
        response_logprobs(model, p_ids, p_mask, r_ids, r_mask[:, :2])
    with pytest.raises(ValueError, match="left-padded"):
        response_logprobs(model, p_ids, p_mask.flip(1), r_ids, r_mask)
    with pytest.raises(ValueError, match="temperature"):
        response_logprobs(model, p_ids, p_mask, r_ids, r_mask, temperature=0.0)
