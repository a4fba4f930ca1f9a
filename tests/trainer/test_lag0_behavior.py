"""A lag-0 mini-batch takes its behavior pass from its own update's forward: the same numbers as a
separate recompute, one pass fewer (the first mini-batch of a sync rollout step; every async one)."""

import torch
from stepping import rollout_step, sync_loop

from vespo.buffer import split_minibatches
from vespo.config import OptimConfig
from vespo.models import build_char_tokenizer, tiny_model
from vespo.trainer.learner import Learner


def first_minibatch(loop):
    batch, _ = loop.source.producer.produce(loop.cfg.rollout.prompts_per_step, seed=5, first_group_id=0)
    return split_minibatches(batch, loop.cfg.staleness.n, None)[0]


def test_lag0_update_forward_is_the_recompute(make_cfg):
    with sync_loop(make_cfg("staleness.n=2")) as ours, sync_loop(make_cfg("staleness.n=2", out="other")) as theirs:
        mb = first_minibatch(ours)
        twin = mb.select(torch.arange(len(mb)))  # the same rows, for the other learner
        [twin], behavior = theirs.learner.prepare([twin], "recompute")  # the separate recompute
        mb.old_logp = None
        result = ours.learner.update(mb, behavior_pass=True)
        theirs.learner.update(twin)
        assert torch.equal(mb.old_logp, twin.old_logp)  # bit for bit: the same weights, the same forward
        assert result.metrics["rollout/entropy"] == behavior["rollout/entropy"]
        assert result.metrics["mismatch/k3"] == behavior["mismatch/k3"]
        for a, b in zip(ours.learner.model.parameters(), theirs.learner.model.parameters()):
            assert torch.equal(a, b)  # and so the same optimizer step


def test_a_rollout_step_recomputes_mu_only_for_stale_minibatches(make_cfg):
    with sync_loop(make_cfg("staleness.n=4")) as loop:
        calls = []
        behavior_logp = loop.learner.behavior_logp
        loop.learner.behavior_logp = lambda mb, replay: calls.append(len(mb)) or behavior_logp(mb, replay)
        metrics = rollout_step(loop)
        assert len(calls) == 3  # mini-batches 1..3; mini-batch 0's μ is its update's forward
        assert metrics["mismatch/max_abs_diff"] < 1e-4  # float32 engine vs trainer, all four mini-batches
        assert metrics["rollout/entropy"] > 0


def test_no_sharing_under_dropout_or_r2():
    tok = build_char_tokenizer()

    def learner(arch, **overrides):
        return Learner(tiny_model(arch, "nano", tokenizer=tok, **overrides), "vespo", {}, OptimConfig(), 1)

    assert learner("qwen3").shares_behavior_forward()
    assert not learner("qwen3", attention_dropout=0.1).shares_behavior_forward()  # train != eval forward
    moe = learner("qwen3_moe")
    assert moe.shares_behavior_forward("r3") and not moe.shares_behavior_forward("r2")  # R2 records in μ's pass
