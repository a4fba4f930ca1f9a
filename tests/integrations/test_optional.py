"""verl and TRL are optional: importing vespo, its losses or the integrations package loads neither."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["vespo", "vespo.losses", "vespo.integrations"])
def test_import_does_not_load_verl_or_trl(module):
    code = f"import sys, {module}; print(sorted(m for m in ('verl', 'trl') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
