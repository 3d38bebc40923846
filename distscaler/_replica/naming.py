"""Naming the ranks of a replica mismatch: each rank's checksum per replica set, exchanged at a
mismatch only, and each set's outliers against its majority."""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist

from ..replica_check import ReplicaSet

__all__ = ["name_ranks"]


def name_ranks(
    fingerprints: tuple[torch.Tensor, list[ReplicaSet | None]],
    primes: tuple[int, int],
    group: dist.ProcessGroup | None,
    nonfinite: bool = False,
) -> tuple[tuple[int, ...], tuple, tuple[int, ...]]:
    """Exchange per-set fingerprints and whether this rank's tensors hold inf/NaN (one
    ``all_gather_object``); name each set's outliers and the ranks that held inf/NaN."""
    rows_t, sets = fingerprints
    rows = rows_t.cpu().tolist()
    mods = (primes[0], primes[1], primes[0], primes[1])
    mine: dict[tuple[int, ...], list[int]] = {}
    for row, rs in zip(rows, sets):
        if rs is None:
            continue
        acc = mine.setdefault(rs.ranks, [0, 0, 0, 0])
        for i in range(4):
            acc[i] += row[i]
    me = dist.get_rank() if dist.is_initialized() else 0
    local = {key: tuple(v % m for v, m in zip(acc, mods)) for key, acc in mine.items()}
    gathered: list[Any] = [None] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, (me, local, nonfinite), group=group)
    else:
        gathered = [(me, local, nonfinite)]
    by_set: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = {}
    for rank, per_set, _ in gathered:
        for key, fp in per_set.items():
            by_set.setdefault(key, {})[rank] = fp
    named: set[int] = set()
    bad_sets = []
    for members, fps in sorted(by_set.items()):
        counts = collections.Counter(fps.values())
        if len(counts) <= 1:
            continue
        value, n = counts.most_common(1)[0]
        majority = value if n * 2 > len(fps) else None
        named |= {r for r, fp in fps.items() if fp != majority}
        bad_sets.append((members, tuple(fps.get(r, (-1, -1, -1, -1)) for r in members)))
    if not named:  # the sets agree as wholes: the difference lies across sets
        named = {r for r, _, _ in gathered}
    held = tuple(sorted(r for r, _, bad in gathered if bad))
    return tuple(sorted(named)), tuple(bad_sets), held
