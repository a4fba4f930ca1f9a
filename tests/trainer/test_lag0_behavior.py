"""Mini-batch 0 takes μ from its own update's forward: the same numbers as a separate recompute, one pass fewer."""

import torch

from vespo.buffer import split_minibatches
from vespo.config import OptimConfig
from vespo.models import build_char_tokenizer, tiny_model
from vespo.trainer.learner import Learner
from vespo.trainer.setup import build
from vespo.trainer.sync import train_step


def first_minibatch(parts):
    batch, _ = parts.producer.produce(parts.cfg.rollout.prompts_per_step, seed=5, first_group_id=0)
    return split_minibatches(batch, parts.cfg.staleness.n, None)[0]


def test_lag0_update_forward_is_the_recompute(make_cfg):
    ours, theirs = build(make_cfg("staleness.n=2")), build(make_cfg("staleness.n=2", out="other"))
    mb = first_minibatch(ours)
    twin = mb.select(torch.arange(len(mb)))  # the same rows, for the other learner
    mu, entropy = theirs.learner.behavior_logp(twin, "none")  # the separate recompute
    twin.old_logp = mu
    result = ours.learner.update(mb, own_behavior=True)
    theirs.learner.update(twin)
    assert torch.equal(mb.old_logp, mu)  # bit for bit: the same weights, the same forward
    assert torch.equal(result.logp, mu) and torch.allclose(result.entropy, entropy, atol=1e-6)
    for a, b in zip(ours.policy.parameters(), theirs.policy.parameters()):
        assert torch.equal(a, b)  # and so the same optimizer step


def test_train_step_recomputes_mu_only_for_stale_minibatches(make_cfg):
    parts = build(make_cfg("staleness.n=4"))
    calls = []
    behavior_logp = parts.learner.behavior_logp
    parts.learner.behavior_logp = lambda mb, replay: calls.append(len(mb)) or behavior_logp(mb, replay)
    metrics = train_step(parts, 0)
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
