"""vespo as a verl policy loss: runs verl_check.py inside the verl virtualenv and reads its results.

verl 0.9.1 pins transformers < 5.11, so it lives in .venv-verl (scripts/setup_verl_env.sh builds it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
CHECK = Path(__file__).with_name("verl_check.py")
ACTOR_CHECK = Path(__file__).with_name("verl_actor_check.py")

pytestmark = pytest.mark.skipif(
    not VERL_PYTHON.exists(), reason=f"verl virtualenv absent ({VERL_PYTHON}); run scripts/setup_verl_env.sh"
)


def run_check(script: Path) -> dict:
    """Run a check script in the verl virtualenv; its last stdout line is its JSON result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([str(VERL_PYTHON), str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def result() -> dict:
    return run_check(CHECK)


@pytest.fixture(scope="module")
def actor_result() -> dict:
    return run_check(ACTOR_CHECK)


def test_documented_overrides_register_and_configure_vespo(result):
    assert result["registered_before_config"] is False  # only building the config imported our module
    assert result["fn_module"] == "vespo.integrations.verl"
    assert result["options"] == {"k_pos": 1.5, "lambda_pos": 2.5, "k_neg": 3.5, "lambda_neg": 1.5}


def test_other_losses_registered_without_replacing_verls(result):
    for name in ("vespo_adaptive", "vespo_grpo", "vespo_gspo", "vespo_sapo", "vespo_cispo", "vespo_reinforce",
                 "vespo_dppo", "vespo_m2po"):
        assert name in result["registry"]
    assert result["verl_gspo_module"] == "verl.trainer.ppo.core_algos"


def test_matches_float64_reference_with_verl_aggregation(result):
    diffs = result["reference_diff"]
    assert len(diffs) == 12
    bad = {case: d for case, d in diffs.items() if not d < 1e-6}
    assert not bad, bad


def test_matches_vespo_losses_directly(result):
    assert set(result["vespo_diff"]) == {"cispo", "clip_cov", "decoupled_ppo", "dppo", "dro", "gmpo", "grpo", "gspo",
                                         "ipo", "kl_cov", "luspo", "m2po", "prime_rl", "reinforce", "sapo", "topr",
                                         "vespo", "vespo_adaptive"}
    assert max(result["vespo_diff"].values()) < 1e-12


def test_adaptive_vespo_configured_from_hydra(result):
    adaptive = result["adaptive"]
    assert adaptive["options"] == {"rule": "ess", "ess_target": 0.9, "k_neg": 4.0}
    assert adaptive["diff"] < 1e-12  # verl's [B, T] advantages: the same loss as vespo's with [B] advantages
    assert adaptive["shape_diff"] < 1e-12
    assert adaptive["differs_from_vespo"] > 1e-6  # the ESS rule did move the kernel on this stale batch
    assert adaptive["shape"]["k_neg"] != 4.0 or adaptive["shape"]["k_pos"] != 2.0


def test_misspelled_option_names_field_and_choices(result):
    assert result["unknown_option_error"].startswith("actor.policy_loss.vespo.kpos: unknown option; choose from:")
    assert "k_pos" in result["unknown_option_error"]


def test_dppo_equals_verls_dppo_tv_and_kl(result):
    """Loss and gradient of vespo's dppo against verl's own dppo_tv / dppo_kl: 4 option sets (tv, kl, each
    with asymmetric thresholds and a ratio cap) x 5 verl aggregation modes x (local, dp2), plus vespo.losses
    called directly; float64, so equal to rounding."""
    diffs = result["dppo"]["diff"]
    assert len(diffs) == 4 * (5 * 2 + 1)
    assert max(diffs.values()) < 1e-12, max(diffs.items(), key=lambda kv: kv[1])
    fractions = result["dppo"]["mask_fraction"]
    assert all(abs(ours - verl) < 1e-6 for ours, verl in fractions.values())  # verl's is float32
    assert all(0 < ours < 1 for ours, _ in fractions.values())  # the trust region bound in every case


def test_geo_mask_equals_verls_geo_rs(result):
    """vespo's geo_mask (band on pi_old / pi_rollout) keeps exactly the sequences verl's seq_mean_k1 rejection
    keeps (band on the inverse ratio), for verl's preset and an asymmetric band; the loss weighted by either
    mask is the same."""
    assert result["geo_mask"].pop("extreme_row_kept") == {"verl": True, "vespo_default": False, "vespo_clamp20": True}
    for band, check in result["geo_mask"].items():
        assert check["mismatched"] == 0, (band, check)
        assert 0 < check["kept"] < check["sequences"], (band, check)
        assert check["loss_diff"] < 1e-12, (band, check)


def test_every_logged_metric_is_the_mini_batchs_whatever_the_micro_batching(result):
    """One mini-batch in one call or in four micro-batch calls, combined as verl combines policy-loss metrics:
    every actor/* metric the same to float rounding (is/ess, quantiles, E_Q[W], clip fractions...)."""
    for name, worst in result["micro_batching"].items():
        assert worst < 1e-9, (name, worst)


def test_icepop_and_bypass_mode_equal_verls(result):
    """IcePop's weights and a GRPO loss with them equal verl's; with mu = the engine's log-probs, vespo's
    reinforce (is_level=none) with token TIS or IcePop and GRPO with geo_mask equal verl's bypass mode, and the
    correction acted on those batches. verl's bypass PPO-clip with IcePop drops the IS weights (plain PPO), which
    vespo's GRPO with no correction equals (vespo refuses IcePop there: it cannot act)."""
    r = result["icepop_bypass"]
    assert r["icepop_weight_diff"] < 1e-12 and 0 < r["icepop_zeroed"] < r["tokens"]
    assert r["decoupled_grpo_icepop_diff"] < 1e-12
    for case in ("reinforce_tis", "reinforce_icepop", "ppo_clip_icepop", "ppo_clip_geo_rs"):
        assert r[f"bypass_{case}_diff"] < 1e-12, case
    for case in ("reinforce_tis", "reinforce_icepop", "ppo_clip_geo_rs"):
        assert r[f"bypass_{case}_acted"] > 0, case


def test_verls_actor_update_with_vespo_equals_vespos_own_loss_and_gradient(actor_result):
    """verl 0.9.1's actor update path (update_actor -> FSDP2 engine train_batch, 4 micro-batches of 2 -> ppo_loss ->
    loss_mode=vespo) at world size 1 on the CPU in float32: its loss and the gradient it hands the optimizer equal
    vespo's VESPO loss on the same batch computed in one piece; the residual is float32 summation order (each
    micro-batch's sum divided by the mini-batch's tokens, then added), a few units in the 7th digit."""
    r = actor_result
    assert (r["autocast_dtype"], r["param_dtype"]) == ("torch.float32", "torch.float32")
    assert r["grad_params"] == 24 and r["grad_names_missing"] == []
    assert abs(r["verl_loss"]) > 0.1 and r["loss_diff"] <= 2e-6 * abs(r["vespo_loss"])
    assert r["grad_diff"] <= 2e-6 * r["grad_scale"], (r["grad_diff"], r["grad_scale"])
    assert 0 < r["is_ess"] < 0.95  # behaviour log-probs off the policy: the weights vary
    assert {"actor/is/ess", "actor/vespo/phi_pos_mean", "actor/vespo/phi_neg_mean", "actor/pg_loss",
            "grad_norm"} <= set(r["metric_keys"])
