"""Gaps of torch itself on this machine, proved by running torch's own recipe without distscaler.

A spawned scenario calls :func:`torch_gaps` on every rank before its cases and records, per case,
the traceback it crashed with (:func:`run_case`); a test then calls :func:`skip_if_torch_gap`:
a crash whose error is the one torch's own recipe raised is skipped with that proof as the
reason, any other crash fails. One layout's crash does not take the others of its spawn with it.

A test that runs a job (torchrun, a subprocess) reads the job's output instead: :func:`gap_in`
runs torch's recipes once per test process, in a spawned gloo rank, only when a job failed, and
names the recipe whose error the output holds (:func:`skip_if_gap_in` skips with it).

Known: torch 2.6's FSDP2 on CPU calls ``record_event`` on a CPU stream inside
``foreach_all_gather`` (``AttributeError: 'Stream' object has no attribute 'record_event'``);
plain ``fully_shard`` + backward raises the same, with no distscaler anywhere.
"""

from __future__ import annotations

import functools
import tempfile
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = [
    "CRASH",
    "GAPS",
    "GapMap",
    "fullgraph_gaps",
    "gap_in",
    "guarded",
    "run_case",
    "skip_if_gap_in",
    "skip_if_torch_gap",
    "torch_gaps",
]

#: The key of a case's result that holds its traceback when it crashed.
CRASH = "__crash__"
#: The key of a rank's results that holds :func:`torch_gaps` (see :func:`guarded`).
GAPS = "torch_gaps"


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


def _fullgraph_id_of_a_list() -> None:
    # What a cached plan's key does: the identity and length of a parameter list, compared.
    params = [torch.ones(2)]
    key = (id(params), len(params))
    torch.compile(lambda ps: ps[0] * ((id(ps), len(ps)) == key), fullgraph=True)(params)


def _fullgraph_weak_key_lookup() -> None:
    # What a per-optimizer cache does: a WeakKeyDictionary looked up by the optimizer.
    owner = torch.nn.Linear(1, 1)
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary({owner: 2.0})
    torch.compile(lambda o, x: x * cache.get(o), fullgraph=True)(owner, torch.ones(1))


#: Python that dynamo must trace for ``fullgraph=True``, by name, nothing of ours in it.
FULLGRAPH_RECIPES: dict[str, Callable[[], None]] = {
    "fullgraph id() of a list": _fullgraph_id_of_a_list,
    "fullgraph WeakKeyDictionary lookup": _fullgraph_weak_key_lookup,
}


@functools.cache
def fullgraph_gaps() -> dict[str, str]:
    """Run each of :data:`FULLGRAPH_RECIPES` in this process (small compiles, once); name -> its
    error (``"ExceptionType: first line"``) for those torch's dynamo cannot trace here. Empty
    where it traces them all (torch 2.12.1 to 2.15.0, run)."""
    gaps: dict[str, str] = {}
    for name, recipe in FULLGRAPH_RECIPES.items():
        try:
            recipe()
        except Exception as exc:
            gaps[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return gaps


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
            pytest.skip(_reason(name, error))
    pytest.fail(f"crashed:\n{crash}")


class _Guarded(dict):
    """A rank's results whose crashed cases skip or fail when a test reads them."""

    def __init__(self, results: dict[str, Any], gaps: dict[str, str]) -> None:
        super().__init__(results)
        self.gaps = gaps

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if isinstance(value, dict):
            skip_if_torch_gap(value, self.gaps)
        return value


def guarded(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's results of a spawn whose scenario ran its cases through :func:`run_case` and
    put :func:`torch_gaps` under :data:`GAPS`: reading a crashed case (``results[rank][case]``)
    skips the test when torch's own recipe raised the same error, and fails it otherwise."""
    return [_Guarded({k: v for k, v in r.items() if k != GAPS}, r[GAPS]) for r in results]


class GapMap(dict):
    """What a test's jobs produced, by key; reading a key in ``gaps`` (key -> skip reason, from
    :func:`gap_in`) skips the test: torch itself could not run that job here."""

    def __init__(self, found: dict[Any, Any], gaps: dict[Any, str]) -> None:
        super().__init__(found)
        self.gaps = gaps

    def __getitem__(self, key: Any) -> Any:
        if key in self.gaps:
            pytest.skip(self.gaps[key])
        return super().__getitem__(key)


def _probe(rank: int, world_size: int) -> dict[str, str]:
    return torch_gaps(world_size)


@functools.cache
def _gaps_here() -> dict[str, str]:
    # torch's recipes in one spawned gloo rank (a process group of their own, not this process's).
    from _harness import spawn

    with tempfile.TemporaryDirectory() as tmp:
        return spawn(_probe, 1, Path(tmp))[0]


def _reason(name: str, error: str) -> str:
    version = torch.__version__
    return f"torch {version} itself fails here: its own {name} (no distscaler) raises {error}"


def gap_in(output: str) -> str | None:
    """The skip reason when ``output`` (a failed job's log) holds the error one of torch's own
    recipes raises here without distscaler, else None (the caller fails). The recipes run once
    per process, on the first call (a spawn of one gloo rank: a few seconds)."""
    for name, error in _gaps_here().items():
        if error in output:
            return _reason(name, error)
    return None


def skip_if_gap_in(output: str) -> None:
    """Skip when ``output`` holds the error of a torch recipe (:func:`gap_in`); return otherwise."""
    reason = gap_in(output)
    if reason is not None:
        pytest.skip(reason)
