"""Router replay R2 and R3 on the tiny MoE with a bfloat16 rollout engine (docs/router_replay.md).

R2: the learner's recompute of μ records its expert choices and every training forward replays
them. R3: the engine records its choices at every position and both the recompute and every
training forward replay them. Batches come from the real HF engine; the learner is driven
through its public API (prepare, update, behavior_pass), as the training loop drives it.
"""

import copy
from dataclasses import replace

import pytest
import torch

from vespo.config import load_config
from vespo.metrics import read_jsonl
from vespo.models import build_char_tokenizer, record_routing, response_hidden_states, response_logprobs, tiny_model
from vespo.models.moe import stack_routing
from vespo.rollout import HFEngine, SamplingParams
from vespo.trainer.learner import Learner
from vespo.trainer.protocols import TrainItem
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
                      versions=zeros, versions_max=zeros,
                      token_versions=torch.zeros_like(rollout.response_ids), truncated=rollout.truncated,
                      routed_experts=rollout.routed_experts)


def learner_for(model, replay="none", lr=1e-4, micro_batch_size=8, share=False):
    """A learner with μ recomputed; ``share=False`` gives every item a behaviour pass of its own (eval mode, no
    grad) instead of the lag-0 update's forward, so that μ and the training forward are two passes
    (``share=None`` leaves the learner's own choice)."""
    cfg = load_config(None, ["model.device=cpu", "loss.name=grpo", f"optim.lr={lr}",
                             f"optim.micro_batch_size={micro_batch_size}", "run.steps=10", "staleness.n=1",
                             f"rollout.router_replay={replay}"])
    learner = Learner(copy.deepcopy(model), cfg)
    if share is not None:
        learner.can_share = share
    return learner


def item(batch, index=0) -> TrainItem:
    return TrainItem(index, batch, sampled_version=0)


def trainer_logp(model, batch, replay):
    """The trainer's behaviour-pass log-probs [B, T] of the batch under a replay mode."""
    learner = learner_for(model, replay)
    logp, _, _ = learner.behavior_pass(learner.routing_copy(batch))
    return logp


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
    learner = learner_for(moe, "none")
    learner.prepare([item(batch)])
    staged = learner.staged[0]
    learner.staged[0] = replace(staged, batch=replace(staged.batch, routed_experts=batch.routed_experts))
    lo, hi = log_w_range(learner.update(item(batch)))
    assert lo < 0.0 or hi > 0.0  # some sequence has log W != 0 before any update


def test_r3_log_w_is_exactly_zero_for_every_sequence_at_lag_0(tok, moe):
    """μ recomputed in its own pass (eval mode, no grad) and the training forward both replay the engine's
    routing, which differs from the trainer's own (previous test): W == 1 exactly for every sequence.
    (R2 at lag 0 replays what the trainer would choose anyway; its test is at lag >= 1, below.)"""
    batch = batch_of(sample(moe, tok))
    learner = learner_for(moe, "r3")
    learner.prepare([item(batch)])
    assert learner.staged[0].batch.routed_experts is batch.routed_experts
    assert batch.routed_experts.shape == (32, batch.prompt_ids.shape[1] + batch.response_ids.shape[1], 2, 2)
    lo, hi = log_w_range(learner.update(item(batch)))
    assert lo == 0.0 and hi == 0.0


# ---------------------------------------------------------------- R3


def test_r3_recompute_and_training_forward_route_with_the_engines_choices(tok, moe):
    batch = batch_of(sample(moe, tok))
    recorded = batch.routed_experts.clone()
    learner = learner_for(moe, "r3", micro_batch_size=0)  # one micro-batch: one forward per pass
    probe = RoutingProbe(learner.model)
    try:
        learner.prepare([item(batch)])
        logp = learner.staged[0].batch.old_logp
        recompute_used = probe.used[:]
        probe.live.clear(), probe.used.clear()
        learner.update(item(batch))
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
    logp32 = trainer_logp(moe, fp32, "r3")
    valid32 = fp32.response_mask > 0
    assert (logp32 - fp32.rollout_logp)[valid32].abs().max() < 1e-5
    # bfloat16 engine: routing is identical (previous test), so the token log-ratio is the
    # float32-vs-bfloat16 difference of one forward at the engine's routing, up to the bf16 engine's
    # own cached-vs-full-sequence rounding
    bf16 = batch_of(sample(moe, tok))
    valid = bf16.response_mask > 0
    logp = trainer_logp(moe, bf16, "r3")  # = every training forward at lag 0
    log_ratio = (logp - bf16.rollout_logp)[valid]  # token log W with μ = engine log-probs
    with torch.no_grad():
        logp_bf16, _ = response_logprobs(copy.deepcopy(moe).to(torch.bfloat16), bf16.prompt_ids, bf16.prompt_mask,
                                         bf16.response_ids, bf16.response_mask, routed_experts=bf16.routed_experts)
    precision = (logp - logp_bf16)[valid]
    assert log_ratio.abs().max() > 1e-4  # bf16 rounding shows
    assert (log_ratio - precision).abs().max() < 1e-2
    assert log_ratio.abs().max() < 2e-2
    # without replay, routing flips come on top of the rounding
    free = trainer_logp(moe, bf16, "none")
    assert (free - bf16.rollout_logp)[valid].abs().max() > log_ratio.abs().max()


def test_r3_needs_the_engines_routing(tok, moe):
    batch = replace(batch_of(sample(moe, tok, prompts=PROMPTS[:4], max_new_tokens=4)), routed_experts=None)
    for share in (False, True):  # a separate μ pass, or the update's own forward: checked before either
        with pytest.raises(ValueError, match="record_routing=True"):
            learner_for(moe, "r3", share=share).prepare([item(batch)])
    with pytest.raises(ValueError, match=r"rollout.router_replay must be one of \['none', 'r2', 'r3'\]"):
        learner_for(moe, "R2")


# ---------------------------------------------------------------- R2


def test_r2_training_forward_keeps_the_recompute_routing_after_updates(tok, moe):
    batch = batch_of(sample(moe, tok))
    mb0, mb1 = item(batch.select(torch.arange(0, 16)), 0), item(batch.select(torch.arange(16, 32)), 1)
    learner = learner_for(moe, "r2", lr=1e-3, micro_batch_size=0, share=None)
    assert not learner.can_share  # R2 records in a behaviour pass of its own, even at lag 0
    learner.prepare([mb0, mb1])  # μ of both at version 0, as the trainer does before the first update
    recorded = learner.staged[1].batch.routed_experts
    assert torch.equal(recorded, own_routing(moe, mb1.batch))  # the version-0 trainer's own choices
    learner.update(mb0)
    probe = RoutingProbe(learner.model)
    try:
        learner.update(mb1)  # lag 1
    finally:
        probe.remove()
    real = real_positions(mb1.batch).reshape(-1)  # [N]
    n_flipped = 0
    for layer, rec in enumerate(as_rows(recorded)):
        assert torch.equal(probe.used[layer], rec)  # every position replays the recompute's choice
        n_flipped += int(((probe.live[layer] != rec).any(-1) & real).sum())
    assert n_flipped > 0  # where the updated router would now choose other experts


def test_replay_is_a_no_op_on_a_dense_model(tok):
    dense = tiny_model("qwen3", "xs", tokenizer=tok, seed=0)
    batch = batch_of(sample(dense, tok, prompts=PROMPTS[:8], max_new_tokens=8))
    assert batch.routed_experts is None
    results = {}
    for replay in ("none", "r2", "r3"):
        learner = learner_for(dense, replay)
        learner.prepare([item(batch)])
        assert learner.staged[0].batch.routed_experts is None
        results[replay] = learner.staged[0].batch.old_logp
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


def test_sync_runs_replay_the_engines_routing_only_with_r3(make_cfg):
    """Two real runs (N = 2, bfloat16 engine) that sample the same responses: with r3 the trainer's behaviour
    passes replay the engine's routing, so its log-probs of those responses differ from the free-routing run's
    (a silent no-op of r3 would log bit-identical trainer numbers)."""
    from vespo.trainer import train

    rows = {}
    for replay in ("none", "r3"):
        cfg = make_cfg("model.arch=qwen3_moe", "rollout.engine_dtype=bfloat16", f"rollout.router_replay={replay}",
                       "staleness.n=2", "run.steps=1", "optim.micro_batch_size=8", out=replay)
        train(cfg)
        [rows[replay]] = [r for r in read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl") if "mismatch/k1" in r]
    assert rows["r3"]["mismatch/log_ppl_rollout"] == rows["none"]["mismatch/log_ppl_rollout"]  # the same samples
    assert rows["r3"]["mismatch/log_ppl_train"] != rows["none"]["mismatch/log_ppl_train"]  # replay changed the pass
    assert rows["r3"]["mismatch/abs_diff_max"] > 0.0
    assert rows["r3"]["router/replayed_frac"] == 1.0 and "router/replayed_frac" not in rows["none"]


FAMILIES = ["qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "olmoe", "flex_olmo", "mixtral", "gpt_oss",
            "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_logs_a_replayed_fraction_of_one(tok, arch):
    """router/replayed_frac in the update's metrics: 1.0 with r2 and r3 on every supported MoE family (every
    routed position of the training forwards was forced), absent without replay; a silent no-op would read 0."""
    model = tiny_model(arch, "nano", tokenizer=tok, seed=1)
    batch = batch_of(sample(model, tok, prompts=PROMPTS[:4], max_new_tokens=4))
    for replay in ("r2", "r3", "none"):
        learner = learner_for(model, replay, micro_batch_size=2, share=None)
        learner.prepare([item(batch)])
        metrics = learner.update(item(batch)).metrics
        if replay == "none":
            assert "router/replayed_frac" not in metrics
        else:
            assert metrics["router/replayed_frac"] == 1.0, (arch, replay)


def test_a_dense_model_logs_no_replayed_fraction(tok):
    dense = tiny_model("qwen3", "nano", tokenizer=tok, seed=0)
    batch = batch_of(sample(dense, tok, prompts=PROMPTS[:4], max_new_tokens=4))
    learner = learner_for(dense, "r3")
    learner.prepare([item(batch)])
    assert "router/replayed_frac" not in learner.update(item(batch)).metrics


def test_config_names_the_replay_choices():
    from vespo.config import ConfigError, load_config

    assert load_config(None, ["rollout.router_replay=r3"]).rollout.router_replay == "r3"
    assert load_config(None, []).rollout.router_replay == "none"
    with pytest.raises(ConfigError, match=r"rollout.router_replay must be one of \['none', 'r2', 'r3'\]"):
        load_config(None, ["rollout.router_replay=r1"])
