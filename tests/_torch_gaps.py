"""Gaps of torch itself on this machine, proved by running torch's own recipe without distscaler.

A spawned scenario calls :func:`torch_gaps` on every rank before its cases and records, per case,
the traceback it crashed with (:func:`run_case`); a test then calls :func:`skip_if_torch_gap`:
a crash whose error is the one torch's own recipe raised is skipped with that proof as the
reason, any other crash fails. One layout's crash does not take the others of its spawn with it.

Known: torch 2.6's FSDP2 on CPU calls ``record_event`` on a CPU stream inside
``foreach_all_gather`` (``AttributeError: 'Stream' object has no attribute 'record_event'``);
plain ``fully_shard`` + backward raises the same, with no distscaler anywhere.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

__all__ = ["CRASH", "run_case", "skip_if_torch_gap", "torch_gaps"]

#: The key of a case's result that holds its traceback when it crashed.
CRASH = "__crash__"


def _fully_shard_backward(world_size: int) -> None:
    # torch's FSDP2 recipe, nothing of ours: shard a Linear over every rank, forward, backward.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()


#: Torch recipes the layouts rely on, by name.
RECIPES: dict[str, Callable[[int], None]] = {"fully_shard + backward": _fully_shard_backward}


def torch_gaps(world_size: int) -> dict[str, str]:
    """Run each torch recipe on this rank (every rank must call); name -> its error, for those
    that raise (``"ExceptionType: message"``). Empty where torch does it all."""
    gaps: dict[str, str] = {}
    for name, recipe in RECIPES.items():
        try:
            recipe(world_size)
        except Exception as exc:
            gaps[name] = f"{type(exc).__name__}: {exc}"
    return gaps


def run_case(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``case()``'s results, or ``{CRASH: traceback}`` when it raised."""
    try:
        return case()
    except Exception:
        return {CRASH: traceback.format_exc()}


def skip_if_torch_gap(result: dict[str, Any], gaps: dict[str, str]) -> None:
    """Skip when ``result`` crashed with the error a torch recipe raised on its own (naming the
    torch version and the recipe); fail with the traceback on any other crash."""
    crash = result.get(CRASH)
    if crash is None:
        return
    for name, error in gaps.items():
        if error in crash:
            pytest.skip(
                f"torch {torch.__version__} itself fails here: its own {name} (no distscaler) "
                f"raises {error}"
            )
    pytest.fail(f"crashed:\n{crash}")
