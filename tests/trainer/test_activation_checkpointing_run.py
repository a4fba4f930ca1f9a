"""model.gradient_checkpointing: a run with it on takes the same updates as without it (the same samples,
μ, losses and weights, to float rounding), with every decoder layer recomputed in backward."""

import pytest
import torch
from stepping import rollout_step, sync_loop


def test_a_run_with_checkpointing_takes_the_same_updates(make_cfg):
    common = ["staleness.n=2"]
    with sync_loop(make_cfg(*common)) as plain, \
            sync_loop(make_cfg(*common, "model.gradient_checkpointing=true", out="checkpointed")) as ours:
        assert all(layer.gradient_checkpointing for layer in ours.learner.model.model.layers)
        assert not any(layer.gradient_checkpointing for layer in plain.learner.model.model.layers)
        start = [p.detach().clone() for p in plain.learner.model.parameters()]
        for _ in range(2):  # two rollout steps: 4 updates, two of them on a recomputed μ
            a, b = rollout_step(plain), rollout_step(ours)
            for key in ("loss/total", "optim/grad_norm", "reward/mean", "mismatch/abs_diff_max"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        params = list(zip(plain.learner.model.named_parameters(), ours.learner.model.parameters(), start))
        assert any(not torch.equal(p, p0) for (_, p), _, p0 in params)  # the updates moved the weights
        for (name, p), q, _ in params:
            assert torch.allclose(q, p, rtol=0, atol=1e-6), name
