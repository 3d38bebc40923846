"""The multi-host tests' testbeds (``launch/multihost.py``): built on demand, torn down and checked
for leftovers at the end of the test.

Where no testbed can be built (not root, a tool missing) the tests skip with the reason; in CI's
multi-host stage (``DISTSCALER_MULTIHOST_STAGE=1``, .ci/run) they fail instead, so that the stage
cannot pass without running them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import multihost
import pytest

__all__ = ["STAGE_ENV", "build_testbeds", "cannot_run"]

#: Set to 1 by CI's multi-host stage: a test that cannot run there fails instead of skipping.
STAGE_ENV = "DISTSCALER_MULTIHOST_STAGE"


def cannot_run(reason: str, *, module: bool = False) -> None:
    """Skips the test (``module``: the test module, at its import) with ``reason``; fails it in
    CI's multi-host stage (``STAGE_ENV``)."""
    if os.environ.get(STAGE_ENV) == "1":
        pytest.fail(f"{STAGE_ENV}=1 and the test cannot run: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def build_testbeds(command_timeout_s: float) -> Iterator[Callable[[int], multihost.Testbed]]:
    """The body of a ``make_testbed`` fixture: yields ``make(num_hosts)``, which builds a testbed
    whose commands run at most ``command_timeout_s`` seconds (skips the test where the machine
    cannot build one); then tears each down and fails if anything of it is left."""
    beds: list[multihost.Testbed] = []

    def make(num_hosts: int) -> multihost.Testbed:
        bed = multihost.Testbed(num_hosts, command_timeout_s=command_timeout_s)
        try:
            bed.start()
        except multihost.TestbedUnavailable as e:
            cannot_run(f"no multi-host testbed here: {e.reason}")
        beds.append(bed)
        return bed

    yield make
    incomplete = []
    for bed in beds:
        try:
            bed.teardown()
        except multihost.TeardownIncomplete as e:  # the others are torn down all the same
            incomplete.append(str(e))
    assert incomplete == []
    assert [item for bed in beds for item in bed.leftovers()] == []
