"""The torchft check's comparison across replica groups: what a group's row holds, how rows compare.

Each participating group writes one row into the exchange: ``[role, gradients' checksum, the
checksum of each of ``STATE_PARTS``]``, each checksum plus 1 (0: absent). The heal check compares
the state of groups that healed (role ``REJOINED``) against the majority of the others
(``REFERENCE``); the gradient check names the groups outside the majority. Everything here runs
on the host, on rows already read back; no collective.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from ._torchft_reports import STATE_PARTS, ReplicaDivergence

__all__ = ["REFERENCE", "REJOINED", "compare", "divergence", "row_width", "state_parts"]

#: Row roles: a group that did not heal since its last verified step, a group that healed.
REFERENCE, REJOINED = 1, 2


def row_width(numel: int) -> int:
    """Floats in one row, for checksums of ``numel`` floats each."""
    return 1 + (1 + len(STATE_PARTS)) * numel


def state_parts(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> list[list[torch.Tensor]]:
    """``STATE_PARTS``' tensors: the parameters (their local shards); the optimizer's state tensors
    and numbers (steps) and its param groups' settings (lr, betas...) in a fixed order; the scale
    and growth tracker of the scaler's ``state_dict`` ``saved``."""
    params: list[torch.Tensor] = []
    optim: list[torch.Tensor] = []
    numbers: list[float] = []
    for group in optimizer.param_groups:
        for key in sorted(k for k in group if k != "params"):
            _collect(group[key], optim, numbers)
        for p in group["params"]:
            params.append(getattr(p, "_local_tensor", p).detach())
            state = optimizer.state.get(p, {})
            for key in sorted(state, key=str):
                _collect(state[key], optim, numbers)
    if numbers:
        optim.append(torch.tensor(numbers, dtype=torch.float64))
    scaler = [torch.tensor([float(saved[k])], dtype=torch.float64)
              for k in ("scale", "_growth_tracker") if k in saved]  # fmt: skip
    return [params, optim, scaler]


def compare(
    host: list[float], n: int, numel: int, me: int | None, grads_checked: bool, state_checked: bool
) -> tuple[list[float], set[int] | None]:
    """This rank's finding from the ``n`` participants' rows ``host`` (checksums of ``numel``
    floats), and the replica ranks that healed (None without a heal check). The finding has
    ``2 n + 4`` values, merged over the group's ranks with a MAX: the groups the heal check names
    (0/1 each), those the gradient check names, the state's parts that differ, whether the named
    groups report. ``me``: this group's replica rank."""
    width = row_width(numel)
    rows = [host[i * width : (i + 1) * width] for i in range(n)]
    finding = [0.0] * (2 * n + len(STATE_PARTS) + 1)
    rejoined = None
    if state_checked:
        state = {i: (int(r[0]), tuple(r[1 + numel :])) for i, r in enumerate(rows)
                 if r[0] and r[1 + numel]}  # fmt: skip
        refs = {i: s for i, (role, s) in state.items() if role == REFERENCE}
        rejoined = {i for i, (role, _) in state.items() if role == REJOINED}
        reference = _majority(refs)
        named = {i for i in rejoined if state[i][1] != reference}
        reported = bool(named)  # a rejoined group heals again
        if not named and refs and reference is None:  # no rejoiner: references disagree
            named, reported = set(refs), False  # no majority to heal from: reported only
        elif not named:
            named = {i for i, s in refs.items() if s != reference}
            reported = bool(named)  # a minority of three or more heals from the majority
        if named:
            mine = state[me if me in named else min(named)][1]
            against = reference if reference is not None else next(
                (state[i][1] for i in state if i not in named), None
            )
            for k in range(len(STATE_PARTS)):
                part = slice(numel * k, numel * (k + 1))
                finding[2 * n + k] = float(against is None or mine[part] != against[part])
            for i in named:
                finding[i] = 1.0
            finding[-1] = float(reported)
    grads = {i: tuple(r[1 : 1 + numel]) for i, r in enumerate(rows) if grads_checked and r[1] > 0}
    for i in _outliers(grads):
        finding[n + i] = 1.0
    return finding, rejoined


def divergence(finding: list[float], step: int, n: int, me: int | None) -> ReplicaDivergence | None:
    """What the group's merged ``finding`` (`compare()`) names at manager step ``step``, the heal
    check's finding first, else None. ``me``: this group's replica rank."""
    state_named = tuple(i for i in range(n) if finding[i] > 0)
    grad_named = tuple(i for i in range(n) if finding[n + i] > 0)
    if state_named:
        parts = tuple(p for k, p in enumerate(STATE_PARTS) if finding[2 * n + k] > 0)
        return ReplicaDivergence(step, "healed state", state_named, me in state_named, parts, n,
                                 finding[-1] > 0)  # fmt: skip
    if grad_named:
        return ReplicaDivergence(step, "gradients", grad_named, me in grad_named, (), n,
                                 reported=True)  # fmt: skip
    return None


def _collect(value: Any, tensors: list[torch.Tensor], numbers: list[float]) -> None:
    # An optimizer setting or state entry: tensors (float64 where not floating point), numbers
    # (bools, ints, floats, and tuples of them: betas); anything else is not compared.
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(-1)
        tensors.append(t if t.is_floating_point() else t.to(torch.float64))
    elif isinstance(value, bool | int | float):
        numbers.append(float(value))
    elif isinstance(value, tuple | list):
        for v in value:
            _collect(v, tensors, numbers)


def _majority(checksums: dict[int, tuple[float, ...]]) -> tuple[float, ...] | None:
    # The value more than half of them hold, else None.
    if not checksums:
        return None
    value, count = collections.Counter(checksums.values()).most_common(1)[0]
    return value if count * 2 > len(checksums) else None


def _outliers(checksums: dict[int, tuple[float, ...]]) -> set[int]:
    # Those that differ from the majority; with no majority, all of them; none when all agree.
    if len(set(checksums.values())) <= 1:
        return set()
    majority = _majority(checksums)
    return {i for i, fp in checksums.items() if fp != majority}
