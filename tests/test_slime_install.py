"""``distscaler.integrations.slime`` without megatron-core refuses at its import (where slime
imports the hook by its path), saying what to run for the interpreter at hand: on Python 3.11 the
``slime`` extra installs no megatron-core (0.19.2 declares Python >= 3.12), so the message gives
the line CI uses (docs/integrations/slime.md#install). No megatron-core or slime needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: megatron hidden from the import system, as in an environment without megatron-core.
CODE = """
import sys
sys.modules["megatron"] = None
try:
    import distscaler.integrations.slime
except ImportError as e:
    print(e)
else:
    print("imported")
"""


def test_slime_without_megatron_core_says_what_to_install(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CODE],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    message = done.stdout.strip().splitlines()[-1]
    assert message.startswith("distscaler.integrations.slime needs megatron-core 0.19.2: ")
    if sys.version_info < (3, 12):
        assert message.endswith(
            "install its wheel without the check: "
            "pip install --ignore-requires-python --no-deps megatron-core==0.19.2"
        ), message
        assert f"on Python 3.{sys.version_info[1]} the `slime` extra leaves it out" in message
    else:
        assert message.endswith("pip install 'distscaler[slime]'"), message
