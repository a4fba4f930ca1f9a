"""gmpo, dro, kl_cov and clip_cov against verl 0.9.1's geo_mean, dro, kl_cov and clip_cov, and the rollout
correction against verl's rejection, batch normalization and every RolloutCorrectionConfig preset (the table
"verl's presets" in docs/losses.md): runs verl_peer_check.py inside the verl virtualenv (.venv-verl,
scripts/setup_verl_env.sh) and reads its results."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
CHECK = Path(__file__).with_name("verl_peer_check.py")

pytestmark = pytest.mark.skipif(
    not VERL_PYTHON.exists(), reason=f"verl virtualenv absent ({VERL_PYTHON}); run scripts/setup_verl_env.sh"
)
# verl divides by (T_i + 1e-8) in geo_mean's mean and in seq-mean-token-mean: a relative 1e-8 / T_i on those
VERL_EPS_CASES = {"gmpo", "gmpo_asym", "dro_seq_mean"}


@pytest.fixture(scope="module")
def result() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([str(VERL_PYTHON), str(CHECK)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{CHECK.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_losses_equal_verls(result):
    """Loss and gradient equal verl's on 4 seeds x 3 log-ratio scales per case (float64)."""
    assert set(result["diff"]) == {"gmpo", "gmpo_asym", "dro_token_mean", "dro_seq_mean", "kl_cov", "kl_cov_wide",
                                   "clip_cov", "clip_cov_wide"}
    for case, diff in result["diff"].items():
        assert diff < (5e-8 if case in VERL_EPS_CASES else 1e-12), (case, diff)


def test_the_selections_and_clips_acted(result):
    """The comparison covers the parts that select: KL-Cov's penalized and Clip-Cov's cut tokens, GMPO's clip."""
    for case in ("gmpo", "gmpo_asym", "kl_cov", "kl_cov_wide", "clip_cov", "clip_cov_wide"):
        assert result["acted"][case] > 0, case


def test_rejection_equals_verls_rollout_rs_on_every_option(result):
    """mode=reject keeps exactly the tokens verl's compute_rollout_rejection_mask keeps, for each of verl's 11
    rollout_rs options, and rejects some on every one (4 batches)."""
    assert len(result["rejection"]) == 11
    for option, check in result["rejection"].items():
        assert check["mismatched"] == 0 and check["rejected"] > 0, (option, check)


def test_batch_normalized_weights_equal_verls(result):
    """batch_normalize equals verl's rollout_is_batch_normalize for token and sequence TIS and token IcePop: the
    weights (verl's means divide by count + 1e-8: a relative 1e-8 / T) and the factor, which is not 1."""
    assert set(result["batch_normalize"]) == {"tis_token", "tis_seq", "icepop"}
    for case, check in result["batch_normalize"].items():
        assert check["diff"] < 2e-8, (case, check)
        assert check["factor_min"] < 0.99 or check["factor_max"] > 1.01, (case, check)


def test_the_preset_table_lists_every_verl_preset(result):
    """docs/losses.md's table "verl's presets" has a row for each of the 19 classmethods of verl 0.9.1's
    RolloutCorrectionConfig, and no other."""
    presets = result["presets"]
    assert presets["table"] == presets["verl"] and len(presets["verl"]) == 19
    assert set(presets["rows"]) == set(presets["verl"])


def test_every_preset_equals_its_vespo_setting(result):
    """Each row's vespo setting gives verl's per-token correction factor (IS weight x rejected mask), loss and
    gradient to 1e-15 (float64, 4 seeds x 7 mismatch scales), decoupled rows with verl's count of kept tokens."""
    for name, row in result["presets"]["rows"].items():
        assert row["weight"] < 1e-15 and row["loss"] < 1e-15 and row["grad"] < 1e-15, (name, row)
        assert row["compared"] >= 15, (name, row)
        assert row["max_abs_seq_log_ratio"] < 20, (name, row)  # below verl's clamp of the log-ratio before exp


def test_each_presets_filter_and_truncation_acted(result):
    """The comparison covers each part a preset has: its rejection kept some tokens and rejected others, its TIS
    truncated some weights, its IcePop band zeroed some kept tokens."""
    for name, row in result["presets"]["rows"].items():
        if row["rollout_rs"] is not None:
            assert row["kept"] > 0 and row["rejected"] > 0, (name, row)
        else:
            assert row["rejected"] == 0, (name, row)
        if row["rollout_is"] is not None and not isinstance(row["rollout_is_threshold"], str):
            assert row["truncated"] > 0, (name, row)
        if isinstance(row["rollout_is_threshold"], str):  # "lo_hi": IcePop
            assert row["zeroed"] > 0, (name, row)


def test_a_k1_band_read_the_other_way_differs_from_verls(result):
    """Mutation check: vespo's k1 band on pi_old / pi_rollout (low and high swapped and inverted) instead of verl's
    pi_rollout / pi_old gives other weights than verl's seq_sum_k1 "0.7_1.6" on the same batches."""
    assert result["presets_mutated"]["differ"] > 0
