"""mu = the engine's log-probs (staleness.behavior=rollout, verl's bypass mode): the rollout correction acts on
pi_theta / pi_rollout in real short runs, where it used to compare the engine with itself (ratio 1, nothing
masked); a truncation that would count the ratio twice is refused with one line."""

import pytest
from stepping import rollout_step, sync_loop

from vespo.config import ConfigError
from vespo.trainer.loop import StepWindow

BAND = "loss.options={rollout_correction: {mode: geo_mask, geo_low: 0.999, geo_high: 1.001}}"
# warm-started to ~30% (as in test_ess_step): groups with right and wrong answers, so the first update moves pi
SIGNAL = ("rollout.prompts_per_step=16", "rollout.group_size=8", "warmstart.steps=60", "warmstart.lr=3e-3")


def test_under_mu_from_the_engine_a_rejection_acts_on_pi_over_pi_rollout(make_cfg):
    """At lag 1 pi_theta has moved one update away from the engine that sampled the batch: a narrow geo_mask band
    rejects sequences there, and the update differs from plain GRPO's on the same samples."""
    steps = {}
    for name, extra in (("geo_mask", (BAND,)), ("plain", ())):
        with sync_loop(make_cfg(*SIGNAL, "staleness.n=2", "staleness.behavior=rollout", "loss.name=grpo", *extra,
                                out=name)) as loop:
            steps[name] = rollout_step(loop)
    assert steps["geo_mask"]["reward/mean"] == steps["plain"]["reward/mean"]  # the same samples
    assert steps["geo_mask"]["rollout/masked_frac"] > 0
    assert "rollout/masked_frac" not in steps["plain"]
    assert steps["geo_mask"]["optim/grad_norm"] != steps["plain"]["optim/grad_norm"]


@pytest.mark.parametrize("loss", ["grpo", "vespo", "reinforce"])
def test_a_truncation_under_mu_from_the_engine_is_refused_unless_the_loss_has_no_ratio(make_cfg, loss):
    tis = "loss.options={rollout_correction: {mode: tis_token}}"
    with pytest.raises(ConfigError, match="cannot act with mu = the engine's log-probs"):
        make_cfg("staleness.behavior=rollout", f"loss.name={loss}", tis)
    make_cfg("staleness.behavior=recompute", f"loss.name={loss}", tis)  # pi_old / pi_rollout: it acts there
    make_cfg("staleness.behavior=rollout", "loss.name=reinforce",
             "loss.options={is_level: none, rollout_correction: {mode: tis_token}}")  # verl's bypass REINFORCE


@pytest.mark.parametrize("loss", ["grpo", "vespo"])
def test_icepop_under_mu_from_the_engine_is_refused_unless_the_loss_has_no_ratio(make_cfg, loss):
    """IcePop weighs by pi_old / pi_rollout; with mu = the engine's log-probs there is no pi_old (verl's bypass
    PPO-clip drops IcePop there), so the config is refused naming the fields; with mu recomputed it is the paper's
    IcePop, and reinforce with is_level=none takes its whole weight (verl's bypass REINFORCE)."""
    icepop = "loss.options={rollout_correction: {mode: icepop}}"
    with pytest.raises(ConfigError, match=r"rollout_correction.mode=icepop cannot act with mu = the engine's log-probs "
                                          r"\(staleness.behavior=rollout"):
        make_cfg("staleness.behavior=rollout", f"loss.name={loss}", icepop)
    with pytest.raises(ConfigError, match="rollout_correction.mode=icepop cannot act"):
        make_cfg("run.mode=async", f"loss.name={loss}", icepop)  # async: mu is the engine's (behavior auto)
    make_cfg("staleness.behavior=recompute", f"loss.name={loss}", icepop)
    make_cfg("staleness.behavior=rollout", "loss.name=reinforce",
             "loss.options={is_level: none, rollout_correction: {mode: icepop}}")


def test_decoupled_ppo_reads_each_tokens_lag_in_a_real_run(make_cfg):
    """decoupled_ppo's pi_prox interpolates by each token's lag, which the learner passes: with AReaL's versions
    alpha is 0 at lags 0 and 1, so its first two updates are PPO on pi / mu (GRPO without the dual clip) on the same
    samples, and its third (lag 2, alpha 1/2) differs."""
    updates = {}
    for name, loss in (("decoupled", ("loss.name=decoupled_ppo",)),
                       ("ppo", ("loss.name=grpo", "loss.options={dual_clip_c: null}"))):
        with sync_loop(make_cfg(*SIGNAL, "rollout.prompts_per_step=12", "staleness.n=3", "staleness.behavior=rollout",
                                *loss, out=name)) as loop:
            window = StepWindow()
            for _ in range(3):
                loop.train_one(window)
            updates[name] = [u["optim/grad_norm"] for u in window.updates if "optim/grad_norm" in u]
    assert len(updates["decoupled"]) == 3
    for lag in (0, 1):
        assert updates["decoupled"][lag] == pytest.approx(updates["ppo"][lag], rel=1e-5)
    assert updates["decoupled"][2] != pytest.approx(updates["ppo"][2], rel=1e-3)


def test_help_config_says_which_correction_applies_when(capsys):
    from vespo.trainer.cli import main

    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 100 and "{'type'" not in line for line in out if line.startswith(" "))  # wrapped words
    help_of, name = {}, None
    for line in out:  # a field's line, then its help text indented below it
        if line.startswith(" "):
            help_of[name] += " " + line.strip()
        else:
            name = line.split()[0]
            help_of[name] = line
    assert "(one of: auto, recompute, rollout)" in help_of["staleness.behavior"]
    assert "bypass mode" in help_of["staleness.behavior"] and "pi/pi_rollout" in help_of["staleness.behavior"]
    for words in ("pi_old/pi_rollout with mu recomputed", "rejection part on pi/pi_rollout", "tis_* and icepop refused"):
        assert words in help_of["loss.options"]
    assert "exactly 1 at staleness.n=1" in help_of["optim.ess_against"]
