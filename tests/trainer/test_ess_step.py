"""VCPO's ESS-scaled step size (optim.ess_scaled_lr) in real short runs on the tiny policy: the scale is
1 on policy, below 1 on stale mini-batches, applied to the optimizer step it belongs to and no other,
and logged as optim/ess_lr_scale."""

import pytest
import torch
from stepping import rollout_step, sync_loop

from vespo.losses import ess_step_scale
from vespo.metrics import read_jsonl
from vespo.trainer import train

# warm-started to ~30% on 1-digit addition (as in test_learning), 4 prompts x 8 per mini-batch: groups with
# both right and wrong answers, so the updates move the policy and the stale mini-batches have W != 1
SIGNAL = ("rollout.prompts_per_step=16", "rollout.group_size=8", "warmstart.steps=60", "warmstart.lr=3e-3")


def record_updates(loop):
    """Wrap the learner so that each update records its lag, its metrics and the lr its optimizer step used."""
    learner, seen = loop.learner, []
    update = learner.update

    def before_step(optimizer, args, kwargs):
        seen[-1]["step_lrs"] = [group["lr"] for group in optimizer.param_groups]

    def recording_update(item):
        seen.append({"lag": int((learner.version - item.batch.versions).max())})
        result = update(item)
        seen[-1].update(metrics=result.metrics, rows_log_w=result.log_w, lrs_after=[
            group["lr"] for group in learner.optimizer.param_groups])
        return result

    learner.optimizer.register_step_pre_hook(before_step)
    learner.update = recording_update
    return seen


@pytest.mark.parametrize("loss", ["vespo", "grpo"])
def test_ess_scale_is_one_on_policy_below_one_when_stale_and_scales_that_step_only(make_cfg, loss):
    cfg = make_cfg(*SIGNAL, "staleness.n=4", "optim.ess_scaled_lr=true", f"loss.name={loss}")
    with sync_loop(cfg) as loop:
        seen = record_updates(loop)
        rollout_step(loop)
    lr = cfg.optim.lr
    assert [u["lag"] for u in seen] == [0, 1, 2, 3]
    for u in seen:
        scale = u["metrics"]["optim/ess_lr_scale"]
        expected = ess_step_scale({"log_w": u["rows_log_w"].double(), "tokens": torch.ones(len(u["rows_log_w"]))})
        assert scale == pytest.approx(expected.item(), rel=1e-6)  # sqrt(ESS / B) of the mini-batch's own W
        assert u["step_lrs"] == [pytest.approx(lr * scale, rel=1e-12)]  # the step ran at the scaled lr ...
        assert u["lrs_after"] == [lr] and u["metrics"]["optim/lr"] == lr  # ... and the schedule's lr came back
    assert seen[0]["metrics"]["optim/ess_lr_scale"] == 1.0  # lag 0 with mu recomputed: W == 1 exactly
    assert all(0 < u["metrics"]["optim/ess_lr_scale"] < 1 for u in seen[1:])


def test_without_the_option_the_step_is_unscaled(make_cfg):
    with sync_loop(make_cfg(*SIGNAL, "staleness.n=2")) as loop:
        seen = record_updates(loop)
        rollout_step(loop)
    assert all("optim/ess_lr_scale" not in u["metrics"] for u in seen)
    assert [u["step_lrs"] for u in seen] == [[make_cfg().optim.lr]] * 2


def test_a_run_logs_the_scale_below_one_on_stale_steps(make_cfg):
    cfg = make_cfg(*SIGNAL, "staleness.n=4", "optim.ess_scaled_lr=true", "loss.name=vespo", "run.steps=2")
    train(cfg)
    rows = read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl")
    scales = [row["optim/ess_lr_scale"] for row in rows if "optim/ess_lr_scale" in row]
    assert len(scales) == cfg.run.steps  # one per rollout step: the mean over its 4 updates (lags 0..3)
    assert all(0 < s < 1 for s in scales)


def test_at_n1_with_mu_recomputed_the_scale_is_one_and_the_run_says_so(make_cfg):
    """W = pi/mu = 1 on every update: the scale cannot act, and one line says so; optim.ess_against=engine
    measures W against a bfloat16 engine's log-probs instead, as VCPO does, and the scale acts."""
    from vespo.trainer.run import ess_notice

    scales = {}
    for against in ("mu", "engine"):
        cfg = make_cfg(*SIGNAL, "staleness.n=1", "rollout.engine_dtype=bfloat16", "optim.ess_scaled_lr=true",
                       f"optim.ess_against={against}", out=against)
        assert (ess_notice(cfg) is not None) == (against == "mu")
        with sync_loop(cfg) as loop:
            scales[against] = rollout_step(loop)["optim/ess_lr_scale"]
    assert scales["mu"] == 1.0
    assert 0 < scales["engine"] < 1
    assert "optim.ess_scaled_lr scales every step by exactly 1" in ess_notice(make_cfg("staleness.n=1",
                                                                                        "optim.ess_scaled_lr=true"))
    assert ess_notice(make_cfg("staleness.n=2", "optim.ess_scaled_lr=true")) is None
