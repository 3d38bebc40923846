"""The per-rank check and the one collective that turns it into a verdict every rank shares.

:class:`VerdictGroup` holds the ranks that must agree (the process group, resolved once) and how
this rank's gradients are gathered (the layouts and a per-optimizer plan). Each of its verdicts is
one pass over the local gradients with torch's multi-tensor kernels, at most one ``all_reduce`` of
two float32 over the group (one for the fused check), and an epilogue of a few small ops on the
device. No host read, but on the CPU, where one costs no sync (below).

Each verdict also leaves this rank's *tensor codes* (one float32 per gradient tensor, negative
exactly when it held inf/NaN; :mod:`distscaler.attribution`), taken from the statistic it reads
anyway, for the overflow report. The per-rank kernels themselves (norms, torch's check kernel,
the division, the p-norm verdict) are in :mod:`distscaler.grad_kernels`.

**On the CPU a fused step reads its flag** (:mod:`~distscaler.host_read`): a CPU's kernels have run
when they return, so the read costs no sync; the check then stays torch's kernel and the gradients
are coded only on a skipped step. On CUDA (and while ``make_fx`` or ``torch.compile`` trace a CPU
step) the verdict reads nothing: a fused step there never syncs.

Device ops per verdict (world size 1, one (device, dtype) group; world size > 1 adds the one
``all_reduce``, and with clipping one ``sqrt``). Each ends in one ``_foreach_addcdiv`` (in place,
into the stacked buffer, in a GPU's clip) that also makes the update's lanes (the skip record's
next counts, a packed policy's operands: :meth:`DeviceState.epilogue
<distscaler.state.DeviceState.epilogue>`):

============================  ==================================================================
:meth:`~VerdictGroup.check`   CPU: the ``_foreach_addcdiv`` (the flag's fresh zero), torch's
                              check kernel with a factor of 1.0 (values unchanged), the flag's
                              host read: 3 (+ ``_foreach_norm``, ``stack``, ``nan_to_num`` on a
                              skip). GPU: ``_foreach_norm`` with p = inf (each gradient's
                              largest magnitude: read-only, inf/NaN exactly when the gradient
                              holds one), ``stack``, ``nan_to_num`` for the codes, ``amin``, the
                              ``_foreach_addcdiv`` (``-min``), ``clamp`` for a flag of exactly
                              0.0 or 1.0: 6. Without an overflow report (``skip_log_interval=0``,
                              any device): the CPU's without the read: 2.
:meth:`~VerdictGroup.clip`    ``_foreach_norm``, ``stack``, ``linalg_vector_norm``, then the
                              ``_foreach_addcdiv`` for the norm, the ``scale / max_norm``-scaled
                              norm and the overflow flag; CPU (fused): the flag's host read and
                              ``fmax`` for ``grad_scale`` (``nan_to_num`` for the codes instead on
                              a skip): 6. GPU: the ``stack`` also makes the slots of the global
                              norm (written by ``linalg_vector_norm``'s ``out=``) and of the
                              epilogue, one ``nan_to_num`` codes the per-tensor norms and the
                              global norm together, the ``_foreach_addcdiv_`` writes into the
                              slots, one ``clamp`` gives the exact flag and ``grad_scale``: 6,
                              with or without an overflow report (:meth:`~VerdictGroup.clip`).
============================  ==================================================================

The clip verdict's computation is :mod:`distscaler._clip`'s (its ``ClipVerdict`` is re-exported
here); the 2-norm takes no 1e-6 guard (see there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from . import host_read
from ._clip import ClipVerdict, clip_unscaled, clip_verdict
from ._torch_compat import amp_check_and_unscale_
from .attribution import TensorCodes
from .grad_kernels import (
    VERDICT_NUMEL,
    _codes,
    _inv_scale,
    check_and_unscale_,
    local_verdict,
)
from .layouts import GradGroups, LayoutResolver, collect_grads, plan_grads
from .state import DeviceState, Epilogue

__all__ = [
    "VERDICT_NUMEL",
    "CheckVerdict",
    "ClipVerdict",
    "VerdictGroup",
    "check_and_unscale_",
    "local_verdict",
]


@dataclass(frozen=True, slots=True)
class CheckVerdict:
    """What :meth:`VerdictGroup.check` agreed on.

    Attributes:
        found_inf: 0-dim float32, exactly 1.0 if any rank saw inf/NaN, else 0.0.
        ends: the skip record's next counts (see ``DeviceState.record_``), None without gradients.
        codes: this rank's tensor codes (:mod:`distscaler.attribution`), None without gradients.
    """

    found_inf: torch.Tensor
    ends: Epilogue | None
    codes: TensorCodes | None
    #: The flag was read on the host and the gradients coded only on a skip.
    after_read: bool = False
    #: Whether ``codes`` were taken (False: left for later, as for a clean non-fused step).
    coded: bool = True
    #: The flag as read on the host (a step that is not fused), else None.
    skipped: bool | None = None


class VerdictGroup:
    """The ranks that must agree on every verdict, and how this rank's gradients are gathered.

    Args:
        process_group: the group (None: WORLD once ``torch.distributed`` is initialized).
        layouts: replication weights of the gradients, for norms (see :mod:`distscaler.layouts`).
    """

    def __init__(self, process_group: dist.ProcessGroup | None, layouts: LayoutResolver) -> None:
        self.process_group = process_group
        self.layouts = layouts
        self._resolved: tuple[int | None, dist.ProcessGroup | None, int] | None = None
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        # A ProcessGroup cannot be pickled: the copy agrees over the default group.
        return {"layouts": self.layouts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["layouts"])  # type: ignore[misc]

    # ------------------------------------------------------------------ the group

    def resolve(self) -> tuple[dist.ProcessGroup | None, int]:
        """(process group, world size); the group is None for the default one, and (None, 1)
        while ``torch.distributed`` is not initialized.

        Looked up once and kept while the default group stays the same. No reference to the default
        group is kept: one kept past ``destroy_process_group()`` would be torn down at interpreter
        exit, which aborts gloo ("terminate called without an active exception").
        """
        if torch.compiler.is_compiling():
            # Traced: nothing cached (dynamo guards on what it reads) and no id() of the group,
            # which torch 2.6-2.11's dynamo cannot take and 2.12's fakes differently per pass.
            if not (dist.is_available() and dist.is_initialized()):
                return None, 1
            return self.process_group, dist.get_world_size(self.process_group)
        world = dist.GroupMember.WORLD if dist.is_available() else None
        key = None if world is None else id(world)
        resolved = self._resolved
        if resolved is not None and resolved[0] == key:
            return resolved[1], resolved[2]
        if world is None:
            group, world_size = None, 1
        else:
            group = self.process_group
            world_size = dist.get_world_size(group)
        self._resolved = (key, group, world_size)
        return group, world_size

    def grads(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        weighted: bool,
        allow_fp16: bool,
        coalesce_sparse: bool = False,
    ) -> tuple[GradGroups, tuple[torch.Tensor, ...]]:
        """This step's local gradients of ``optimizer``, grouped (with replication weights if
        ``weighted``), and their parameters in the same order. Grouping is planned once per
        optimizer and parameter set.

        Raises:
            ValueError: ``allow_fp16`` is False and a gradient is fp16 (torch's wording).
            UnknownLayoutError: ``weighted``, more than one rank, and some layout is unknown.
        """
        group, world_size = self.resolve()
        resolver = self.layouts if weighted else None
        planned = None
        for rebuild in (False, True):
            plan = plan_grads(
                optimizer,
                self._plans,
                resolver=resolver,
                world_size=world_size,
                group=group,
                rebuild=rebuild,
            )
            if plan is None:
                break
            planned = plan.grads()
            if planned is not None:
                break
        if plan is None or planned is None:  # sparse gradients: the per-gradient path
            params: list[torch.Tensor] = []
            groups = collect_grads(
                optimizer,
                allow_fp16=allow_fp16,
                coalesce_sparse=coalesce_sparse,
                resolver=resolver,
                world_size=world_size,
                group=group,
                params_out=params,
            )
            return groups, tuple(params)
        if not allow_fp16 and plan.has_fp16():
            raise ValueError("Attempting to unscale FP16 gradients.")
        return planned

    # ------------------------------------------------------------------ verdicts

    def check(
        self, optimizer: torch.optim.Optimizer, state: DeviceState, *, codes: bool = True
    ) -> CheckVerdict:
        """The agreed overflow flag and this rank's tensor codes, leaving the gradients as they are
        (a fused step).

        One read of every gradient byte: the largest magnitude of each gradient (``_foreach_norm``
        with p = inf, one launch per (device, dtype) group; inf or NaN exactly when the gradient
        holds one), ``stack``, the codes (``nan_to_num``), their minimum, one ``_foreach_addcdiv``
        for the flag and the skip record's next counts, ``clamp`` for a flag of exactly 1.0 or 0.0;
        then an ``all_reduce(MAX)`` of one float32 when the group has more than one rank.

        Without ``codes`` (no overflow report will read them), and on the CPU
        (:mod:`~distscaler.host_read`): torch's check kernel with a factor of exactly 1.0 instead (one
        launch per group; it writes back the values it read), then the ``all_reduce`` of 1
        float32; on the CPU with ``codes`` the flag is read and the gradients coded on a skip
        (:meth:`_check_kernel`).
        """
        groups, params = self.grads(optimizer, weighted=False, allow_fp16=True)
        return self._check_groups(groups, params, state, codes=codes)

    def _check_groups(
        self,
        groups: GradGroups,
        params: tuple[torch.Tensor, ...],
        state: DeviceState,
        *,
        codes: bool,
    ) -> CheckVerdict:
        # check() over gradients already gathered.
        on_host = codes and host_read.host_read_is_free(state.device)
        if (not codes or on_host) and all(key.device == state.device for key in groups):
            return self._check_kernel(groups, params, state, codes=codes)
        coded = _codes(groups, state.device)
        if coded is None:
            found = state.zero.clone()
            ends = None
        else:
            a, b, c = state.epilogue()
            # The smallest code is negative exactly when a gradient is inf/NaN: -min, clamped to
            # [0, 1], is the flag; the update's lanes (the record's next counts...) come in the
            # same op.
            neg_min, *lanes = torch._foreach_addcdiv(
                [state.zero, *a], [coded.amin(), *b], [state.minus_one, *c]
            )
            found = neg_min.clamp(0.0, 1.0)
            ends = state.name_ends(lanes)
        group, world_size = self.resolve()
        if world_size > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return CheckVerdict(found, ends, None if coded is None else TensorCodes(params, coded))

    def for_step(
        self,
        optimizer: torch.optim.Optimizer,
        state: DeviceState,
        *,
        fused: bool,
        agreed: torch.Tensor | None,
        codes: bool,
        skip_nonfinite: bool,
    ) -> CheckVerdict:
        """The verdict ``GradScaler.step`` needs, whatever ran before it in this iteration.

        Args:
            fused: the optimizer takes ``grad_scale``/``found_inf`` (:mod:`distscaler.fused`).
            agreed: the flag an earlier ``unscale_()``/``clip_grad_norm_()`` agreed on, or None.
            codes: tensor codes are wanted (an overflow report will read them, and none were
                taken yet in this iteration).
            skip_nonfinite: False: a static scale steps through inf/NaN (the flag is 0.0).

        Without ``agreed``, a fused optimizer gets :meth:`check` (no host read on a GPU) and any
        other :meth:`unscale`. An optimizer that is not fused then has its flag read on the host
        (the step's one read: ``skipped``) and, with ``codes``, its gradients coded when skipped (one
        read pass); a fused one after an explicit ``unscale_()`` is coded at once (no read follows).
        """
        # The gradients once, for whichever pass runs (fp16 ones refused where they are unscaled).
        gathered = None
        if agreed is None or codes:
            gathered = self.grads(optimizer, weighted=False, allow_fp16=fused or agreed is not None)
        if fused:
            if agreed is None:
                assert gathered is not None
                verdict = self._check_groups(*gathered, state, codes=codes)
                if not skip_nonfinite:  # a static scale told to step through inf/NaN
                    verdict = replace(verdict, found_inf=state.zero)
                return verdict
            taken = self._coded_now(*gathered, state.device) if gathered is not None else None
            return CheckVerdict(agreed, None, taken, coded=codes)
        found = agreed
        if found is None:
            assert gathered is not None
            found = self._unscale_groups(gathered[0], state)
            if not skip_nonfinite:
                found = state.zero
        skipped = bool(found.item())  # the step's one host read: the agreed flag
        coding = codes and skipped
        taken = None
        if coding:
            assert gathered is not None
            taken = self._coded_now(*gathered, state.device)
        return CheckVerdict(found, None, taken, after_read=True, coded=coding, skipped=skipped)

    def _check_kernel(
        self,
        groups: GradGroups,
        params: tuple[torch.Tensor, ...],
        state: DeviceState,
        *,
        codes: bool,
    ) -> CheckVerdict:
        """:meth:`check` with torch's check kernel (a factor of exactly 1.0: values unchanged),
        where no report reads codes, or where a host read of the flag is free (the CPU): there the
        gradients are coded only when the flag says skip, after reading it (one more read pass).

        Ops: one ``_foreach_addcdiv`` (the flag's fresh zero and the update's lanes), the kernel
        (one launch per group), the ``all_reduce(MAX)`` of one float32 at world size > 1; with
        ``codes`` one host read, and on a skip ``_foreach_norm``, ``stack``, ``nan_to_num``.
        """
        a, b, c = state.epilogue()
        zero, one = state.zero, state.one
        found, *lanes = torch._foreach_addcdiv([zero, *a], [zero, *b], [one, *c])
        ends = state.name_ends(lanes)
        for grads in groups.values():
            amp_check_and_unscale_(grads, found, one)
        group, world_size = self.resolve()
        if world_size > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        if not codes:
            return CheckVerdict(found, ends, None)
        coded = (
            _codes(groups, state.device) if found.item() else None
        )  # free: see host_read_is_free
        return CheckVerdict(found, ends, TensorCodes(params, coded), after_read=True)

    def unscale(self, optimizer: torch.optim.Optimizer, state: DeviceState) -> torch.Tensor:
        """Divide the gradients by the scale in place and agree on the overflow flag.

        ``_amp_foreach_non_finite_check_and_unscale_`` with torch's ``1 / scale`` (computed in
        float64, as torch does), so unscaled values are bit-identical to torch's. fp16 gradients are
        refused with torch's message, before anything changes.
        """
        groups, _ = self.grads(optimizer, weighted=False, allow_fp16=False)
        return self._unscale_groups(groups, state)

    def _unscale_groups(self, groups: GradGroups, state: DeviceState) -> torch.Tensor:
        return self._agree_flag(check_and_unscale_(groups, inv_scale=_inv_scale(state.scale)))

    def _coded_now(
        self, groups: GradGroups, params: tuple[torch.Tensor, ...], device: torch.device
    ) -> TensorCodes | None:
        codes = _codes(groups, device)
        return None if codes is None else TensorCodes(params, codes)

    def codes(self, optimizer: torch.optim.Optimizer, device: torch.device) -> TensorCodes | None:
        """This rank's tensor codes of ``optimizer``'s gradients as they are now (one read pass:
        ``_foreach_norm`` with p = inf, ``stack``, ``nan_to_num``). For the paths whose verdict
        takes no per-tensor statistic (:meth:`unscale`); None without gradients."""
        return self._coded_now(*self.grads(optimizer, weighted=False, allow_fp16=True), device)

    def _agree_flag(self, verdict: torch.Tensor) -> torch.Tensor:
        group, world_size = self.resolve()
        if world_size > 1:
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
        return verdict[0]

    def clip(
        self,
        optimizer: torch.optim.Optimizer,
        state: DeviceState,
        max_norm: float,
        norm_type: float,
        *,
        fused: bool,
        skip_nonfinite: bool,
        codes: bool = True,
    ) -> ClipVerdict:
        """Global norm of the unscaled gradients, overflow flag and ``grad_scale``, agreed
        (:func:`distscaler._clip.clip_verdict`, over the gradients weighted by their layout)."""
        groups, params = self.grads(
            optimizer, weighted=True, allow_fp16=fused, coalesce_sparse=True
        )
        group, world_size = self.resolve()
        return clip_verdict(
            groups,
            params,
            state,
            max_norm,
            norm_type,
            world_size=world_size,
            group=group,
            fused=fused,
            skip_nonfinite=skip_nonfinite,
            codes=codes,
        )

    def clip_unscaled(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float,
        device: torch.device | None,
        *,
        codes: bool = True,
    ) -> tuple[torch.Tensor, TensorCodes | None]:
        """Clip gradients that carry no loss scale (after ``unscale_``, or with a disabled scaler):
        :func:`distscaler._clip.clip_unscaled`."""
        groups, params = self.grads(optimizer, weighted=True, allow_fp16=True, coalesce_sparse=True)
        group, world_size = self.resolve()
        return clip_unscaled(
            groups,
            params,
            max_norm,
            norm_type,
            device,
            world_size=world_size,
            group=group,
            codes=codes,
        )
