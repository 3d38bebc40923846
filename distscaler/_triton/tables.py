"""The address tables the kernels read: the tensors cut into blocks, each tensor's and each
block's row in one int64 array on the device, built on the host and cached.

**The tables.** Tensor addresses (``data_ptr``), element counts, dtype kinds, weights (float32
bits) and each tensor's first block in one int64 array; per block its tensor, first element,
element count and whether it starts 16-byte aligned (int64). A block covers at most ``chunk``
elements of one tensor (``chunk`` a multiple of ``BLOCK * INNER``, larger for larger totals so that
the partials stay few: `chunk_for()`; a head block fewer: `distscaler._triton.kernels`'
Alignment). The tables are cached per (addresses, sizes, dtypes, weights, chunk): a step whose
gradients sit where they sat at the last step launches the two kernels and nothing else.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CONFIG",
    "DTYPE_KIND",
    "KEY_ROW_WORDS",
    "Tables",
    "build_tables",
    "chunk_for",
    "describe",
    "tables_for",
    "tables_of",
]

#: Elements per tile (``BLOCK``), tiles per int32 flush (``INNER``), warps per block of the read
#: and write kernels; ``RT`` partials per tile of the reduction; the number of blocks the reduction
#: aims at (``target_blocks``) and the most elements of a chunk (``max_chunk``: the bound of the
#: checksum's int64 block sums, `distscaler._triton.kernels`' docstring).
#: ``launch/kernel_bench.py`` sweeps ``BLOCK``, ``num_warps`` and ``target_blocks``; tests shrink
#: them, in place.
CONFIG: dict[str, int] = {"BLOCK": 2048, "INNER": 16, "num_warps": 8, "RT": 1024,
                          "target_blocks": 32768, "max_chunk": 1 << 22}  # fmt: skip

#: Words of a row of the replica check's keyed sums (``distscaler._replica.checksum.ROW_WORDS``;
#: `distscaler._triton.kernels`' Keyed sums; a test holds the two equal).
KEY_ROW_WORDS = 512

#: The tables' dtype kinds (the kernels' branches).
DTYPE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_SIZE = {0: 4, 1: 2, 2: 2}  # bytes per element


@dataclass(frozen=True)
class Tables:
    """One list of tensors' table, on their device and on the host (`build_tables()`)."""

    tab: torch.Tensor  # int64 (5n + 1 + 4 nb,): addr | numel | dtype kind | weight bits |
    #                    first block (n + 1) | the block rows
    blk: torch.Tensor  # a view of tab: per block its tensor | first element | element count |
    #                    aligned (1: its first element at a multiple of 16 bytes)
    num_blocks: int
    num_tensors: int
    chunk: int
    host: torch.Tensor  # the host copy (pinned where the copy is asynchronous)

    @property
    def aligned(self) -> torch.Tensor:
        """bool ``(num_blocks,)`` on the host: the block's first element sits at a multiple of 16
        bytes (the kernels' vector branches)."""
        nb = self.num_blocks
        return self.host[len(self.host) - nb :].bool()


_TABLE_CACHE: collections.OrderedDict[tuple, Tables] = collections.OrderedDict()
_TABLE_CACHE_SIZE = 16


def chunk_for(total: int, block: int, inner: int) -> int:
    """Elements per block: ``block * inner`` times a power of two, so that a total of ``total``
    elements makes about ``CONFIG["target_blocks"]`` blocks at most, and never more than
    ``CONFIG["max_chunk"]``."""
    span = block * inner
    outer = 1
    target, most = CONFIG["target_blocks"], CONFIG["max_chunk"]
    while span * outer * target < total and span * outer * 2 <= most:
        outer *= 2
    return span * outer


def build_tables(
    addrs: Sequence[int],
    numels: Sequence[int],
    kinds: Sequence[int],
    weights: Sequence[float] | None,
    chunk: int,
    device: torch.device,
    block_starts: Sequence[Sequence[int]] | None = None,
) -> Tables:
    """The int64 table on ``device`` (one copy). A tensor's blocks: where its address is not a
    multiple of 16 bytes, a *head* block of the elements before the first that is (fewer than 16
    bytes), then blocks of ``chunk`` elements from there (the last one shorter), each aligned
    where the address allows. ``block_starts`` (tests only) lists each tensor's block first
    elements instead (a block ends at the next one, or after ``chunk`` elements)."""
    n = len(addrs)
    numel_t = torch.tensor(list(numels), dtype=torch.int64)
    addr_t = torch.tensor(list(addrs), dtype=torch.int64)
    size_t = torch.tensor([_SIZE[c] for c in kinds], dtype=torch.int64)
    if block_starts is None:
        off = addr_t % 16
        head = torch.where((off != 0) & (off % size_t == 0), (16 - off) // size_t, 0)
        head = torch.minimum(head, numel_t)
        has_head = (head > 0).to(torch.int64)
        nblk = has_head + (numel_t - head + (chunk - 1)) // chunk
        first = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(nblk, 0, out=first[1:])
        num_blocks = int(first[-1])
        blk_t = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), nblk)
        k = torch.arange(num_blocks, dtype=torch.int64) - first[blk_t]  # the block's place
        in_head = (has_head[blk_t] == 1) & (k == 0)
        blk_s = torch.where(in_head, 0, head[blk_t] + (k - has_head[blk_t]) * chunk)
        blk_n = torch.where(in_head, head[blk_t],
                            torch.minimum(numel_t[blk_t] - blk_s, torch.tensor(chunk)))  # fmt: skip
    else:
        nblk = torch.tensor([len(s) for s in block_starts], dtype=torch.int64)
        first = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(nblk, 0, out=first[1:])
        num_blocks = int(first[-1])
        blk_t = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), nblk)
        blk_s = torch.tensor([s for starts in block_starts for s in starts], dtype=torch.int64)
        ends = [e for starts, m in zip(block_starts, numels) for e in [*starts[1:], m]]
        blk_n = torch.minimum(torch.tensor(ends, dtype=torch.int64) - blk_s, torch.tensor(chunk))
    blk_a = ((addr_t[blk_t] + blk_s * size_t[blk_t]) % 16 == 0).to(torch.int64)
    w = (
        torch.ones(n, dtype=torch.float32)
        if weights is None
        else torch.tensor(list(weights), dtype=torch.float32)
    )
    host = torch.cat([
        addr_t,
        numel_t,
        torch.tensor(list(kinds), dtype=torch.int64),
        w.view(torch.int32).to(torch.int64),
        first,
        blk_t,
        blk_s,
        blk_n,
        blk_a,
    ])  # fmt: skip
    if device.type == "cuda":
        host = host.pin_memory()
        tab = host.to(device, non_blocking=True)
    else:
        tab = host
    return Tables(tab, tab[5 * n + 1 :], num_blocks, n, chunk, host)


def tables_for(tensors: Sequence[torch.Tensor], weights: Sequence[float] | None) -> Tables:
    """The cached tables of ``tensors`` (contiguous, of `DTYPE_KIND`'s dtypes, one device)."""
    return tables_of(tensors, tuple(map(_DTYPE, tensors)), weights)


#: Unbound accessors: ``map()`` over them walks a list in C (a per-call cost of the host's).
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")


def describe(tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.dtype, ...], bool]:
    """The tensors' dtypes and whether every one is contiguous, gathered in C."""
    return tuple(map(_DTYPE, tensors)), all(map(_IS_CONTIGUOUS, tensors))


def tables_of(
    tensors: Sequence[torch.Tensor],
    dtypes: tuple[torch.dtype, ...],
    weights: Sequence[float] | None,
) -> Tables:
    block, inner = CONFIG["BLOCK"], CONFIG["INNER"]
    numels = tuple(map(_NUMEL, tensors))
    chunk = chunk_for(sum(numels), block, inner)
    addrs = tuple(map(_DATA_PTR, tensors))
    device = tensors[0].device
    key = (device, chunk, addrs, numels, dtypes, None if weights is None else tuple(weights))
    cached = _TABLE_CACHE.get(key)
    if cached is not None:
        _TABLE_CACHE.move_to_end(key)
        return cached
    kinds = [DTYPE_KIND[d] for d in dtypes]
    tables = build_tables(addrs, numels, kinds, weights, chunk, device)
    _TABLE_CACHE[key] = tables
    while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return tables
