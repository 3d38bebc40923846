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

The 2-norm takes no 1e-6 guard: torch's ``clip_grad_norm_`` computes ``max_norm / (norm + 1e-6)``
to avoid dividing by zero; here the coefficient ``min(1, max_norm / norm)`` is applied as
``grad_scale = max(scale, scaled_norm / max_norm)``, which never divides by the norm.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from . import host_read
from ._torch_compat import amp_check_and_unscale_
from .attribution import TensorCodes, tensor_codes
from .grad_kernels import (
    VERDICT_NUMEL,
    _codes,
    _div_groups_,
    _inv_scale,
    _local_verdict,
    _p_norm,
    _scaled_two_norm,
    _stacked_two_norm,
    all_reduce_verdict,
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
class ClipVerdict:
    """What :meth:`VerdictGroup.clip` agreed on, all 0-dim float32 on the scale's device.

    Attributes:
        norm: global norm of the unscaled gradients, identical on every rank (returned to the user).
        found_inf: exactly 1.0 if any rank saw inf/NaN (the norm is then non-finite), else 0.0.
        grad_scale: what a fused optimizer divides the gradients by: ``scale / clip_coef``.
        ends: the skip record's next counts, made in the epilogue (see ``DeviceState.record_``).
        codes: this rank's tensor codes (:mod:`distscaler.attribution`), None without gradients.
    """

    norm: torch.Tensor
    found_inf: torch.Tensor
    grad_scale: torch.Tensor
    ends: Epilogue | None
    codes: TensorCodes | None
    #: The flag was read on the host and the gradients coded only on a skip.
    after_read: bool = False


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
        """Global norm of the unscaled gradients, overflow flag and ``grad_scale``, agreed.

        One read of every gradient byte, at most one ``all_reduce`` of 2 float32, and (fused) the
        gradients are not rewritten: the optimizer divides them by ``grad_scale``. Non-fused
        optimizers get their gradients divided by ``grad_scale`` in place (one multi-tensor op).
        With ``codes``, one ``nan_to_num`` codes the per-tensor norms for the overflow report. A
        fused step on the CPU reads the flag instead (no sync there, :mod:`~distscaler.host_read`)
        and codes the norms only on a skip.
        """
        groups, params = self.grads(
            optimizer, weighted=True, allow_fp16=fused, coalesce_sparse=True
        )
        group, world_size = self.resolve()
        device = state.device
        scale = state.scale
        on_host = fused and skip_nonfinite and host_read.host_read_is_free(device)
        if norm_type == 2.0 and skip_nonfinite and not on_host:  # the flag stays on the device
            return self._clip_on_device(groups, params, state, max_norm, fused=fused, codes=codes)
        if norm_type == 2.0:
            total, per_tensor = _scaled_two_norm(groups, device, world_size, group, state.verdict)
            a, b, c = state.epilogue()
            zero = state.zero
            # norm = T / scale, Q = T / max_norm, F = T / inf (0, or NaN when T is inf/NaN), and
            # the update's lanes (the record's next counts...), in one multi-tensor op.
            norm, q, flag, *lanes = torch._foreach_addcdiv(
                [zero, zero, zero, *a],
                [total, total, total, *b],
                [scale, state.max_norm(max_norm), state.inf, *c],
            )
            ends: Epilogue | None = state.name_ends(lanes)
            if on_host:  # others read it anyway
                return _clip_on_host(
                    groups, params, per_tensor, state, (norm, q, flag), ends, fused, codes
                )
            found = state.zero  # a static scale told to step through inf/NaN
        else:
            local, per_tensor = _local_verdict(groups, _inv_scale(scale), norm_type)
            if world_size > 1:
                all_reduce_verdict(local, group, norm_type=norm_type)
            norm = _p_norm(local, norm_type)
            nonfinite = torch.logical_or(local[0] > 0, norm.isfinite().logical_not())
            found = nonfinite.to(torch.float32) if skip_nonfinite else state.zero
            q = norm * scale / max_norm
            ends = None
        grad_scale = torch.fmax(q, scale)  # scale / min(1, max_norm / norm)
        if not fused:
            _div_groups_(groups, grad_scale)
        return ClipVerdict(norm, found, grad_scale, ends, _coded(params, per_tensor, codes))

    def _clip_on_device(
        self,
        groups: GradGroups,
        params: tuple[torch.Tensor, ...],
        state: DeviceState,
        max_norm: float,
        *,
        fused: bool,
        codes: bool,
    ) -> ClipVerdict:
        """:meth:`clip` with the 2-norm where the verdict does not read the flag on the host (a
        fused step on a GPU; any step that is not fused), and inf/NaN skip the step: everything
        after the global norm in three device ops.

        The per-tensor norms are stacked into one buffer with the global norm's slot and the lanes
        the epilogue writes in place (:func:`~distscaler.grad_kernels._stacked_two_norm`):

        ``[per-tensor norms (num_grads) | T | -c, q | 0, scale | 1, inf | norm | epilogue]``

        where ``T`` is the global norm of the scaled gradients. Then one ``nan_to_num`` codes the
        per-tensor norms and ``T`` together (``c``: ``T`` when finite, else negative), one
        ``_foreach_addcdiv_`` writes ``-c``, ``q = c / max_norm``, ``norm = T / scale`` and the
        update's lanes into their slots, and one ``clamp`` of ``(-c, q)`` between ``(0, scale)``
        and ``(1, inf)`` gives the flag (exactly 0.0 when ``T`` is finite, 1.0 when it is not) and
        ``grad_scale = max(q, scale)``: the values ``fmax(T / max_norm, scale)`` gives, bit for bit
        (both ``scale`` on an overflow).
        """
        group, world_size = self.resolve()
        zero, one, scale = state.zero, state.one, state.scale
        a, b, c = state.epilogue()
        tail = [zero, zero, zero, scale, one, state.inf, zero, *a]
        total, per_tensor, buffer = _stacked_two_norm(
            groups, state.device, world_size, group, state.verdict, tail
        )
        assert buffer is not None
        num_grads = 0 if per_tensor is None else per_tensor.numel()
        coded = tensor_codes(buffer[: num_grads + 1])  # the codes, then T's
        lanes = buffer[num_grads + 1 :]  # the tail's slots: (-c, q | 0, scale | 1, inf | norm | a)
        coded_total = coded[num_grads]
        # -c = 0 - c / 1 (+0.0, never -0.0, when T is 0), q, norm and the update's lanes, in place.
        torch._foreach_addcdiv_(
            [lanes[0], lanes[1], *lanes[6:]],
            [coded_total, coded_total, total, *b],
            [state.minus_one, state.max_norm(max_norm), scale, *c],
        )
        found, grad_scale = torch.clamp(lanes[0:2], min=lanes[2:4], max=lanes[4:6]).unbind()
        if not fused:
            _div_groups_(groups, grad_scale)
        ends = state.name_ends(list(lanes[7:].unbind()))
        taken = None
        if codes and per_tensor is not None:
            taken = TensorCodes(params, coded[:num_grads])
        return ClipVerdict(lanes[6], found, grad_scale, ends, taken)

    def clip_unscaled(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float,
        device: torch.device | None,
        *,
        codes: bool = True,
    ) -> tuple[torch.Tensor, TensorCodes | None]:
        """Clip gradients that carry no loss scale (after ``unscale_``, or with a disabled scaler).

        Adds a collective unless every local gradient is replicated over the whole group (then the
        local norm is already the global one). Returns the global norm (0-dim float32) and, with
        ``codes``, this rank's tensor codes (None without gradients).
        """
        groups, params = self.grads(optimizer, weighted=True, allow_fp16=True, coalesce_sparse=True)
        group, world_size = self.resolve()
        replicated = bool(groups) and all(key.weight == 1.0 / world_size for key in groups)
        if device is None:
            device = next(iter(groups)).device if groups else torch.device("cpu")
        one = torch.ones((), dtype=torch.float32, device=device)
        local, per_tensor = _local_verdict(
            {key._replace(weight=1.0): grads for key, grads in groups.items()}
            if replicated
            else groups,
            one,
            norm_type,
        )
        if world_size > 1 and not replicated:
            all_reduce_verdict(local, group, norm_type=norm_type)
        norm = _p_norm(local, norm_type)
        if max_norm < math.inf:  # inf measures only: the coefficient would be 1
            _div_groups_(groups, torch.fmax(norm / max_norm, one))
        return norm, _coded(params, per_tensor, codes)


# ---------------------------------------------------------------------- epilogue helpers


def _clip_on_host(
    groups: GradGroups,
    params: tuple[torch.Tensor, ...],
    per_tensor: torch.Tensor | None,
    state: DeviceState,
    epilogue: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ends: Epilogue | None,
    fused: bool,
    codes: bool,
) -> ClipVerdict:
    """The end of :meth:`VerdictGroup.clip` where a host read is free (:mod:`~distscaler.host_read`):
    ``flag`` (0.0, or NaN for a non-finite norm) is read, the agreed flag is the constant 1.0 or
    0.0, and the per-tensor norms are coded only on a skip; a clean step takes ``fmax`` for
    ``grad_scale``, a skipped one nothing (its ``grad_scale`` is the scale)."""
    norm, q, flag = epilogue
    skipped = not math.isfinite(flag.item())
    found = state.one if skipped else state.zero
    grad_scale = state.scale if skipped else torch.fmax(q, state.scale)
    if not fused:
        _div_groups_(groups, grad_scale)
    coded = _coded(params, per_tensor, codes and skipped)
    if codes and coded is None:
        coded = TensorCodes(params, None)  # clean: nothing to record
    return ClipVerdict(norm, found, grad_scale, ends, coded, after_read=codes)


def _coded(
    params: tuple[torch.Tensor, ...], per_tensor: torch.Tensor | None, wanted: bool
) -> TensorCodes | None:
    # The codes of a verdict's per-tensor norms, when an overflow report will read them.
    if not wanted or per_tensor is None:
        return None
    return TensorCodes(params, tensor_codes(per_tensor))
