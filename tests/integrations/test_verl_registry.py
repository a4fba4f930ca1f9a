"""docs/integrations.md's table "Every registered loss" against what vespo's verl plug-in registers, and each
verl counterpart it names against the registered loss: runs verl_registry_check.py in the verl virtualenv
(.venv-verl) and reads its results. The first test needs no verl: the table's names follow vespo's losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vespo.losses import loss_names

REPO = Path(__file__).resolve().parents[2]
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
CHECK = Path(__file__).with_name("verl_registry_check.py")
CLIPPING = ("vespo_grpo", "vespo_gspo", "vespo_cispo", "vespo_dppo", "vespo_gmpo", "vespo_clip_cov")


def table() -> dict:
    sys.path.insert(0, str(CHECK.parent))
    try:
        from verl_registry_check import registry_table  # the same parser the verl-side check uses
    finally:
        sys.path.remove(str(CHECK.parent))
    return registry_table()


def test_the_table_has_one_row_per_vespo_loss():
    """One row per loss of vespo.losses, under the name the plug-in gives it (`vespo*` as is, else vespo_<name>),
    running that loss."""
    rows = table()
    expected = {(name if name.startswith("vespo") else f"vespo_{name}"): name for name in loss_names()}
    assert {registered: loss for registered, (loss, _) in rows.items()} == expected


@pytest.fixture(scope="module")
def result() -> dict:
    if not VERL_PYTHON.exists():
        pytest.skip(f"verl virtualenv absent ({VERL_PYTHON}); run scripts/setup_verl_env.sh")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([str(VERL_PYTHON), str(CHECK)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{CHECK.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_table_lists_exactly_what_the_plugin_registers(result):
    assert result["table"] == result["registered"]
    assert result["runs"] == result["expected_runs"]


def test_every_verl_loss_is_named_and_every_named_one_is_verls(result):
    """Each counterpart the table names is one of verl's own losses, and each of verl's own losses is named (dppo_kl
    in vespo_dppo's note, bypass_mode below the table: a mode of the rollout correction, not a loss)."""
    named = {c for c in result["counterparts"].values() if c is not None}
    assert named <= set(result["verl_own"])
    assert named | {"dppo_kl", "bypass_mode"} == set(result["verl_own"])


def test_each_counterpart_gives_the_registered_loss(result):
    """Loss and gradient equal verl's to 1e-15 in token-mean and seq-mean-token-sum; verl divides by (T_i + 1e-8)
    in seq-mean-token-mean (a relative 1e-8 / T_i), so there to 5e-8. verl's clips acted where it has them."""
    named = {k for k, c in result["counterparts"].items() if c is not None}
    assert set(result["diff"]) == named | {"vespo_dppo/dppo_kl"}
    for name, per_mode in result["diff"].items():
        for mode, diff in per_mode.items():
            assert diff < (5e-8 if mode == "seq-mean-token-mean" else 1e-15), (name, mode, diff)
    for name in CLIPPING:
        assert result["clipfrac"][name] > 0, name
