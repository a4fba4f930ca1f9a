"""Router replay on every supported MoE family (vespo.models.moe_families).

Per family, on a tiny model built from its config: replaying the model's own routing gives its
free log-probs exactly; forced routing matches a float64 oracle written from the family's gate
rule, log-probs and router gradients; the HF engine records the routing a full forward takes.
A router or MoE block of an unknown class stops with one line naming it; the replay counter
gives forced / routed = 1 when every position that matters is replayed; replay refuses
torch.compile'd layers, and the config refuses run.compile with r2/r3.
"""

import copy

import pytest
import torch
from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

from vespo.config import ConfigError, load_config
from vespo.errors import ModelError
from vespo.models import (
    build_char_tokenizer,
    count_replay,
    is_moe,
    moe_routers,
    positions_from_mask,
    record_routing,
    replay_routing,
    response_hidden_states,
    response_logprobs,
    tiny_model,
)
from vespo.models.moe import NO_RECORD, stack_routing
from vespo.rollout import HFEngine, SamplingParams

FAMILIES = ["qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "olmoe", "flex_olmo", "mixtral", "gpt_oss",
            "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1"]
E, K = 8, 2  # experts, experts per token (every tiny MoE)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def family_model(arch: str, tok, seed: int = 5):
    """The tiny nano model of a family; DeepSeek-V3 / GLM4 selection biases set (to the size of the
    score differences), so they take part in the choice."""
    model = tiny_model(arch, "nano", tokenizer=tok, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for router in moe_routers(model):
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.01 * torch.randn(E, generator=g))
    return model


def ragged_batch(vocab: int, seed: int = 0):
    """Left-padded prompts (lengths 5, 2, 4) and right-padded responses (lengths 6, 1, 3): [3, 5], [3, 6]."""
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


# positions that count (a real token followed by a real token): rows of 11, 3 and 7 real tokens
# give 10 + 2 + 6 = 18 per MoE layer
COUNTED_PER_LAYER = 18


def own_routing(model, batch):
    """The experts the model routes at every position of cat(prompt, response): [B, P+T, L, K]."""
    B, S = batch[0].shape[0], batch[0].shape[1] + batch[2].shape[1]
    with torch.no_grad(), record_routing(model) as records:
        response_hidden_states(model, *batch)
    return stack_routing(records, B, S)


def random_experts(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """K distinct random experts per (row, position, layer): [B, S, L, K]."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(*shape[:-1], E, generator=g)
    return scores.topk(shape[-1], dim=-1).indices


# ------------------------------------------------------------------ self-replay and the counter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_replaying_own_routing_gives_the_free_logprobs_exactly(tok, arch, dtype):
    model = family_model(arch, tok).to(dtype)
    batch = ragged_batch(len(tok))
    own = own_routing(model, batch)  # [B, P+T, L, K]
    L = len(moe_routers(model))
    assert own.shape == (3, 11, L, K) and own.min() >= 0 and own.max() < E
    assert own.unique().numel() >= 6  # the routers spread tokens over the experts
    free, _ = response_logprobs(model, *batch)
    with count_replay(model) as count:
        replayed, _ = response_logprobs(model, *batch, routed_experts=own)
    assert torch.equal(replayed, free)
    assert int(count.forced) == int(count.routed) == L * COUNTED_PER_LAYER
    assert torch.equal(response_logprobs(model, *batch, routed_experts=torch.full_like(own, NO_RECORD))[0], free)


def test_the_counter_counts_the_positions_that_matter(tok):
    model = family_model("qwen3_moe", tok)
    batch = ragged_batch(len(tok))
    own = own_routing(model, batch)
    # as the engine records: padding and each row's last real token (never fed back) have no record
    real = torch.cat([batch[1] > 0, batch[3] > 0], dim=1)  # [B, P+T]
    last = torch.zeros_like(real)
    last[torch.arange(3), torch.tensor([10, 5, 7])] = True  # P=5 + response lengths 6, 1, 3, minus 1
    engine_like = own.masked_fill(~(real & ~last)[:, :, None, None], NO_RECORD)
    with count_replay(model) as count:
        response_logprobs(model, *batch, routed_experts=engine_like)
    assert int(count.forced) == int(count.routed) == 2 * COUNTED_PER_LAYER
    # a row without a record: its 6 positions x 2 layers are routed, not forced
    partial = engine_like.clone()
    partial[2] = NO_RECORD
    with replay_routing(model, partial) as count, torch.no_grad():
        response_hidden_states(model, *batch)
    assert (int(count.forced), int(count.routed)) == (2 * (COUNTED_PER_LAYER - 6), 2 * COUNTED_PER_LAYER)
    # forwards that replay nothing count as routed only; two forwards add up
    with count_replay(model) as count:
        response_logprobs(model, *batch)
        response_logprobs(model, *batch, routed_experts=own)
    assert (int(count.forced), int(count.routed)) == (2 * COUNTED_PER_LAYER, 4 * COUNTED_PER_LAYER)
    # activation checkpointing runs the layers again in the backward pass, replaying: they count once
    model.gradient_checkpointing_enable()
    model.train()
    with replay_routing(model, own) as count:
        response_hidden_states(model, *batch).sum().backward()
    assert int(count.forced) == int(count.routed) == 2 * COUNTED_PER_LAYER


def test_a_dense_model_has_nothing_to_replay_or_count(tok):
    model = tiny_model("qwen3", "nano", tokenizer=tok)
    batch = ragged_batch(len(tok))
    assert moe_routers(model) == [] and not is_moe(model)
    with count_replay(model) as count, record_routing(model) as records:
        response_logprobs(model, *batch)
    assert records == [] and int(count.routed) == 0 and int(count.forced) == 0


# ------------------------------------------------------------------ float64 oracle of each gate rule


def oracle_gate(arch: str, router, z: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The family's gate weights [N, K] of the given experts, from float64 router logits z [N, E].

    Written from each family's published gate (the transformers modeling code), with exp and
    sums spelled out: p = softmax over all E, s = logistic sigmoid.
    """
    def chosen(t: torch.Tensor) -> torch.Tensor:  # t [N, E] -> its entries at each token's experts [N, K]
        return torch.stack([t[n, experts[n]] for n in range(t.shape[0])])

    p = torch.exp(z - z.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)  # [N, E]
    if arch in ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "flex_olmo"):  # softmax, renormalised if norm_topk_prob
        w = chosen(p)
        return w / w.sum(-1, keepdim=True) if router.norm_topk_prob else w
    if arch in ("mixtral", "qwen3_5_moe"):  # softmax, always renormalised over the K
        w = chosen(p)
        return w / w.sum(-1, keepdim=True)
    if arch == "gpt_oss":  # softmax over the K chosen logits only
        c = torch.exp(chosen(z))
        return c / c.sum(-1, keepdim=True)
    if arch == "deepseek_v2":  # softmax x scaling, no renormalisation
        return chosen(p) * router.routed_scaling_factor
    if arch in ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1"):  # sigmoid, renormalised, x scaling
        s = chosen(1.0 / (1.0 + torch.exp(-z)))
        s = s / s.sum(-1, keepdim=True) if router.norm_topk_prob else s
        return s * router.routed_scaling_factor
    raise AssertionError(arch)


def oracle_model(model, arch: str, experts: torch.Tensor):
    """A float64 copy of the model whose routers are the oracle gate, forced to experts [B, S, L, K]."""
    model64 = copy.deepcopy(model).double()
    model64.set_experts_implementation("eager")  # the default grouped_mm kernel has no float64
    B, S = experts.shape[:2]
    for layer, router in enumerate(moe_routers(model64)):
        forced = experts[:, :, layer].reshape(B * S, -1)  # [N, K]

        def forward(h, router=router, forced=forced):
            h = h.reshape(-1, router.weight.shape[1])  # [N, H]
            z = h @ router.weight.T + (router.bias if getattr(router, "bias", None) is not None else 0)  # [N, E]
            return z, oracle_gate(arch, router, z, forced), forced

        router.forward = forward
    return model64


def plain_logprobs(model, batch) -> torch.Tensor:
    """Response log-probs [B, T] from the model's full logits (no chunking), 0 at padding."""
    prompt_ids, prompt_mask, response_ids, response_mask = batch
    P = prompt_ids.shape[1]
    mask = torch.cat([prompt_mask, response_mask.long()], dim=1)  # [B, P+T]
    logits = model(input_ids=torch.cat([prompt_ids, response_ids], dim=1), attention_mask=mask,
                   position_ids=positions_from_mask(mask), use_cache=False).logits  # [B, P+T, V]
    logp = logits[:, P - 1:-1].log_softmax(-1).gather(-1, response_ids[..., None]).squeeze(-1)  # [B, T]
    return logp * response_mask


def router_grads(model) -> list[torch.Tensor]:
    return [p.grad for r in moe_routers(model) for p in r.parameters()]


@pytest.mark.parametrize("arch", FAMILIES)
def test_forced_routing_matches_a_float64_oracle_with_the_router_gradient(tok, arch):
    model = family_model(arch, tok)
    batch = ragged_batch(len(tok))
    valid = batch[3] > 0
    other = random_experts(tuple(own_routing(model, batch).shape), seed=1)  # [B, P+T, L, K]
    free, _ = response_logprobs(model, *batch)
    forced, _ = response_logprobs(model, *batch, routed_experts=other)
    assert (forced - free).abs()[valid].max() > 1e-3  # the forced experts change the numbers
    model64 = oracle_model(model, arch, other)
    want = plain_logprobs(model64, batch)  # float64
    assert torch.allclose(forced.detach().double(), want, atol=1e-5)
    # the router's gradient flows under replay, and it is the oracle's
    (forced * valid).sum().backward()
    (want * valid).sum().backward()
    for got, ref in zip(router_grads(model), router_grads(model64), strict=True):
        assert ref.abs().max() > 0
        scale = ref.abs().max()
        assert torch.allclose(got.double() / scale, ref / scale, atol=1e-4)


# ------------------------------------------------------------------ the HF engine records each family


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_engine_records_the_routing_of_a_full_forward(tok, arch):
    model = family_model(arch, tok)
    prompts = [tok.encode(p) for p in ["1+2=", "34*5=", "7-6="]]
    rollout = HFEngine(model, tok, record_routing=True).generate(prompts, SamplingParams(max_new_tokens=6), seed=0)
    batch = (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
    (B, P), T = rollout.prompt_ids.shape, rollout.response_ids.shape[1]
    routed = rollout.routed_experts  # [B, P+T, L, K]
    assert routed.shape == (B, P + T, len(moe_routers(model)), K)
    real = torch.cat([rollout.prompt_mask > 0, rollout.response_mask > 0], dim=1)  # [B, P+T]
    real[:, -1] = False  # the last sampled token is never fed back
    has = routed[..., 0, 0] >= 0
    assert torch.equal(has, real)
    # the cached prefill and decode steps choose the experts of one full forward over the tokens
    assert torch.equal(routed[has].sort(-1).values, own_routing(model, batch)[has].sort(-1).values)
    with torch.no_grad(), count_replay(model) as count:
        replayed, _ = response_logprobs(model, *batch, routed_experts=routed)
        free, _ = response_logprobs(model, *batch)
    assert torch.equal(replayed, free)
    tokens = rollout.prompt_mask.sum(1) + rollout.response_mask.sum(1)  # [B] real tokens per row
    counted = int((tokens - 1).sum())  # per layer and forward: each row's real tokens but its last
    assert int(count.routed) == 2 * len(moe_routers(model)) * counted == 2 * int(count.forced)


# ------------------------------------------------------------------ what replay refuses


def granite_moe(tok):
    """A tiny model of an MoE family replay does not support (GraniteMoe, router GraniteMoeTopKRouter)."""
    config = GraniteMoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    return GraniteMoeForCausalLM(config).eval()


def assert_one_line_naming(error: pytest.ExceptionInfo, name: str) -> None:
    message = str(error.value)
    assert name in message and "\n" not in message, message


def test_an_unknown_moe_stops_with_one_line_naming_its_class(tok):
    model = granite_moe(tok)
    batch = ragged_batch(len(tok))
    assert is_moe(model)
    response_logprobs(model, *batch)  # no replay asked: it runs as any model
    for use in (lambda: record_routing(model).__enter__(), lambda: count_replay(model).__enter__(),
                lambda: response_logprobs(model, *batch, routed_experts=torch.zeros(3, 11, 2, 2, dtype=torch.long)),
                lambda: HFEngine(model, tok, record_routing=True)):
        with pytest.raises(ModelError) as error:
            use()
        assert_one_line_naming(error, "GraniteMoe")
    # a known family's router under another class name (a fork, a subclass) is unknown too
    fork = family_model("mixtral", tok)
    router = fork.model.layers[1].mlp.gate
    router.__class__ = type("ForkedTopKRouter", (type(router),), {})
    with pytest.raises(ModelError) as error:
        moe_routers(fork)
    assert_one_line_naming(error, "ForkedTopKRouter")


def test_an_moe_block_without_a_known_router_is_named(tok):
    model = family_model("olmoe", tok)
    block = model.model.layers[0].mlp
    block.gate = torch.nn.Linear(block.gate.hidden_dim, E, bias=False)  # a gate that is no router class
    block.__class__ = type("HomemadeSparseMoeBlock", (type(block),), {})
    assert is_moe(model)
    with pytest.raises(ModelError) as error:
        moe_routers(model)
    assert_one_line_naming(error, "HomemadeSparseMoeBlock")


def test_replay_refuses_compiled_layers(tok):
    model = family_model("qwen3_moe", tok)
    batch = ragged_batch(len(tok))
    own = own_routing(model, batch)
    model.model.layers[1].compile(dynamic=True)  # lazy: nothing is compiled before the first call
    with pytest.raises(ModelError) as error:
        response_logprobs(model, *batch, routed_experts=own)
    assert_one_line_naming(error, "run.compile=false")
    with pytest.raises(ModelError):
        record_routing(model).__enter__()


@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_the_config_refuses_compile_with_replay(replay):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[f"rollout.router_replay={replay}", "run.compile=true"])
    assert_one_line_naming(error, "run.compile")
    assert load_config(overrides=["rollout.router_replay=none", "run.compile=true"]).run.compile
