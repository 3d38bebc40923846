"""The end-of-run check of both jobs: every rank skipped the same steps and holds the same scale,
and ranks that hold the same parameters hold them bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RankView", "params_digests", "ranks_agree"]


@dataclass(frozen=True, slots=True)
class RankView:
    """What one rank reports at the end of a run (plain values: it is gathered by pickling)."""

    rank: int
    skipped_steps: tuple[int, ...]
    """Steps this rank skipped (``step_was_skipped``), in order."""
    scale: float
    """This rank's final loss scale."""
    params_digest: str
    """SHA-256 of the full parameters this rank holds (``common.tensors.params_digest``)."""
    replica: int = 0
    """Ranks with equal ``replica`` hold the same parameters (a pipeline stage index; 0 for
    every data-parallel layout, where all ranks hold the whole model)."""
    host: str = ""
    """The hostname this rank ran on (``socket.gethostname()``; empty where not recorded)."""


def ranks_agree(views: Sequence[RankView]) -> list[str]:
    """Every disagreement among ``views`` (one per rank), as messages; empty when they agree.

    Skipped steps and the scale must be equal on every rank; parameter digests within each
    replica group (the first rank of the group is the reference).
    """
    if not views:
        raise ValueError("views must hold one RankView per rank, got none")
    first = views[0]
    reference: dict[int, RankView] = {}
    problems = []
    for v in views:
        if v.skipped_steps != first.skipped_steps:
            problems.append(
                f"rank {v.rank} skipped steps {list(v.skipped_steps)}, rank {first.rank} "
                f"skipped {list(first.skipped_steps)}"
            )
        if v.scale != first.scale:
            problems.append(
                f"rank {v.rank} ends with scale {v.scale:g}, rank {first.rank} with {first.scale:g}"
            )
        ref = reference.setdefault(v.replica, v)
        if v.params_digest != ref.params_digest:
            problems.append(
                f"rank {v.rank} holds other parameters than rank {ref.rank} (replica {v.replica}): "
                f"digest {v.params_digest[:12]} vs {ref.params_digest[:12]}"
            )
    return problems


def params_digests(views: Sequence[RankView]) -> list[str]:
    """The parameter digest of each replica group, in the order of ``replica`` (one entry for
    every data-parallel layout, one per stage under pp); its first rank's, which ``ranks_agree``
    compares the others with."""
    first: dict[int, str] = {}
    for v in views:
        first.setdefault(v.replica, v.params_digest)
    return [first[replica] for replica in sorted(first)]
