"""Real short runs of the training loop with the local (sync) source on a tiny policy: staleness
bookkeeping, W == 1 on policy, the non-finite guard, checkpoints and resume."""

import json
import math
from pathlib import Path

import pytest
import torch

from stepping import rollout_step, sync_loop

from vespo.losses import get_loss
from vespo.losses import registry
from vespo.losses.registry import LossSpec, register
from vespo.metrics import read_jsonl
from vespo.trainer import train
from vespo.trainer.learner import NonFiniteError


def test_n1_recompute_gives_w_exactly_one(make_cfg):
    with sync_loop(make_cfg("staleness.n=1", "staleness.shuffle=false")) as loop:
        metrics = rollout_step(loop)
        assert metrics["is/log_w_min"] == 0.0 and metrics["is/log_w_max"] == 0.0
        assert metrics["is/w_mean"] == 1.0 and metrics["staleness/lag_max"] == 0.0
        assert loop.learner.version == 1


def test_truncated_sampling_gives_w_exactly_one_with_mu_recomputed_and_the_engines_mu_equal(make_cfg):
    """top-p / top-k sampling: μ recomputed in its own pass (not the update's forward) and π are both of the
    truncated distribution, so at N = 1 log W is 0 exactly; with μ = the engine's log-probs (a float32 engine)
    log W is float rounding, where the full softmax would be off by the log of the kept mass."""
    truncation = ("rollout.top_p=0.8", "rollout.top_k=5")
    with sync_loop(make_cfg("staleness.n=1", *truncation)) as loop:
        loop.learner.can_share = False
        metrics = rollout_step(loop)
        assert metrics["is/log_w_min"] == 0.0 and metrics["is/log_w_max"] == 0.0
    for behavior, top in (("rollout", truncation), ("rollout", ())):
        with sync_loop(make_cfg("staleness.n=1", f"staleness.behavior={behavior}", *truncation)) as loop:
            k, p = (5, 0.8) if top else (0, 1.0)
            loop.learner.sampling = loop.learner.sampling.model_copy(update={"top_k": k, "top_p": p})
            metrics = rollout_step(loop)
        gap = max(abs(metrics["is/log_w_min"]), abs(metrics["is/log_w_max"]))
        assert gap < 1e-4 if top else gap > 1e-2, (top, gap)


def test_stale_minibatches_have_lags_0_to_n_minus_1(make_cfg):
    with sync_loop(make_cfg("staleness.n=4")) as loop:
        seen = []
        update = loop.learner.update

        def recording_update(item):  # records the lag of each mini-batch, then runs the real update
            seen.append(sorted(set((loop.learner.version - item.batch.versions).tolist())))
            return update(item)

        loop.learner.update = recording_update
        first = rollout_step(loop)
        rollout_step(loop)
        assert seen == [[0], [1], [2], [3]] * 2
        assert first["staleness/lag_max"] == 3.0 and first["staleness/lag_mean"] == 1.5
        assert [first[f"staleness/lag_hist_{j}"] for j in range(4)] == [0.25] * 4
        assert loop.learner.version == 8 and loop.source.engine.version == 4  # it samples step 2 at version 4


def test_rollout_behavior_uses_engine_logprobs_and_logs_mismatch(make_cfg):
    with sync_loop(make_cfg("staleness.n=1", "staleness.behavior=rollout", "rollout.engine_dtype=bfloat16")) as loop:
        metrics = rollout_step(loop)
    # bf16 engine vs fp32 trainer: a real mismatch, and W (built on engine log-probs) != 1
    assert metrics["mismatch/abs_diff_max"] > 1e-4
    assert metrics["is/log_w_max"] != 0.0 or metrics["is/log_w_min"] != 0.0


def test_the_engine_gap_has_one_name(make_cfg):
    """mismatch/k1, k3 (engine vs the trainer's pass) is logged once: with μ recomputed the loss's own
    rollout/k1, k3 (engine vs μ) would be the same numbers under a second name, so the trainer drops them,
    also when the loss uses the engine's log-probs for its rollout correction."""
    tis = "loss.options={rollout_correction: {mode: tis_token, threshold: 2.0}}"
    for overrides in ((), (tis,)):
        with sync_loop(make_cfg("staleness.n=2", "rollout.engine_dtype=bfloat16", *overrides)) as loop:
            metrics = rollout_step(loop)
        assert metrics["mismatch/k3"] > 0 and "rollout/k1" not in metrics and "rollout/k3" not in metrics


@pytest.fixture
def nan_loss():
    """VESPO's loss made NaN on its 3rd and 4th calls, registered for this test only (other tests in the same
    process list the registry)."""
    base, calls = get_loss("vespo"), {"n": 0}

    def fn(x, cfg, normalizer=None):
        calls["n"] += 1
        out = base.fn(x, cfg, normalizer)
        if calls["n"] in (3, 4):
            out.loss = out.loss * float("nan")
        return out

    yield register(LossSpec("test_nan_on_calls_3_4", fn, base.config_cls))
    registry._REGISTRY.pop("test_nan_on_calls_3_4")


def test_nan_loss_is_skipped_logged_and_weights_untouched(make_cfg, nan_loss):
    spec = nan_loss
    with sync_loop(make_cfg(f"loss.name={spec.name}", "staleness.n=2", "run.max_nonfinite_steps=3")) as loop:
        policy, learner = loop.learner.model, loop.learner
        rollout_step(loop)  # calls 1, 2: fine
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        adam_before = {k: v["exp_avg"].clone() for k, v in learner.optimizer.state_dict()["state"].items()}
        metrics = rollout_step(loop)  # calls 3, 4: NaN -> both skipped
        assert metrics["optim/n_skipped"] == 2.0  # a count: summed over the step's updates
        assert learner.version == 2 and learner.nonfinite_total == 2
        for k, v in policy.state_dict().items():
            assert torch.equal(v, before[k]), k
        for k, v in learner.optimizer.state_dict()["state"].items():
            assert torch.equal(v["exp_avg"], adam_before[k])
        metrics = rollout_step(loop)  # calls 5, 6: fine again, counter reset
        assert metrics["optim/n_skipped"] == 0.0 and learner.nonfinite_in_a_row == 0
        assert all(torch.isfinite(v).all() for v in policy.state_dict().values())


def test_too_many_nonfinite_updates_stop_the_run(make_cfg):
    with sync_loop(make_cfg("loss.name=vespo", "staleness.n=2", "run.max_nonfinite_steps=1")) as loop:
        loop.learner.spec = LossSpec("always_nan", lambda *a, **k: _nan_out(*a, **k), loop.learner.spec.config_cls)
        with pytest.raises(NonFiniteError, match="1 consecutive updates had a non-finite"):
            rollout_step(loop)


def test_a_run_the_nonfinite_guard_stops_says_so_in_its_summary(make_cfg):
    """The sweep and the lab learn why a run stopped from summary.json, not from its log."""
    cfg = make_cfg("loss.name=vespo", "staleness.n=2", "run.max_nonfinite_steps=1", "run.steps=2")

    def poison(loop):  # after the first update, every loss is non-finite
        loop.learner.spec = LossSpec("always_nan", lambda *a, **k: _nan_out(*a, **k), loop.learner.spec.config_cls)

    with pytest.raises(NonFiniteError):
        train(cfg, on_update=poison)
    summary = json.loads((Path(cfg.run.out_dir) / "summary.json").read_text())
    assert summary["status"] == "non_finite" and summary["updates_done"] == 1 and summary["eval_after"] == {}


def _nan_out(x, cfg, normalizer=None):
    out = get_loss("vespo").fn(x, cfg, normalizer)
    out.loss = out.loss + float("inf")
    return out


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_resume_is_bit_identical(make_cfg):
    full = make_cfg("run.steps=4", "run.checkpoint_every=2", out="full")
    train(full)
    part = make_cfg("run.steps=2", "run.checkpoint_every=2", out="part")
    train(part)
    stored = torch.load(f"{part.run.out_dir}/checkpoints/step-000002/trainer.pt", weights_only=False)["seconds"]
    resumed = make_cfg("run.steps=4", "run.checkpoint_every=2", out="part")
    resumed_summary = train(resumed, resume=True)
    # the summary's seconds count the process it resumed from, up to its checkpoint, and this one
    assert 0 < stored == resumed_summary["seconds_before_resume"] < resumed_summary["seconds"]
    a = _comparable(read_jsonl(f"{full.run.out_dir}/metrics.jsonl"))
    b = _comparable(read_jsonl(f"{part.run.out_dir}/metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    summary = json.loads(open(f"{part.run.out_dir}/summary.json").read())
    assert summary["policy_version"] == 8


def test_resume_refuses_a_config_that_trains_something_else(make_cfg):
    """A run resumed under another loss (or N, or lr) would silently become another experiment; a longer run
    (run.steps) is what --resume is for."""
    from vespo.errors import ResumeError

    train(make_cfg("run.steps=1", out="r"))
    with pytest.raises(ResumeError, match=r"loss.name: 'vespo' -> 'gspo'.*staleness.n: 2 -> 4"):
        train(make_cfg("run.steps=2", "loss.name=gspo", "staleness.n=4", out="r"), resume=True)
    assert train(make_cfg("run.steps=2", out="r"), resume=True)["steps_done"] == 2


def test_a_finished_run_directory_is_not_overwritten(make_cfg):
    cfg = make_cfg("run.steps=1")
    train(cfg)
    with pytest.raises(FileExistsError, match="--resume"):
        train(cfg)


@pytest.mark.parametrize("loss", ["vespo", "grpo"])
def test_micro_batching_changes_no_update_and_no_diagnostic(make_cfg, loss):
    """One rollout step (N = 2, a bfloat16 engine so that W != 1 and the engine gap is real) with the whole
    mini-batch in one forward and in quarters: the same update, and every logged diagnostic the same up to
    float rounding (each is formed from the rows of the whole mini-batch, or of the whole step)."""
    results = []
    for micro in (0, 8):
        cfg = make_cfg("staleness.n=2", f"loss.name={loss}", f"optim.micro_batch_size={micro}",
                       "rollout.engine_dtype=bfloat16", "staleness.behavior=rollout", out=f"micro{micro}")
        with sync_loop(cfg) as loop:
            metrics = rollout_step(loop)
            results.append((metrics, [p.detach().clone() for p in loop.learner.model.parameters()]))
    (m0, p0), (m1, p1) = results
    assert m0["is/log_w_max"] != 0.0 and m0["mismatch/k3"] > 0  # off policy: the check is not vacuous
    compared = [k for k in m0 if not k.startswith("perf/")]
    assert set(compared) <= set(m1) and len(compared) > 40
    for key in compared:
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_devices_resolve_and_a_missing_gpu_is_a_config_error(make_cfg):
    from vespo.config import ConfigError
    from vespo.models.device import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device(None, "cpu").type == "cpu"  # rollout.device None follows model.device
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="model.device / rollout.device"):
            resolve_device("cuda:0")
    with pytest.raises(ConfigError, match="model.device must be auto, cpu, cuda or cuda:N"):
        make_cfg("model.device=gpu")


def test_cpu_autocast_run_trains(make_cfg):
    """model.autocast runs the learner's forwards in bfloat16 (here on the CPU); the run still learns steps."""
    cfg = make_cfg("model.device=cpu", "model.autocast=true", "run.steps=2")
    summary = train(cfg)
    assert summary["status"] == "done" and summary["policy_version"] == 4
    rows = read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl")
    assert all(math.isfinite(r["loss/total"]) for r in rows)


def test_samples_are_logged_readably(make_cfg):
    cfg = make_cfg("run.steps=2", "run.log_samples_every=1", "run.samples_per_log=3", "run.loggers=[jsonl,tensorboard]")
    train(cfg)
    rows = read_jsonl(f"{cfg.run.out_dir}/samples.jsonl")
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    for r in rows:
        assert set(r) >= {"prompt", "completion", "reward", "advantage", "lag", "log_w", "weight"}
        assert (r["weight"] is None) == (r["advantage"] == 0.0)  # VESPO's phi(W) where there is a gradient
        assert r["prompt"].endswith("=") and r["lag"] in (0, 1) and r["reward"] in (0.0, 1.0)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{cfg.run.out_dir}/tb", size_guidance={"tensors": 0}).Reload()
    assert "samples/text_summary" in events.Tags()["tensors"]
