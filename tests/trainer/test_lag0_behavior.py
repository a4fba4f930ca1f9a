"""A lag-0 mini-batch takes its behavior pass from its own update's forward: the same numbers as a
separate recompute, one pass fewer (the first mini-batch of a sync rollout step; every async one)."""

import torch
from stepping import rollout_step, sync_loop

from vespo.config import load_config
from vespo.models import build_char_tokenizer, tiny_model
from vespo.trainer.learner import Learner


def test_lag0_update_forward_is_the_recompute(make_cfg):
    with sync_loop(make_cfg("staleness.n=2")) as ours, sync_loop(make_cfg("staleness.n=2", out="other")) as theirs:
        theirs.learner.can_share = False  # a separate recompute pass for every mini-batch
        [item, _] = ours.source.next()
        [twin, _] = theirs.source.next()  # the same seed and weights: the same samples
        assert torch.equal(item.batch.response_ids, twin.batch.response_ids)
        assert ours.learner.prepare([item]) == {}  # nothing run now: the update's forward is the pass
        behavior = theirs.learner.prepare([twin])
        result = ours.learner.update(item)
        other = theirs.learner.update(twin)
        assert other.behavior_rows == {}
        for key, value in behavior.items():
            assert torch.equal(result.behavior_rows[key], value), key  # bit for bit: same weights, same forward
        assert torch.equal(result.log_w, other.log_w) and result.log_w.abs().max() == 0  # W == 1 at lag 0
        for a, b in zip(ours.learner.model.parameters(), theirs.learner.model.parameters()):
            assert torch.equal(a, b)  # and so the same optimizer step


def test_a_rollout_step_recomputes_mu_only_for_stale_minibatches(make_cfg):
    with sync_loop(make_cfg("staleness.n=4")) as loop:
        calls = []
        behavior_pass = loop.learner.behavior_pass
        loop.learner.behavior_pass = lambda batch: calls.append(len(batch)) or behavior_pass(batch)
        metrics = rollout_step(loop)
        assert len(calls) == 3  # mini-batches 1..3; mini-batch 0's μ is its update's forward
        assert metrics["mismatch/abs_diff_max"] < 1e-4  # float32 engine vs trainer, all four mini-batches
        assert metrics["rollout/entropy"] > 0


def test_no_sharing_under_dropout_or_r2():
    tok = build_char_tokenizer()

    def learner(arch, replay="none", **overrides):
        model = tiny_model(arch, "nano", tokenizer=tok, **overrides)
        cfg = load_config(None, ["model.device=cpu", f"rollout.router_replay={replay}", "run.steps=1", "staleness.n=1"])
        return Learner(model, cfg)

    assert learner("qwen3").can_share
    assert not learner("qwen3", attention_dropout=0.1).can_share  # train != eval forward
    assert learner("qwen3_moe", "r3").can_share and not learner("qwen3_moe", "r2").can_share  # R2 records in μ's pass
