"""MoE router replay: replaying a forward's own routing is bit-exact, forced routing matches a float64
oracle of the MoE block, unrecorded positions route live, and the router keeps its gradient."""

import copy

import pytest
import torch
import torch.nn.functional as F

from vespo.models import build_char_tokenizer, record_routing, response_hidden_states, response_logprobs, tiny_model
from vespo.models.moe import NO_RECORD, stack_routing


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ragged_batch(vocab: int, seed: int = 0):
    """Left-padded prompts [3, 5] and right-padded responses [3, 6] of different lengths."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [5, 2, 4], [6, 1, 3]
    P, T = max(prompt_lens), max(response_lens)
    prompt_ids, prompt_mask = torch.zeros(3, P, dtype=torch.long), torch.zeros(3, P, dtype=torch.long)
    response_ids, response_mask = torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T)
    for i, (p, t) in enumerate(zip(prompt_lens, response_lens)):
        prompt_ids[i, P - p:] = torch.randint(4, vocab, (p,), generator=g)
        prompt_mask[i, P - p:] = 1
        response_ids[i, :t] = torch.randint(4, vocab, (t,), generator=g)
        response_mask[i, :t] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


def own_routing(model, batch):
    """The experts the model routes at every position of cat(prompt, response): [B, P+T, L, K]."""
    B, S = batch[0].shape[0], batch[0].shape[1] + batch[2].shape[1]
    with torch.no_grad(), record_routing(model) as records:
        response_hidden_states(model, *batch)
    return stack_routing(records, B, S)


def test_replaying_own_routing_is_bit_exact_and_no_record_routes_live(tok):
    model = tiny_model("qwen3_moe", "nano", tokenizer=tok, seed=5)
    batch = ragged_batch(len(tok))
    own = own_routing(model, batch)  # [B, P+T, L=2, K=2]
    assert own.shape == (3, 11, 2, 2) and own.min() >= 0 and own.max() < 8
    free, _ = response_logprobs(model, *batch)
    assert torch.equal(response_logprobs(model, *batch, routed_experts=own)[0], free)
    assert torch.equal(response_logprobs(model, *batch, routed_experts=torch.full_like(own, NO_RECORD))[0], free)


def moe_block_oracle(block, h, experts):
    """Float64 Qwen3-MoE block with the top-k forced to ``experts``: h [N, H], experts [N, K] -> [N, H].

    Gate weights are the router softmax at the forced experts, renormalised over them (norm_topk_prob).
    """
    probs = torch.softmax(h @ block.gate.weight.double().T, dim=-1)  # [N, E]
    weights = probs.gather(-1, experts)  # [N, K]
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for n in range(h.shape[0]):
        for k in range(experts.shape[1]):
            e = int(experts[n, k])
            gate, up = (block.experts.gate_up_proj[e].double() @ h[n]).chunk(2)
            out[n] += weights[n, k] * (block.experts.down_proj[e].double() @ (F.silu(gate) * up))
    return out


def oracle_logprobs(model, batch, experts):
    """Response log-probs [B, T] of a float64 copy of the model whose MoE blocks are the oracle."""
    model64 = copy.deepcopy(model).double()
    B, S = experts.shape[:2]
    for layer, decoder in enumerate(model64.model.layers):
        block = decoder.mlp
        forced = experts[:, :, layer].reshape(B * S, -1)  # [N, K]
        block.forward = lambda x, block=block, forced=forced: moe_block_oracle(
            block, x.reshape(-1, x.shape[-1]), forced).reshape(x.shape)
    with torch.no_grad():
        logp, _ = response_logprobs(model64, *batch, with_entropy=False)
    return logp


def test_forced_routing_matches_a_float64_oracle_and_the_router_still_learns(tok):
    model = tiny_model("qwen3_moe", "nano", tokenizer=tok, seed=5)
    batch = ragged_batch(len(tok))
    own = own_routing(model, batch)
    other = (own + 1) % 8  # every token sent to other experts (still two distinct ones)
    forced, _ = response_logprobs(model, *batch, routed_experts=other)
    free, _ = response_logprobs(model, *batch)
    valid = batch[3] > 0
    assert (forced - free).abs()[valid].max() > 1e-3
    assert torch.allclose(forced.detach().double(), oracle_logprobs(model, batch, other), atol=1e-5)
    assert torch.allclose(free.detach().double(), oracle_logprobs(model, batch, own), atol=1e-5)
    # the gate weights come from the live router: its gradient flows under replay
    forced.sum().backward()
    for decoder in model.model.layers:
        assert decoder.mlp.gate.weight.grad is not None and decoder.mlp.gate.weight.grad.abs().sum() > 0


def test_replay_reaches_the_experts(tok):
    model = tiny_model("qwen3_moe", "nano", tokenizer=tok, seed=5)
    batch = ragged_batch(len(tok))
    other = (own_routing(model, batch) + 3) % 8
    seen = []  # the indices each experts module is called with
    hooks = [d.mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
             for d in model.model.layers]
    try:
        with torch.no_grad():
            response_logprobs(model, *batch, routed_experts=other)
    finally:
        for h in hooks:
            h.remove()
    B, S = other.shape[:2]
    assert len(seen) == 2
    for layer, indices in enumerate(seen):
        assert torch.equal(indices, other[:, :, layer].reshape(B * S, -1))


def test_bad_routing_shapes_are_named(tok):
    model = tiny_model("qwen3_moe", "nano", tokenizer=tok)
    batch = ragged_batch(len(tok))
    with pytest.raises(ValueError, match=r"routed_experts must be \[B, P\+T, L, K\]"):
        response_logprobs(model, *batch, routed_experts=torch.zeros(3, 6, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="L=2"):
        response_logprobs(model, *batch, routed_experts=torch.zeros(3, 11, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="K=2"):
        response_logprobs(model, *batch, routed_experts=torch.zeros(3, 11, 2, 3, dtype=torch.long))
