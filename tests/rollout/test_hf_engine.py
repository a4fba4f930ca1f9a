"""The Hugging Face rollout engine: on-policy log-probs, masks, seeding, partial rollouts, routing."""

import pytest
import torch

from vespo.models import (
    build_char_tokenizer,
    positions_from_mask,
    record_routing,
    response_hidden_states,
    response_logprobs,
    tiny_model,
)
from vespo.models.moe import stack_routing
from vespo.rollout import HFEngine, RolloutEngine, SamplingParams, sampling_logprobs

PROMPTS = ["12+3=", "7*8=", "(1+2)*3=", "9="]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(p) for p in PROMPTS]


def recompute(model, rollout, temperature=1.0):
    with torch.no_grad():
        logp, _ = response_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                    rollout.response_mask, temperature=temperature)
    return logp


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp32_engine_logprobs_equal_trainer_recompute(arch, tok, prompts):
    model = tiny_model(arch, "xs", tokenizer=tok, seed=0)
    engine = HFEngine(model, tok)
    assert isinstance(engine, RolloutEngine)
    rollout = engine.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=16), seed=0)
    assert rollout.response_mask.sum() > 0
    assert torch.allclose(rollout.logprobs, recompute(model, rollout, 0.9), atol=1e-5)


def test_bf16_engine_differs_measurably(tok, prompts):
    model = tiny_model("qwen3", "xs", tokenizer=tok, seed=0)
    rollout = HFEngine(model, tok, dtype="bfloat16").generate(prompts, SamplingParams(max_new_tokens=16), seed=0)
    diff = (rollout.logprobs - recompute(model, rollout)).abs()[rollout.response_mask > 0]
    assert diff.max() > 1e-3  # bf16 rounding shows
    assert diff.mean() < 0.1  # but it is the same policy


def test_top_p_logprobs_are_the_renormalised_distribution(tok, prompts):
    model = tiny_model("llama", "xs", tokenizer=tok, seed=1)
    params = SamplingParams(temperature=0.7, top_p=0.3, top_k=20, max_new_tokens=8)
    rollout = HFEngine(model, tok).generate(prompts, params, seed=3)
    # rebuild the processed distribution from the trainer's full logits of the same sequences
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.response_mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    P, T = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    processed = sampling_logprobs(logits[:, P - 1 : P + T - 1].reshape(-1, logits.shape[-1]).double(), params)
    expected = processed.gather(1, rollout.response_ids.reshape(-1, 1)).reshape(rollout.response_ids.shape)
    on = rollout.response_mask > 0
    assert torch.isfinite(expected[on]).all()  # every sampled token lies inside the nucleus
    assert torch.allclose(rollout.logprobs[on].double(), expected[on], atol=1e-5)
    assert (rollout.logprobs[on] > recompute(model, rollout, 0.7)[on] - 1e-6).all()  # renormalised: larger


def test_seeded_sampling_is_reproducible(tok, prompts):
    engine = HFEngine(tiny_model("qwen3", "nano", tokenizer=tok), tok)
    params = SamplingParams(max_new_tokens=12)
    a, b = engine.generate(prompts, params, seed=7), engine.generate(prompts, params, seed=7)
    c = engine.generate(prompts, params, seed=8)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_eos_and_padding_masks_with_ragged_lengths(tok):
    # a random tiny model is near uniform over 57 tokens, so EOS comes with p ~ 1/57 per step:
    # within 48 steps about half the rows end, the rest are truncated
    engine = HFEngine(tiny_model("qwen3", "nano", tokenizer=tok, seed=0), tok)
    rollout = engine.generate([tok.encode("1+1=")] * 16, SamplingParams(max_new_tokens=48), seed=0)
    ended = (rollout.response_ids == tok.eos_token_id).any(1)
    assert ended.any() and (~ended).any()
    assert torch.equal(rollout.truncated, ~ended)
    for row in range(16):
        ids, mask = rollout.response_ids[row], rollout.response_mask[row]
        n = int(mask.sum())
        assert (mask[:n] == 1).all() and (mask[n:] == 0).all()
        if ended[row]:
            assert ids[n - 1] == tok.eos_token_id and (ids[: n - 1] != tok.eos_token_id).all()
        else:
            assert n == 48
        assert (ids[n:] == tok.pad_token_id).all()
        assert (rollout.logprobs[row, n:] == 0).all() and (rollout.logprobs[row, :n] < 0).all()
        assert (rollout.token_versions[row, n:] == 0).all()


def test_weight_reload_mid_generation(tok, prompts):
    old = tiny_model("qwen3", "xs", tokenizer=tok, seed=0)
    new = tiny_model("qwen3", "xs", tokenizer=tok, seed=1)
    engine = HFEngine(old, tok)
    state = engine.start(prompts, SamplingParams(max_new_tokens=10), seed=0)
    assert engine.advance(state, 4) is False
    engine.load_weights(new.state_dict(), version=1)
    while not engine.advance(state, 3):
        pass
    rollout = engine.finish(state)
    assert rollout.version == 1 and engine.version == 1
    on = rollout.response_mask > 0
    assert torch.equal(rollout.token_versions[:, :4], on[:, :4].long() * 0)
    assert torch.equal(rollout.token_versions[:, 4:], on[:, 4:].long())
    # tokens 0..3 were sampled by the old weights, the rest by the new ones (re-prefilled cache)
    assert torch.allclose(rollout.logprobs[:, :4], recompute(old, rollout)[:, :4], atol=1e-5)
    assert torch.allclose(rollout.logprobs[:, 4:], recompute(new, rollout)[:, 4:], atol=1e-5)
    assert not torch.allclose(rollout.logprobs[:, 4:], recompute(old, rollout)[:, 4:], atol=1e-3)


def test_engine_holds_its_own_weights(tok, prompts):
    model = tiny_model("qwen3", "nano", tokenizer=tok)
    engine = HFEngine(model, tok)
    before = engine.generate(prompts, SamplingParams(max_new_tokens=6), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    after = engine.generate(prompts, SamplingParams(max_new_tokens=6), seed=0)
    assert torch.equal(before.logprobs, after.logprobs)
    with pytest.raises(ValueError, match="older"):
        engine.load_weights(model.state_dict(), version=-1)
    with pytest.raises(KeyError, match="unexpected"):
        engine.load_weights({**model.state_dict(), "extra.weight": torch.zeros(1)}, version=1)


def test_an_engine_sharing_the_trainers_module_samples_what_a_copy_samples(tok, prompts):
    model = tiny_model("qwen3", "nano", tokenizer=tok, attention_dropout=0.5).train()  # dropout: eval matters
    copied, shared = HFEngine(model, tok), HFEngine(model, tok, share_weights=True)
    a = copied.generate(prompts, SamplingParams(max_new_tokens=6), seed=0)
    b = shared.generate(prompts, SamplingParams(max_new_tokens=6), seed=0)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert model.training and shared.model is model  # sampled in eval mode, handed back in training mode
    own = {k: v.detach() for k, v in model.state_dict().items()}
    data = [p.data_ptr() for p in model.parameters()]
    shared.load_weights(own, version=1)  # its own tensors: nothing to copy
    assert shared.version == 1 and [p.data_ptr() for p in model.parameters()] == data
    other = {k: v + 1.0 for k, v in own.items()}
    shared.load_weights(other, version=2)  # anything else is copied into the module, in place
    assert torch.equal(model.lm_head.weight, other["lm_head.weight"]) and [p.data_ptr() for p in model.parameters()] == data
    with pytest.raises(ValueError, match="cannot change its dtype"):
        HFEngine(model, tok, dtype="bfloat16", share_weights=True)


def own_routing(model, rollout):
    """The experts the model itself routes at every position of cat(prompt, response): [B, P+T, L, K]."""
    B, S = rollout.prompt_ids.shape[0], rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
    with torch.no_grad(), record_routing(model) as records:
        response_hidden_states(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                               rollout.response_mask)
    return stack_routing(records, B, S)


def test_moe_routing_is_recorded_at_every_position(tok, prompts):
    model = tiny_model("qwen3_moe", "xs", tokenizer=tok, seed=0)
    engine = HFEngine(model, tok, record_routing=True)
    for seed in range(50):  # the first seed whose sample ends a row early, so padding is checked too
        rollout = engine.generate(prompts, SamplingParams(max_new_tokens=8), seed=seed)
        if (rollout.response_mask[:, :-1] == 0).any():
            break
    (B, P), T = rollout.prompt_ids.shape, rollout.response_ids.shape[1]
    routed = rollout.routed_experts
    assert routed.shape == (B, P + T, 2, 2) and routed.dtype == torch.int64
    # recorded: every real token but the last column's (the last sampled token is never fed back)
    real = torch.cat([rollout.prompt_mask > 0, rollout.response_mask > 0], dim=1)  # [B, P+T]
    real[:, -1] = False
    has = routed[..., 0, 0] >= 0  # [B, P+T]
    assert torch.equal(has, real) and torch.equal((routed >= 0).all(-1).all(-1), has) and routed.max() < 8
    assert (rollout.response_mask[:, :-1] == 0).any()  # some row ended early: padding is unrecorded
    # a float32 engine routes as the trainer's own full forward does, prompt positions included
    assert torch.equal(routed[has], own_routing(model, rollout)[has])
    # replaying the record reproduces the engine's log-probs
    with torch.no_grad():
        replayed, _ = response_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                        rollout.response_mask, routed_experts=routed)
    assert torch.allclose(replayed, rollout.logprobs, atol=1e-5)
    dense = HFEngine(tiny_model("qwen3", "nano", tokenizer=tok), tok, record_routing=True)
    assert dense.generate(prompts, SamplingParams(max_new_tokens=3), seed=0).routed_experts is None
    assert HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=3), seed=0).routed_experts is None


def test_reprefill_after_a_weight_update_rerecords_every_position(tok, prompts):
    old = tiny_model("qwen3_moe", "xs", tokenizer=tok, seed=0)
    new = tiny_model("qwen3_moe", "xs", tokenizer=tok, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # new router weights: many positions now route elsewhere
        for layer in new.model.layers:
            layer.mlp.gate.weight.add_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
    engine = HFEngine(old, tok, record_routing=True)
    state = engine.start(prompts, SamplingParams(max_new_tokens=10), seed=0)
    engine.advance(state, 4)
    engine.load_weights(new.state_dict(), version=1)
    while not engine.advance(state, 3):
        pass
    rollout = engine.finish(state)
    # every position run, old-weight ones included, carries the new weights' routing (the cache's)
    has = rollout.routed_experts[..., 0, 0] >= 0  # [B, P+T]
    kept = rollout.routed_experts[has]
    assert torch.equal(kept, own_routing(new, rollout)[has])
    assert not torch.equal(kept, own_routing(old, rollout)[has])


def test_bad_prompts_are_named(tok):
    engine = HFEngine(tiny_model("qwen3", "nano", tokenizer=tok), tok)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] has a token id outside"):
        engine.generate([[999]], SamplingParams())
