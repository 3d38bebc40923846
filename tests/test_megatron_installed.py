"""CI runs the Megatron-core tests for real: under ``CI=true`` the pinned megatron-core must be
installed (``.ci/run`` installs it), so that tests/test_megatron.py cannot pass by skipping.
Outside the compat subset: its venvs resolve another megatron-core, for the policy oracle only."""

from __future__ import annotations

import os

import pytest
from test_megatron import FOUND, TESTED


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI only (CI=true)")
def test_ci_has_the_tested_megatron_core():
    assert FOUND == TESTED, f"CI installs megatron-core {TESTED}, found {FOUND}"
