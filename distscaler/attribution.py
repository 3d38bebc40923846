"""Overflow attribution: which ranks and which parameters held inf or NaN at the last skipped step.

Every inf check reads every gradient once and, on the way, takes one statistic per gradient tensor:
a norm when clipping; each gradient's largest magnitude in the fused check without clipping on a
GPU (which reads that instead of running torch's check-and-unscale kernel, whose one flag names
nothing). A non-finite statistic says the tensor held inf or NaN, so naming the culprits costs the
clean steps a few small device ops:

1. **Per-tensor flags** ([`flag_tensors()`][distscaler.attribution.flag_tensors], one ``nan_to_num``
   per step): each gradient's statistic when finite, [`NAN_CODE`][distscaler.attribution.NAN_CODE]
   when it holds a NaN, [`INF_CODE`][distscaler.attribution.INF_CODE] when it holds an inf or -inf
   (and no NaN). The flags are finite, so that a ``lerp`` can keep them.
2. **The overflow flags** ([`OverflowTracker.record_()`][distscaler.attribution.OverflowTracker.record_], in
   ``update()``, in the skip counters' ``_foreach_lerp_`` where the inf check gave ``found_inf``
   in one element per flag (a fused step's check on a GPU: at world size 1 without clipping, at any
   with it), else one ``lerp_`` per optimizer beside it: a vector weighed by a 0-dim tensor would
   send torch's CUDA foreach kernel down its per-tensor path): a device tensor per optimizer that
   takes the iteration's flags when the agreed ``found_inf`` is exactly 1.0 and keeps its own when
   it is 0.0. It always holds this rank's flags of the most recent skipped step, stays on the
   device and advances under CUDA graph replay.
3. **The report** ([`OverflowTracker.report()`][distscaler.attribution.OverflowTracker.report], with
   the periodic skip report, every ``skip_log_interval`` updates on every rank at the same update):
   when a step was skipped since the last report, each rank reads its overflow flags (one host read), names
   its offending tensors and the ranks exchange them in one all_gather (``all_gather_single``) of
   `PAYLOAD_BYTES` per rank; nothing when no step was skipped. The result,
   [`OverflowReport`][distscaler.attribution.OverflowReport], is the same on every rank and is
   logged on rank 0 (logger ``"distscaler"``, WARNING).

On the CPU, where a host read costs no sync, a fused step reads the agreed flag and flags its
gradients only when it is 1.0: clean steps there pay nothing
for the report but that read; without clipping the check stays torch's kernel and a skipped step
takes one more read pass for the flags.

Paths whose inf check takes no per-tensor statistic: a non-fused optimizer without clipping reads
the agreed flag on the host anyway and flags its gradients (one more read pass) only when it is 1.0;
a fused optimizer stepped after an explicit ``unscale_()`` flags them at every step (one more read
pass; [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] avoids it).

Parameter names come from [`GradScaler.register_model()`][distscaler.GradScaler.register_model] (the
module's ``named_parameters()`` without the wrappers' own attributes: DDP's ``module``, FSDP1's
``_fsdp_wrapped_module``, activation checkpointing's ``_checkpoint_wrapped_module``,
``torch.compile``'s ``_orig_mod``); FSDP1 flat parameters without ``use_orig_params`` keep the flat
parameter's name. Any other parameter is named ``param_groups[g][i]`` after its place in the
optimizer.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ._param_table import ParamTable

__all__ = [
    "INF_CODE",
    "StepFlags",
    "NAN_CODE",
    "OverflowEntry",
    "OverflowReport",
    "OverflowTracker",
    "TensorFlags",
    "flag_tensors",
]

logger = logging.getLogger("distscaler")

#: The per-tensor flag of a gradient tensor holding a NaN.
NAN_CODE = -1.0
#: The per-tensor flag of a gradient tensor holding an inf or -inf and no NaN.
INF_CODE = -2.0
#: Offending tensors each rank names in a report (the rest are counted).
LISTED_PER_RANK = 8
#: Bytes of a parameter name in the exchange (longer names are cut, ending in "...").
NAME_BYTES = 200
#: Bytes each rank contributes to a report's one all_gather.
PAYLOAD_BYTES = 4 + LISTED_PER_RANK * (1 + NAME_BYTES)
#: Entries the log line names (the rest are counted).
LOGGED_ENTRIES = 4

_WRAPPER_ATTRIBUTES = frozenset(
    {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_dp_wrapped_module"}
)
_KINDS = {1: "inf", 2: "nan"}


@dataclass(frozen=True, slots=True, order=True)
class OverflowEntry:
    """One gradient tensor that held inf or NaN.

    Attributes:
        rank: the rank (in the scaler's process group) that held it.
        param: the parameter's name (see the module docstring).
        kind: ``"nan"`` if the tensor held a NaN, else ``"inf"`` (also for -inf).
    """

    rank: int
    param: str
    kind: Literal["inf", "nan"]


@dataclass(frozen=True, slots=True)
class OverflowReport:
    """Where the inf/NaN of one skipped step were, identical on every rank.

    Attributes:
        step: the 1-based number of the ``update()`` call of the skipped iteration.
        scale: the loss scale that iteration used.
        entries: the offending tensors, sorted by rank, then parameter name (at most
            `LISTED_PER_RANK` per rank; empty when the overflow came from a finite sum too large for
            float32, or before the overflow flags existed).
        unlisted: offending tensors beyond `LISTED_PER_RANK` on some rank, counted only.
    """

    step: int
    scale: float
    entries: tuple[OverflowEntry, ...]
    unlisted: int = 0

    def describe(self, limit: int = LOGGED_ENTRIES) -> str:
        """``step 130 (loss scale 65536): inf in `fc.weight` on rank 5, nan in ...`` with at most
        ``limit`` entries named and the rest counted."""
        parts = [f"{e.kind} in `{e.param}` on rank {e.rank}" for e in self.entries[:limit]]
        rest = len(self.entries) - len(parts) + self.unlisted
        if rest:
            parts.append(f"and {rest} more")
        what = (
            ", ".join(parts) if parts else "no gradient tensor held inf/NaN (the norm overflowed)"
        )
        return f"step {self.step} (loss scale {self.scale:g}): {what}"


class TensorFlags(NamedTuple):
    """One optimizer's per-tensor flags of one iteration on this rank."""

    #: The parameters of the flagged gradients, in the order of ``flags``.
    params: tuple[torch.Tensor, ...]
    #: float32 ``(len(params),)`` on the scale's device (see
    #: [`flag_tensors()`][distscaler.attribution.flag_tensors]); None for a clean step whose flag
    #: was read on the host (nothing to record: the overflow flags are kept as they are).
    flags: torch.Tensor | None
    #: The inf check's own ``found_inf`` in every element of ``flags``' shape, where it made it so:
    #: the weight of the overflow flags' lerp that keeps it in the skip counters'
    #: ``_foreach_lerp_`` (see `OverflowTracker.record_()`); None: the 0-dim ``found_inf``.
    weights: torch.Tensor | None = None


class StepFlags(NamedTuple):
    """One stepped optimizer's per-tensor flags of this iteration, as
    [`OverflowTracker.record_()`][distscaler.attribution.OverflowTracker.record_] takes them."""

    optimizer: torch.optim.Optimizer
    #: None: not flagged (a non-fused optimizer's clean step is not; its overflow flags are left as they were).
    flags: TensorFlags | None
    #: Taken after the host read the flag (then only on a skip).
    after_read: bool


def flag_tensors(per_tensor: torch.Tensor) -> torch.Tensor:
    """Per-tensor flags of per-tensor statistics (norms: >= 0, inf or NaN): the finite statistic itself,
    [`NAN_CODE`][distscaler.attribution.NAN_CODE] for NaN,
    [`INF_CODE`][distscaler.attribution.INF_CODE] for inf. One ``nan_to_num``; same shape and
    dtype."""
    return torch.nan_to_num(per_tensor, nan=NAN_CODE, posinf=INF_CODE, neginf=INF_CODE)


class _KeptFlags:
    """One optimizer's overflow flags: the flags of the last skipped step, in the order of ``params``."""

    __slots__ = ("clean", "flags", "host_step", "params", "positions", "scatter")

    def __init__(self, params: tuple[torch.Tensor, ...], device: torch.device) -> None:
        self.params = params
        self.flags = torch.zeros(len(params), dtype=torch.float32, device=device)
        self.positions = {id(p): i for i, p in enumerate(params)}
        self.scatter: dict[tuple[int, ...], torch.Tensor] = {}
        self.clean: torch.Tensor | None = None
        #: None: written on the device at every iteration; else the update it was written in.
        self.host_step: int | None = None

    def dense(self, flagged: TensorFlags) -> torch.Tensor | None:
        """``flagged`` in these flags' order (absent parameters: clean); None if it holds others."""
        assert flagged.flags is not None
        # (dynamo traces no `is` between tuples: compiled, the elements are compared)
        if not torch.compiler.is_compiling() and flagged.params is self.params:
            return flagged.flags
        if len(flagged.params) == len(self.params) and all(
            a is b for a, b in zip(flagged.params, self.params)
        ):
            self.params = flagged.params  # the same parameters in a rebuilt plan: adopt its tuple
            return flagged.flags
        key = tuple(map(id, flagged.params))
        index = self.scatter.get(key)
        if index is None:
            if any(k not in self.positions for k in key):
                return None
            index = torch.tensor(
                [self.positions[k] for k in key], dtype=torch.long, device=self.flags.device
            )
            self.scatter[key] = index
        return torch.zeros_like(self.flags).index_copy_(0, index, flagged.flags)


class OverflowTracker:
    """The overflow flags of one scaler's optimizers, the parameter names, and the last report."""

    def __init__(self) -> None:
        self._names = ParamTable()
        self._kept: weakref.WeakKeyDictionary[torch.optim.Optimizer, _KeptFlags] = (
            weakref.WeakKeyDictionary()
        )
        #: The most recent report (see
        #: [`GradScaler.last_overflow`][distscaler.GradScaler.last_overflow]).
        self.last_overflow: OverflowReport | None = None
        self._attributed = 0  # the last step reported: the same on every rank

    def __getstate__(self) -> dict[str, Any]:
        # The flags and names refer to live tensors: a copy keeps the report only.
        return {"last_overflow": self.last_overflow, "attributed": self._attributed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.last_overflow, self._attributed = state["last_overflow"], state["attributed"]

    # ------------------------------------------------------------------ names

    def register_model(self, model: nn.Module) -> None:
        """Name ``model``'s parameters as the user knows them (see the module docstring)."""
        from torch.nn.parallel import DataParallel, DistributedDataParallel

        def walk(module: nn.Module, prefix: str) -> None:
            for name, param in module.named_parameters(recurse=False):
                if self._names.get(param) is None:
                    self._names.set(param, prefix + name, owner=model)
            for name, child in module.named_children():
                wrapper = name in _WRAPPER_ATTRIBUTES or (
                    name == "module" and isinstance(module, DistributedDataParallel | DataParallel)
                )
                walk(child, prefix if wrapper else f"{prefix}{name}.")

        walk(model, "")

    def _name(self, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> str:
        name = self._names.get(param)
        if name is not None:
            return name
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p is param:
                    return f"param_groups[{g}][{i}]"
        return "<a parameter not in the optimizer>"

    # ------------------------------------------------------------------ the overflow flags

    def record_(
        self,
        found_inf: torch.Tensor,
        flagged: list[StepFlags],
        step: int,
        lerps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        *,
        own_weights: bool = False,
    ) -> None:
        """Keep this iteration's flags where ``found_inf`` (0-dim float32, exactly 0.0 or 1.0,
        agreed) says the step was skipped: one ``lerp_`` per optimizer with flags, or, given
        ``lerps``, those lerps appended to it as ``(kept, flags, weight)`` for the caller to
        run (the scaler runs them in the skip counters' ``_foreach_lerp_``: no op here). The
        weight is ``found_inf``, or with ``own_weights`` the flags' own
        (`TensorFlags.weights`) where they have the overflow flags' shape: the same value in every
        element, with which torch's CUDA foreach keeps a vector among 0-dim tensors on its
        multi-tensor path (a 0-dim weight for a vector sends the whole list down its per-tensor
        path: one kernel per tensor).

        Args:
            flagged: the optimizers stepped in this iteration, their flags (None: not flagged, as a
                non-fused optimizer's clean step is not; its overflow flags are then left as they were) and
                whether they were taken after the host read the flag (then only on a skip).
            step: the number of this update.
            own_weights: the flags' weights hold ``found_inf`` itself (one stepped optimizer, whose
                inf check's flag is the agreed one).
        """
        lerps_due: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        present = set()
        kept_for = 0  # stepped optimizers that have overflow flags
        for optimizer, flags, after_read in flagged:
            present.add(id(optimizer))
            if flags is None:
                kept_for += optimizer in self._kept
                continue
            kept_for += 1
            kept = self._kept.get(optimizer)
            if flags.flags is None:  # clean, read on the host: the overflow flags exist, unchanged
                if kept is None:
                    self._kept[optimizer] = _KeptFlags(flags.params, found_inf.device)
                continue
            dense = None if kept is None else kept.dense(flags)
            if kept is None or dense is None:
                kept = _KeptFlags(flags.params, flags.flags.device)
                self._kept[optimizer] = kept
                dense = flags.flags
            weight = found_inf
            if own_weights and flags.weights is not None and flags.weights.shape == dense.shape:
                weight = flags.weights
            lerps_due.append((kept.flags, dense, weight))
            kept.host_step = step if after_read else None
        # The flags of optimizers not stepped in this iteration (none when every one's was).
        kept_all = list(self._kept.items()) if len(self._kept) > kept_for else []
        for optimizer, kept in kept_all:
            if id(optimizer) not in present and kept.host_step is None:
                # Not stepped in this iteration: if it was skipped, this optimizer held nothing.
                if kept.clean is None:
                    kept.clean = torch.zeros_like(kept.flags)
                lerps_due.append((kept.flags, kept.clean, found_inf))
        if lerps is not None:
            lerps += lerps_due
        else:
            for kept_flags, end, weight in lerps_due:
                kept_flags.lerp_(end, weight)

    # ------------------------------------------------------------------ the report

    def report(
        self,
        step: int,
        scale: float,
        *,
        group: dist.ProcessGroup | None,
        world_size: int,
        device: torch.device,
    ) -> OverflowReport | None:
        """Attribute skipped step ``step`` (the run's last, used loss scale ``scale``) unless it was
        already; every rank of ``group`` must call it at the same update (the periodic report).

        Cost when ``step`` is new: one host read of the overflow flags; at world size > 1 one all_gather
        (``all_gather_single``) of `PAYLOAD_BYTES` per rank over ``group`` and one host read of its
        result. Otherwise nothing. Returns the new report, or None.
        """
        if step <= self._attributed:
            return None
        self._attributed = step
        raw = _encode(self._local_entries(step))
        if world_size > 1:
            payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
            gathered = torch.empty(world_size * PAYLOAD_BYTES, dtype=torch.uint8, device=device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(gathered, payload, group=group)
            raw = bytes(gathered.cpu().untyped_storage())  # the report's second host read
        entries: list[OverflowEntry] = []
        unlisted = 0
        for rank in range(world_size):
            listed, total = _decode(raw[rank * PAYLOAD_BYTES : (rank + 1) * PAYLOAD_BYTES])
            entries += [OverflowEntry(rank, name, kind) for name, kind in listed]  # type: ignore[arg-type]
            unlisted += total - len(listed)
        report = OverflowReport(step, scale, tuple(sorted(entries)), unlisted)
        self.last_overflow = report
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            logger.warning("inf/NaN gradients at %s", report.describe())
        return report

    def _local_entries(self, step: int) -> tuple[list[tuple[str, str]], int]:
        """This rank's offending tensors at ``step``, sorted by name, and how many there were."""
        kept_all = [
            (optimizer, kept)
            for optimizer, kept in self._kept.items()
            if kept.host_step is None or kept.host_step == step
        ]
        if not kept_all:
            return [], 0
        values = torch.cat([r.flags for _, r in kept_all]).tolist()  # the report's one host read
        found: list[tuple[str, str]] = []
        start = 0
        for optimizer, kept in kept_all:
            for param, flag in zip(kept.params, values[start : start + len(kept.params)]):
                if flag == NAN_CODE or flag == INF_CODE:
                    found.append(
                        (self._name(param, optimizer), "nan" if flag == NAN_CODE else "inf")
                    )
            start += len(kept.params)
        found.sort()
        return found[:LISTED_PER_RANK], len(found)


def _encode(local: tuple[list[tuple[str, str]], int]) -> bytes:
    listed, total = local
    out = bytearray(total.to_bytes(4, "little"))
    for name, kind in listed:
        raw = name.encode()
        if len(raw) > NAME_BYTES:
            raw = raw[: NAME_BYTES - 3].decode(errors="ignore").encode() + b"..."
        out += bytes([1 if kind == "inf" else 2]) + raw.ljust(NAME_BYTES, b"\0")
    return bytes(out.ljust(PAYLOAD_BYTES, b"\0"))


def _decode(raw: bytes) -> tuple[list[tuple[str, str]], int]:
    total = int.from_bytes(raw[:4], "little")
    listed = []
    for i in range(LISTED_PER_RANK):
        slot = raw[4 + i * (1 + NAME_BYTES) : 4 + (i + 1) * (1 + NAME_BYTES)]
        if slot[0] in _KINDS:
            listed.append((slot[1:].rstrip(b"\0").decode(errors="replace"), _KINDS[slot[0]]))
    return listed, total
