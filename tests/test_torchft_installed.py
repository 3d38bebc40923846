"""CI runs the torchft tests for real: under ``CI=true`` the pinned torchft must be installed (the
``test`` extra installs it), so that tests/test_torchft.py cannot pass by skipping."""

from __future__ import annotations

import os

import pytest
from test_torchft import FOUND, TESTED


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI only (CI=true)")
def test_ci_has_the_tested_torchft():
    assert FOUND == TESTED, f"CI installs torchft {TESTED}, found {FOUND}"
