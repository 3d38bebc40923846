"""``GradScaler``'s state as the host sees it: its reads and its checkpoints.

Every value a step changes lives on the device (:mod:`distscaler.state`); the step path reads at
most the agreed flag (:mod:`distscaler.verdict`). This mixin is where the host reads the rest, in
one transfer each time (:meth:`ScalerStateAPI._read`, a sync on a GPU): :meth:`get_scale`, :attr:`step_was_skipped`, :attr:`skip_totals`,
:attr:`found_inf` (no read), torch's private ``_get_growth_tracker`` and ``_init_growth_tracker``;
and where the state is saved and restored: :meth:`state_dict`, :meth:`load_state_dict` (the
formats are :mod:`distscaler.persistence`'s) and pickling. It reads the scaler through the
attributes of the face it declares, each with its type (``_enabled``, ``_config``, ``_state``,
``_records``, ``_verdict``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .errors import CallOrderError
from .persistence import export_state, parse_state
from .state import HostValues, ScalerState
from .telemetry import SkipTotals

if TYPE_CHECKING:
    from .config import ScalerConfig
    from .step_record import StepRecord
    from .verdict import VerdictGroup

__all__ = ["ScalerStateAPI"]


class ScalerStateAPI:
    """The host's reads and the checkpoints of :class:`~distscaler.GradScaler` (a mixin)."""

    _enabled: bool
    _config: ScalerConfig
    _state: ScalerState
    #: This iteration's records: a verdict is pending while it is not empty.
    _records: dict[int, StepRecord]
    _verdict: VerdictGroup

    # ------------------------------------------------------------------ the one read

    def _read(self, *extra: torch.Tensor) -> tuple[list[float], HostValues, SkipTotals]:
        """Read ``extra`` 0-dim tensors and the state in one host transfer; log new skips.

        Between iterations (no verdict pending) the record's counts are folded into the host's.
        """
        _, world_size = self._verdict.resolve()
        fold = not self._records
        return self._state.read(*extra, fold=fold, world_size=world_size)

    # ------------------------------------------------------------------ reads

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Incurs one host read (sync)."""
        if not self._enabled:
            return 1.0
        return self._read()[1].scale

    def _get_growth_tracker(self) -> int:
        return self._read()[1].growth_tracker if self._enabled else 0

    @property
    def _init_growth_tracker(self) -> int:
        # torch's private field, read by code that inspects torch's scaler: the tracker the device
        # state starts from (0; the loaded one after load_state_dict; the pickled one after
        # unpickling), as torch sets it. No host read.
        return self._state.initial.growth_tracker

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        # Before the first scale() it is where the device state starts, as in torch.
        self._state.initial = dataclasses.replace(self._state.initial, growth_tracker=int(value))

    @property
    def found_inf(self) -> torch.Tensor | None:
        """The agreed flag of the last :meth:`update` (0-dim float32 on the device, 1.0 if skipped,
        else 0.0; no host read; never written again). None before one and when disabled."""
        return self._state.last_found_inf if self._enabled else None

    @property
    def step_was_skipped(self) -> bool:
        """Whether the optimizer step(s) of the last iteration were skipped, the same on every rank.

        One host read (the explicit sync). False before the first update and when disabled.
        """
        flag = self._state.last_found_inf
        if not self._enabled or flag is None:
            return False
        return bool(self._read(flag)[0][0])

    @property
    def skip_totals(self) -> SkipTotals:
        """Updates, skipped updates, the last skip's number and scale, so far (one host read).

        For a step replayed from a CUDA graph it is the periodic report's read: call it outside the
        graph, at least every 2**24 steps (the device counts are float32).
        """
        return self._read()[2] if self._enabled else SkipTotals()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python numbers (one host read); empty when disabled.

        torch's five keys, so :meth:`torch.amp.GradScaler.load_state_dict` loads it, plus the
        bounds, the run's counts, the policy and its counters (see :mod:`distscaler.persistence`),
        so that a run resumed mid-hysteresis continues exactly. Safe under
        ``torch.load(weights_only=True)``.
        """
        if not self._enabled:
            return {}
        _, values, totals = self._read()
        return export_state(self._config, values, totals)

    def load_state_dict(self, state_dict: Any) -> None:
        """Load a scaler state saved by this class, by another stack, and continue its trajectory.

        torch's and Megatron's ``state_dict``, DeepSpeed's fp16 optimizer state, its loss scaler
        object or the ZeRO state holding it (:mod:`distscaler.interop`). Settings a format carries
        replace the constructor's, as torch does; a replaced bound or hysteresis, or another
        policy, warns (:mod:`distscaler.persistence`). Every value is checked first, all problems
        in one error, and on error nothing changes. No-op when disabled.

        Raises:
            RuntimeError: ``state_dict`` is empty (saved from a disabled scaler; torch's wording).
            ValueError: a key is missing or a value has the wrong type or range.
            TypeError: ``state_dict`` is neither a mapping nor a DeepSpeed loss scaler.
        """
        if not self._enabled:
            return
        loaded = parse_state(state_dict, self._config)
        for message in loaded.warnings:
            warnings.warn(message, stacklevel=2)
        self._config = loaded.config
        self._state.load(loaded.values, loaded.num_updates, loaded.num_skipped)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if self._records:
                raise CallOrderError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            _, values, totals = self._read()
            state.update(_state=self._state.portable(values, totals), _scale=None)
            state["_growth_tracker"] = None
        state["_records"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.pop("_per_optimizer_states", None)  # pickled before the records (now a view)
        state.setdefault("_records", {})
        self.__dict__.update(state)
