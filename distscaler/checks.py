"""Checks that ride the step's one collective, and what each declares of its life.

The step's one collective carries the non-finite flag and the norm statistic. A *check* adds
slots to it: the replica check's checksum ([`distscaler.replica_check`][distscaler.replica_check]),
an FP8 amax agreed across ranks, anything an integration needs agreed at the step. Each check is one
object the scaler holds (the replica check from its settings; others through
[`GradScaler.add_check()`][distscaler.GradScaler.add_check]), and declares its whole life through
the two protocols and the record below: a `Check` for the run, a `Contribution` it declares for a
step (its slots and the two functions the pass calls), a `Reading` of the reduced slots. The
scaler, the plan and the pass call them in this order and name none of them:

| when | the call |
|---|---|
| ``unscale_``, ``clip_grad_norm_`` or ``step`` plans the step's pass | `Check.contribution()`: this step's `Contribution`, or None (not due) |
| the pass reads the gradients | the contribution's ``local``: this rank's slots, float32 |
| right after the collective, on every rank | the contribution's ``read``: a `Reading`, or None (nothing to act on) |
| the optimizer's step | `Reading.step_flag()`: what the step takes as ``found_inf`` |
| ``update()`` | `Reading.settle()`, then `Reading.close()`; then `Check.end_iteration()` |
| a host read of the scaler (``skip_totals``, ``state_dict``, ``metrics``...) | `Check.count()`: skips that readings found on the device |
| the periodic read (every rank, every ``skip_log_interval`` updates) | `Check.name()`: what those skips were; an error to raise |
| an overflow report, a collapse report, a loaded state, a new config | `Check.note_overflow()`, `Check.at_fault()`, `Check.nonfinite_seen()`, `Check.forget()`, `Check.configure()` |

**The rules the scaler applies to every settlement alike.** A `Settlement` with a ``cause``
skips the iteration for that cause without moving the loss scale, the growth tracker or the
policy's counters (the skip account counts it under ``cause``: `distscaler.SkipTotals.causes`);
only ``found_inf`` moves the scale. A settlement's ``held`` flag (0-dim float32 on the device,
exactly 0.0 or 1.0) holds the update on the device where it is 1.0, with no host read: the
scale and counters stay as they were, and the skip is counted by the check's `Check.count()`
at the next host read. A check never moves the scale itself.
**A check that agrees beyond the scaler's group** (torchft's other replica groups: the
`TorchftCheck` of [`distscaler.integrations.torchft`][distscaler.integrations.torchft]) declares two
more things: ``Check.every_step`` (True: the collective runs at every step, also at one rank of no
group, where nothing is reduced and the contributions are still read, over a world treated as one
whose membership changes, so the replica check, which never compares over such a group, is not due)
and ``Contribution.reads_agreed`` (True: the contribution's ``read`` gets the pass's reduced buffer
as ``agreed``, the non-finite flag and the norm statistic where the pass has one, which the reading
may change in place before the pass reads it: torchft's raises it to the groups' MAX, or
forces a skip). Every other check sets both to False.

How the slots combine (``Contribution.combine``): ``"sum"`` slots are summed over the group, in
float32, so a check that needs exact sums keeps every partial sum an integer below ``2**24``;
``"max"`` slots take the group's maximum. Every rank of the group must add the same checks, in
the same order, with the same ``numel`` at the same step (the collective's size relies on it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from .config import ScalerConfig

__all__ = ["Check", "Contribution", "KernelPart", "Reading", "Settlement"]


class Settlement(NamedTuple):
    """What a `Reading` settles at ``update()``.

    Attributes:
        cause: a skip cause known on the host (``"replica_mismatch"``...): the iteration is
            skipped for it and the scale does not move; None: no skip of its own cause.
        report: what the skip report gives for ``cause`` (`GradScaler.report_skip()`).
        held: a device flag (0-dim float32, 0.0 or 1.0) that holds the update where it is 1.0
            (the reading waits on the device); None: nothing held.
    """

    cause: str | None = None
    report: Any = None
    held: torch.Tensor | None = None


class Reading(Protocol):
    """What a contribution read from the reduced collective, kept with the optimizer's record
    until ``update()``; the same on every rank of the group (a function of the reduced slots)."""

    @property
    def host_skip(self) -> bool:
        """The optimizer's step is skipped, known on the host now (a step that is not fused skips
        on it; a fused step gets 1.0 from `step_flag()`)."""
        ...

    def step_flag(self, found_inf: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        """What the optimizer's step takes as ``found_inf`` (0-dim float32 on the scale's device):
        ``found_inf`` itself, ``one`` to skip, or a device maximum with a flag of the reading's
        own. Only the step takes it: ``update()`` takes the agreed ``found_inf``."""
        ...

    def settle(self, found_inf: Callable[[], bool]) -> Settlement:
        """How ``update()`` treats this reading. ``found_inf``: reads the agreed flag on the host
        (one sync on a GPU), for a reading whose cause depends on it; call it only where needed."""
        ...

    def close(self, number: int, found_inf: torch.Tensor, *, counted: bool) -> None:
        """``update()`` is done with the reading: ``number`` is the update's, 1-based,
        ``found_inf`` the agreed flag it ran on, ``counted`` whether it ran on this reading's
        ``held`` flag (False: a new scale was set, or another reading's cause skipped it)."""
        ...


class KernelPart(NamedTuple):
    """What the Triton pass computes for a contribution in its own read of the gradients.

    Attributes:
        primes: the moduli of the per-tensor word sums the kernel takes in its read (given to
            the contribution's ``local`` as ``moments``).
        terms: ``terms(params, grads)``: per-tensor terms (int64 ``(n, 8)`` on the device) from
            which the kernel's reduction sums the contribution's slots (given to
            the contribution's ``local`` as ``sums``); None where it takes no sums at this step.
        keys: ``keys(params, grads)``: the int32 table of keyed weights whose keyed sums the
            kernel adds to the moments and to ``sums`` (their last two); None (the field, or
            what it returns): no keyed sums.
    """

    primes: tuple[int, int]
    terms: Callable[[tuple[torch.Tensor, ...], Sequence[torch.Tensor]], torch.Tensor | None]
    keys: Callable[[tuple[torch.Tensor, ...], Sequence[torch.Tensor]], torch.Tensor | None] | None = (
        None
    )


class Contribution(NamedTuple):
    """One check's part of one step's collective, as `Check.contribution()` declares it: its
    slots, how they combine, and the two functions the pass calls (`local` before the collective,
    `read` right after it, on every rank).

    Attributes:
        numel: float32 slots it adds to the collective.
        local: ``local(params, grads, moments, sums)``: this rank's slots, float32 ``(numel,)``,
            from the gradients as the pass reads them (``grads`` in ``params``' order);
            ``moments``, ``sums``: what the Triton pass computed for it (``kernel_part``), else
            None.
        read: ``read(reduced, local_flag, agreed)``: what the reduced slots (float32
            ``(numel,)``, the same on every rank) say: a `Reading`, or None when there is nothing
            to act on. ``local_flag``: this rank's non-finite flag before the reduce, float32
            ``(1,)``, where ``keeps_local_flag``; ``agreed``: the pass's reduced buffer (the flag
            first), where ``reads_agreed``.
        combine: how its slots combine across ranks (module docstring).
        keeps_local_flag: ``read`` takes this rank's part of the buffer before the reduce (its
            non-finite flag first: one ``clone``).
        kernel_part: what the Triton pass computes for it in its read; None: ``local`` reads the
            gradients.
        reads_agreed: ``read`` gets the pass's reduced buffer as ``agreed`` (module docstring).
    """

    numel: int
    local: Callable[
        [tuple[torch.Tensor, ...], Sequence[torch.Tensor], torch.Tensor | None, torch.Tensor | None],
        torch.Tensor,
    ]
    read: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], Reading | None]
    combine: Literal["sum", "max"] = "sum"
    keeps_local_flag: bool = False
    kernel_part: KernelPart | None = None
    reads_agreed: bool = False


class Check(Protocol):
    """A check the scaler holds for the whole run; every method is called on every rank of the
    scaler's group at the same point (module docstring's table)."""

    #: The collective runs at every step, also at one rank (module docstring); False for a check
    #: among the scaler's own ranks.
    every_step: bool

    def contribution(
        self, plan: Any, layouts: Any, optimizer: torch.optim.Optimizer, device: torch.device
    ) -> Contribution | None:
        """This step's part of the collective for ``optimizer``, or None when the check is not
        due. ``plan``: what the step does, decided up front; a check reads ``plan.world`` (its
        ``group``, ``size``, and ``dynamic``: a group whose membership changes),
        ``plan.reading_free`` (a host read at this step costs no sync of its own) and
        ``plan.reading_may_wait`` (a reading may wait on the device until the scaler's next host
        read). ``layouts``: the scaler's layout resolver
        (``replica_set()`` of a parameter); ``device``: the scale's."""
        ...

    def end_iteration(self, cause: str | None, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """``update()`` (or an iteration skipped without one) ended the iteration; ``cause``: the
        skip cause a settlement gave, else None; ``optimizers``: those of the iteration."""
        ...

    def count(self) -> list[tuple[int, str]]:
        """At a host read of the scaler: the readings that waited on the device, read (no
        collective: may run on one rank). Returns ``(update, cause)`` for each that held its
        update (a skip of its own cause)."""
        ...

    def name(self) -> tuple[list[tuple[int, Any]], Exception | None]:
        """At the periodic read, on every rank together: ``(update, report)`` for each skip
        `count()` found, and an error to raise once the update is complete (or None)."""
        ...

    def note_overflow(self, step: int, ranks: set[int]) -> None:
        """An overflow report of update ``step`` named ``ranks`` as holding inf/NaN."""
        ...

    def at_fault(self) -> tuple[str, ...]:
        """What the check last named at fault, for a collapse report (``"rank 3 (...)"``)."""
        ...

    def nonfinite_seen(self) -> bool:
        """Whether the check saw non-finite parameters since the last call (a collapse)."""
        ...

    def forget(self) -> None:
        """A loaded state replaces the run: drop what waits to be counted or named."""
        ...

    def configure(self, config: ScalerConfig) -> None:
        """Take the settings of a new ``config`` (the counts stay)."""
        ...
