"""Router replay R2 and R3 on the tiny MoE with a bfloat16 rollout engine (docs/router_replay.md).

R2: the learner's recompute of μ records its expert choices and every training forward replays
them. R3: the engine records its choices at every position and both the recompute and every
training forward replay them. Batches come from the real HF engine; the learner is driven
through its public API (behavior_logp, update), as the training loop drives it.
"""

import copy

import pytest
import torch

from vespo.config import OptimConfig
from vespo.metrics import read_jsonl
from vespo.models import build_char_tokenizer, record_routing, response_hidden_states, response_logprobs, tiny_model
from vespo.models.moe import stack_routing
from vespo.rollout import HFEngine, SamplingParams
from vespo.trainer.learner import Learner
from vespo.types import TrainBatch

PROMPTS = [f"{a}+{b}=" for a in range(8) for b in range(4)]  # 32 rows


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def moe(tok):
    return tiny_model("qwen3_moe", "xs", tokenizer=tok, seed=0)


def sample(model, tok, dtype="bfloat16", prompts=PROMPTS, max_new_tokens=16):
    engine = HFEngine(model, tok, dtype=dtype, record_routing=True)
    return engine.generate([tok.encode(p) for p in prompts], SamplingParams(max_new_tokens=max_new_tokens), seed=0)


def batch_of(rollout, seed=0) -> TrainBatch:
    """A TrainBatch of the rollout with random advantages (groups of 4), routing as the engine recorded it."""
    B = rollout.batch_size
    adv = torch.randn(B, generator=torch.Generator().manual_seed(seed))  # [B]
    zeros = torch.zeros(B, dtype=torch.long)
    return TrainBatch(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask,
                      response_ids=rollout.response_ids, response_mask=rollout.response_mask,
                      rollout_logp=rollout.logprobs, rewards=adv, advantages=adv, group_ids=torch.arange(B) // 4,
                      versions=zeros, versions_max=zeros, truncated=rollout.truncated,
                      routed_experts=rollout.routed_experts)


def learner_for(model, lr=1e-4, micro_batch_size=8):
    return Learner(copy.deepcopy(model), "grpo", {}, OptimConfig(lr=lr, micro_batch_size=micro_batch_size),
                   total_updates=10)


def own_routing(model, batch):
    """The experts the model itself routes at every position: [B, P+T, L, K]."""
    B, S = batch.prompt_ids.shape[0], batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    with torch.no_grad(), record_routing(model) as records:
        response_hidden_states(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    return stack_routing(records, B, S)


def real_positions(batch):
    """[B, P+T] bool: the positions holding a real token (what any log-prob depends on)."""
    return torch.cat([batch.prompt_mask.bool(), batch.response_mask > 0], dim=1)


class RoutingProbe:
    """Per forward pass, per MoE layer: the router's live top-k and the experts the MoE block ran with."""

    def __init__(self, model):
        self.live, self.used = [], []
        self.handles = []
        for decoder in model.model.layers:  # registered before any replay hook: sees the router's own choice
            self.handles.append(decoder.mlp.gate.register_forward_hook(
                lambda m, args, out: self.live.append(out[2].clone())))
            self.handles.append(decoder.mlp.experts.register_forward_pre_hook(
                lambda m, args: self.used.append(args[1].clone())))

    def remove(self):
        for h in self.handles:
            h.remove()


def as_rows(routing):
    """[b, S, L, K] -> per layer [b*S, K], the layout the routers see."""
    b, S, L, K = routing.shape
    return [routing[:, :, layer].reshape(b * S, K) for layer in range(L)]


def log_w_range(result):
    return float(result.metrics["is/log_w_min"]), float(result.metrics["is/log_w_max"])


# ---------------------------------------------------------------- N = 1, μ recomputed: W == 1 exactly


def test_bf16_engine_routes_differently_and_the_old_option_breaks_w_equals_one(tok, moe):
    batch = batch_of(sample(moe, tok))
    engine, trainer = batch.routed_experts[:, :-1], own_routing(moe, batch)[:, :-1]
    flipped = (engine != trainer).any(-1).any(-1) & real_positions(batch)[:, :-1]  # [B, P+T-1]
    assert flipped.sum() > 0  # bf16 vs fp32 flips some routing choices
    # the previous rollout.router_replay=true: μ recomputed without replay, training replays the engine
    engine_routing, learner = batch.routed_experts, learner_for(moe)
    batch.old_logp, _ = learner.behavior_logp(batch, "none")  # clears batch.routed_experts
    batch.routed_experts = engine_routing
    lo, hi = log_w_range(learner.update(batch))
    assert lo < 0.0 or hi > 0.0  # some sequence has log W != 0 before any update


@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_log_w_is_exactly_zero_for_every_sequence_at_n_equals_1(tok, moe, replay):
    batch = batch_of(sample(moe, tok))
    learner = learner_for(moe)
    batch.old_logp, _ = learner.behavior_logp(batch, replay)  # μ recomputed
    assert batch.routed_experts.shape == (32, batch.prompt_ids.shape[1] + batch.response_ids.shape[1], 2, 2)
    lo, hi = log_w_range(learner.update(batch))
    # min and max of the per-sequence log W (mean-reduced over micro-batches: each min <= 0 <= max)
    assert lo == 0.0 and hi == 0.0


# ---------------------------------------------------------------- R3


def test_r3_recompute_and_training_forward_route_with_the_engines_choices(tok, moe):
    batch = batch_of(sample(moe, tok))
    recorded = batch.routed_experts.clone()
    learner = learner_for(moe, micro_batch_size=0)  # one micro-batch: one forward per pass
    probe = RoutingProbe(learner.model)
    try:
        logp, _ = learner.behavior_logp(batch, "r3")
        recompute_used = probe.used[:]
        batch.old_logp = logp
        probe.live.clear(), probe.used.clear()
        learner.update(batch)
        train_live, train_used = probe.live[:], probe.used[:]
    finally:
        probe.remove()
    assert torch.equal(batch.routed_experts, recorded)
    has = as_rows(recorded >= 0)
    for layer, rec in enumerate(as_rows(recorded)):
        on = has[layer][:, 0]  # [N] positions the engine ran
        assert torch.equal(recompute_used[layer][on], rec[on])
        assert torch.equal(train_used[layer][on], rec[on])
        assert torch.equal(train_used[layer][~on], train_live[layer][~on])  # unrecorded: the live router
    # the recompute's log-probs are those of a forward forced to the engine's choices
    with torch.no_grad():
        forced, _ = response_logprobs(moe, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                      batch.response_mask, routed_experts=recorded)
        free, _ = response_logprobs(moe, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                    batch.response_mask)
    assert torch.equal(logp, forced)
    assert not torch.equal(logp, free)  # and the engine's choices did change something


def test_r3_with_engine_mu_leaves_only_the_precision_difference(tok, moe):
    # float32 engine: same precision, replayed routing -> log W is 0 to float tolerance
    fp32 = batch_of(sample(moe, tok, dtype="float32"))
    logp32, _ = learner_for(moe).behavior_logp(fp32, "r3")
    valid32 = fp32.response_mask > 0
    assert (logp32 - fp32.rollout_logp)[valid32].abs().max() < 1e-5
    # bfloat16 engine: routing is identical (previous test), so the token log-ratio is the
    # float32-vs-bfloat16 difference of one forward at the engine's routing, up to the bf16 engine's
    # own cached-vs-full-sequence rounding
    bf16 = batch_of(sample(moe, tok))
    valid = bf16.response_mask > 0
    logp, _ = learner_for(moe).behavior_logp(bf16, "r3")  # = every training forward at lag 0
    log_ratio = (logp - bf16.rollout_logp)[valid]  # token log W with μ = engine log-probs
    with torch.no_grad():
        logp_bf16, _ = response_logprobs(copy.deepcopy(moe).to(torch.bfloat16), bf16.prompt_ids, bf16.prompt_mask,
                                         bf16.response_ids, bf16.response_mask, routed_experts=bf16.routed_experts)
    precision = (logp - logp_bf16)[valid]
    assert log_ratio.abs().max() > 1e-4  # bf16 rounding shows
    assert (log_ratio - precision).abs().max() < 1e-2
    assert log_ratio.abs().max() < 2e-2
    # without replay, routing flips come on top of the rounding
    free, _ = learner_for(moe).behavior_logp(bf16, "none")
    assert (free - bf16.rollout_logp)[valid].abs().max() > log_ratio.abs().max()


def test_r3_needs_the_engines_routing(tok, moe):
    batch = batch_of(sample(moe, tok, prompts=PROMPTS[:4], max_new_tokens=4))
    batch.routed_experts = None
    with pytest.raises(ValueError, match="record_routing=True"):
        learner_for(moe).behavior_logp(batch, "r3")
    with pytest.raises(ValueError, match="none, r2, r3"):
        learner_for(moe).behavior_logp(batch, "R2")


# ---------------------------------------------------------------- R2


def test_r2_training_forward_keeps_the_recompute_routing_after_updates(tok, moe):
    batch = batch_of(sample(moe, tok))
    mb0, mb1 = batch.select(torch.arange(0, 16)), batch.select(torch.arange(16, 32))
    learner = learner_for(moe, lr=1e-3, micro_batch_size=0)
    for mb in (mb0, mb1):  # μ of both at version 0, as the trainer does before the first update
        mb.old_logp, _ = learner.behavior_logp(mb, "r2")
    assert torch.equal(mb1.routed_experts, own_routing(moe, mb1))  # the version-0 trainer's own choices
    learner.update(mb0)
    probe = RoutingProbe(learner.model)
    try:
        learner.update(mb1)  # lag 1
    finally:
        probe.remove()
    real = real_positions(mb1).reshape(-1)  # [N]
    n_flipped = 0
    for layer, rec in enumerate(as_rows(mb1.routed_experts)):
        assert torch.equal(probe.used[layer], rec)  # every position replays the recompute's choice
        n_flipped += int(((probe.live[layer] != rec).any(-1) & real).sum())
    assert n_flipped > 0  # where the updated router would now choose other experts


def test_replay_is_a_no_op_on_a_dense_model(tok):
    dense = tiny_model("qwen3", "xs", tokenizer=tok, seed=0)
    batch = batch_of(sample(dense, tok, prompts=PROMPTS[:8], max_new_tokens=8))
    assert batch.routed_experts is None
    results = {}
    for replay in ("none", "r2", "r3"):
        results[replay], _ = learner_for(dense).behavior_logp(batch, replay)
        assert batch.routed_experts is None
    assert torch.equal(results["none"], results["r2"]) and torch.equal(results["none"], results["r3"])


# ---------------------------------------------------------------- batches


def test_select_and_concat_keep_each_tokens_routing(tok, moe):
    short = batch_of(sample(moe, tok, prompts=["1=", "2=", "3=", "4="], max_new_tokens=4))
    long = batch_of(sample(moe, tok, prompts=["12+34=", "5*6=", "(7)=", "8-9="], max_new_tokens=9))
    both = TrainBatch.concat([short.select(torch.tensor([2, 0])), long], pad_id=tok.pad_token_id)
    P, T = both.prompt_ids.shape[1], both.response_ids.shape[1]
    assert both.routed_experts.shape == (6, P + T, 2, 2)
    for row, (part, i) in enumerate([(short, 2), (short, 0)] + [(long, j) for j in range(4)]):
        p, t = part.prompt_ids.shape[1], part.response_ids.shape[1]
        assert torch.equal(both.routed_experts[row, P - p : P], part.routed_experts[i, :p])
        assert torch.equal(both.routed_experts[row, P : P + t], part.routed_experts[i, p:])
        assert (both.routed_experts[row, : P - p] == -1).all() and (both.routed_experts[row, P + t :] == -1).all()
    # replaying the concatenated routing gives each row the log-probs it had alone
    with torch.no_grad():
        joint, _ = response_logprobs(moe, both.prompt_ids, both.prompt_mask, both.response_ids, both.response_mask,
                                     routed_experts=both.routed_experts)
        alone, _ = response_logprobs(moe, long.prompt_ids, long.prompt_mask, long.response_ids, long.response_mask,
                                     routed_experts=long.routed_experts)
    assert torch.allclose(joint[2:, : alone.shape[1]], alone, atol=1e-5)


# ---------------------------------------------------------------- end to end


def test_sync_run_with_r3_keeps_w_exactly_one_at_n_equals_1(make_cfg):
    from vespo.trainer.sync import train

    cfg = make_cfg("model.arch=qwen3_moe", "rollout.engine_dtype=bfloat16", "rollout.router_replay=r3",
                   "staleness.n=1", "staleness.behavior=recompute", "run.steps=2", "optim.micro_batch_size=8")
    train(cfg)
    rows = [r for r in read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl") if "is/log_w_max" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["is/log_w_min"] == 0.0 and row["is/log_w_max"] == 0.0
        assert row["mismatch/max_abs_diff"] > 0.0  # the bf16 engine really differs


def test_config_names_the_replay_choices():
    from vespo.config import ConfigError, load_config

    assert load_config(None, ["rollout.router_replay=r3"]).rollout.router_replay == "r3"
    assert load_config(None, []).rollout.router_replay == "none"
    with pytest.raises(ConfigError, match=r"rollout.router_replay must be one of \['none', 'r2', 'r3'\]"):
        load_config(None, ["rollout.router_replay=r1"])
