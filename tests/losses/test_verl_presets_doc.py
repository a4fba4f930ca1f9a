"""Each vespo setting in docs/losses.md's table "verl's presets" is a valid `vespo train` command line: the
overrides load and validate (a bypass-mode refusal included) and give the row's mode and behaviour policy. That
each equals verl's preset is checked in tests/losses/test_verl_peers.py (in the verl virtualenv)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from vespo.config import load_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "losses.md"


def settings() -> dict[str, str]:
    lines = DOCS.read_text().split("\n")
    rows = {}
    for line in lines[lines.index("### verl's presets") + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip("`")] = re.fullmatch(r"`([^`]*)`", cells[2]).group(1)
    return rows


def test_every_preset_setting_is_a_valid_command_line():
    rows = settings()
    assert len(rows) == 19
    for preset, setting in rows.items():
        config = load_config(None, shlex.split(setting))
        assert config.behavior == ("rollout" if preset.startswith("bypass") else "recompute"), preset
        rc = config.loss.options.rollout_correction
        assert (rc.mode == "none") == (preset in ("disabled", "bypass_ppo_clip")), preset
        assert (rc.reject_by is not None) == ("_rs" in preset), preset
