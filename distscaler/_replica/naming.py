"""Naming the ranks of a replica mismatch: each rank's checksum per replica set, exchanged at a
mismatch only in a fixed-size int64 row (no pickling, so no numpy), and each set's outliers
against its majority."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from ..replica_check import ReplicaSet
from .checksum import moduli_tensor, set_key

__all__ = ["NAMED_SETS", "name_ranks"]

#: Replica sets a rank lists when ranks are named (`name_ranks()`): a fixed row per rank.
NAMED_SETS = 8
#: Per rank: its global rank, whether its tensors held inf/NaN, its number of replica sets.
_HEAD = 3
#: Per set: its size, this rank's position in it, its key (`set_key()`: two distinct sets of one
#: size share it with probability about ``2**-61``, and then they merge visibly, two ranks at one
#: position, and their ranks are all named), its six residues.
_PER_SET = 9


def name_ranks(
    checksums: tuple[torch.Tensor, list[ReplicaSet | None]],
    group: dist.ProcessGroup | None,
    nonfinite: bool = False,
) -> tuple[tuple[int, ...], tuple, tuple[int, ...]]:
    """Exchange per-set checksums and whether this rank's tensors hold inf/NaN; name each
    set's outliers and the ranks that held inf/NaN.

    One ``all_gather_into_tensor`` of a fixed row per rank, int64 on the checksums' device
    (no pickling, no numpy): ``[rank, nonfinite, number of sets]`` then, for up to `NAMED_SETS`
    sets, ``[size, position, key, A1, A2, B1, B2, H1, H2]`` (`rank_slots()`' naming rows summed
    per set; zeros after the last). The per-set sums are made on the device; one host read of the gathered rows."""
    rows_t, sets = checksums
    device = rows_t.device
    mine: dict[ReplicaSet, int] = {}
    owner = []
    for rs in sets:
        owner.append(-1 if rs is None else mine.setdefault(rs, len(mine)))
    listed = list(mine)[:NAMED_SETS]
    me = dist.get_rank() if dist.is_initialized() else 0
    head = [me, int(nonfinite), len(mine)]
    meta = [[len(rs.ranks), rs.position, set_key(rs.ranks)] for rs in listed]
    row = torch.zeros(_HEAD + NAMED_SETS * _PER_SET, dtype=torch.int64, device=device)
    static = torch.tensor(head + [v for m in meta for v in m], dtype=torch.int64)
    if listed:
        checked = [i for i, o in enumerate(owner) if 0 <= o < NAMED_SETS]
        index = torch.tensor([owner[i] for i in checked], dtype=torch.int64, device=device)
        sums = torch.zeros(len(listed), 6, dtype=torch.int64, device=device)
        sums.index_add_(0, index, rows_t[index.new_tensor(checked)])
        sums = sums.remainder(moduli_tensor(device, 6))  # (sets, 6)
        table = torch.cat([static[_HEAD:].reshape(-1, 3).to(device), sums], 1)
        row[_HEAD : _HEAD + table.numel()] = table.reshape(-1)
    row[:_HEAD] = static[:_HEAD].to(device)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        gathered = torch.empty(world * row.numel(), dtype=torch.int64, device=device)
        # torch >= 2.13 names it all_gather_single (the older name warns there)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, row, group=group)
    else:
        gathered = row
    table_all = gathered.reshape(world, -1).tolist()  # the exchange's one host read
    by_set: dict[tuple[int, int], dict[int, list[tuple[int, tuple[int, ...]]]]] = {}
    ranks_seen: list[int] = []
    held_list: list[int] = []
    for r in table_all:
        rank, bad, count = r[0], r[1], r[2]
        ranks_seen.append(rank)
        if bad:
            held_list.append(rank)
        for i in range(min(count, NAMED_SETS)):
            size, position, key, *fp = r[_HEAD + i * _PER_SET : _HEAD + (i + 1) * _PER_SET]
            by_set.setdefault((size, key), {}).setdefault(position, []).append((rank, tuple(fp)))
    named: set[int] = set()
    bad_sets = []
    for positions in by_set.values():
        entries = [e for p in sorted(positions) for e in positions[p]]
        members = tuple(rank for rank, _ in entries)
        fps = dict(entries)
        if any(len(e) > 1 for e in positions.values()):  # two sets under one key: name them all
            named |= set(members)
            bad_sets.append((members, tuple(fps[r] for r in members)))
            continue
        counts = collections.Counter(fps.values())
        if len(counts) <= 1:
            continue
        value, n = counts.most_common(1)[0]
        majority = value if n * 2 > len(fps) else None
        named |= {r for r, fp in fps.items() if fp != majority}
        bad_sets.append((members, tuple(fps[r] for r in members)))
    if not named:  # the sets agree as wholes: the difference lies across sets
        named = set(ranks_seen)
    bad_sets.sort()
    return tuple(sorted(named)), tuple(bad_sets), tuple(sorted(held_list))
