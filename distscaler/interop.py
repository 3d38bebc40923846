"""Scaler states saved by other training stacks, read into ``GradScaler.load_state_dict``'s layout.

Recognised (by their keys or attributes; nothing here imports DeepSpeed or Megatron):

* ``torch.amp.GradScaler.state_dict()`` and distscaler's own: passed through unchanged.
* Megatron-LM ``DynamicGradScaler.state_dict()``: ``{scale, growth_tracker, hysteresis_tracker}``,
  ``scale`` a 1-element tensor (``megatron/core/optimizer/grad_scaler.py``).
* DeepSpeed's fp16 optimizer (ZeRO stage 0, ``deepspeed/runtime/fp16/fused_optimizer.py``
  ``state_dict``): ``cur_scale``, ``cur_iter``, ``dynamic_loss_scale`` and, when dynamic,
  ``last_overflow_iter``, ``scale_factor``, ``scale_window`` (other keys, the optimizer's, ignored).
  That optimizer has no hysteresis: the scaler's own ``hysteresis`` applies, refilled.
* DeepSpeed's ``DynamicLossScaler`` / ``LossScaler`` object, which ZeRO stage 1-3 checkpoints pickle
  whole under ``"loss_scaler"`` (``deepspeed/runtime/fp16/loss_scaler.py``): the object itself or
  the ZeRO optimizer state dict that holds it. Unpickling it needs deepspeed; reading it does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["detect_format", "to_native_state"]

_ZERO_KEY = "loss_scaler"  # deepspeed.checkpoint.constants.LOSS_SCALER


def _is_deepspeed_scaler(obj: object) -> bool:
    return not isinstance(obj, Mapping) and hasattr(obj, "cur_scale") and hasattr(obj, "dynamic")


def detect_format(state: object) -> str:
    """``"native"`` (torch/distscaler), ``"megatron"``, ``"deepspeed_fp16"`` or ``"deepspeed_object"``.

    Anything unrecognised is ``"native"``: its validation then names the missing keys.
    """
    if _is_deepspeed_scaler(state):
        return "deepspeed_object"
    if not isinstance(state, Mapping):
        return "native"
    if _is_deepspeed_scaler(state.get(_ZERO_KEY)):
        return "deepspeed_object"
    if "cur_scale" in state:
        return "deepspeed_fp16"
    if "scale" in state and "growth_tracker" in state and "_growth_tracker" not in state:
        return "megatron"
    return "native"


def _deepspeed_growth_tracker(cur_iter: int, last_overflow_iter: int, window: int) -> int:
    """The clean steps since the last overflow or growth, as the ``deepspeed`` policy counts them."""
    stable = cur_iter - last_overflow_iter - 1
    if stable <= window:
        return max(stable, 0)
    return (stable - window - 1) % window


def _from_deepspeed(
    cur_scale: Any,
    dynamic: bool,
    cur_iter: Any,
    last_overflow_iter: Any,
    scale_factor: Any,
    scale_window: Any,
    current: Mapping[str, Any],
) -> dict[str, Any]:
    out: dict[str, Any] = {"scale": cur_scale, "cur_iter": cur_iter}
    if not dynamic:
        out.update(
            {k: current[k] for k in ("growth_factor", "backoff_factor", "growth_interval")},
            _growth_tracker=0,
        )
        return out
    window = scale_window
    out.update(
        growth_factor=scale_factor,
        backoff_factor=1.0 / scale_factor if isinstance(scale_factor, (int, float)) else None,
        growth_interval=window,
        last_overflow_iter=last_overflow_iter,
    )
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (cur_iter, window))
    if ints and isinstance(last_overflow_iter, int) and window >= 1:
        out["_growth_tracker"] = _deepspeed_growth_tracker(cur_iter, last_overflow_iter, window)
    else:
        out["_growth_tracker"] = 0  # the invalid values above are reported by the validation
    return out


def to_native_state(state: object, current: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """Convert ``state`` to distscaler's ``state_dict`` layout; return (format, converted state).

    ``current`` holds this scaler's ``growth_factor``, ``backoff_factor`` and ``growth_interval``,
    used where the saved format does not carry them (Megatron's). The result may also hold
    ``policy`` (the rule the state was saved under), policy state keys (``cur_iter``,
    ``last_overflow_iter``, ``cur_hysteresis``, ``hysteresis_tracker``) and DeepSpeed's
    ``hysteresis``, ``consecutive_hysteresis`` and ``min_scale``. Values are not validated here.
    """
    fmt = detect_format(state)
    if fmt == "native":
        return fmt, state  # type: ignore[return-value]
    if fmt == "megatron":
        assert isinstance(state, Mapping)
        out = {k: current[k] for k in ("growth_factor", "backoff_factor", "growth_interval")}
        out.update(
            scale=state["scale"],
            _growth_tracker=state["growth_tracker"],
            policy="megatron",
        )
        if "hysteresis_tracker" in state:
            out["hysteresis_tracker"] = state["hysteresis_tracker"]
        return fmt, out
    if fmt == "deepspeed_fp16":
        assert isinstance(state, Mapping)
        dynamic = bool(state.get("dynamic_loss_scale", "scale_window" in state))
        out = _from_deepspeed(
            state["cur_scale"],
            dynamic,
            state.get("cur_iter", 0),
            state.get("last_overflow_iter", -1),
            state.get("scale_factor", 2.0),
            state.get("scale_window", current["growth_interval"]),
            current,
        )
        out["policy"] = "deepspeed" if dynamic else "static"
        return fmt, out
    obj: Any = state if _is_deepspeed_scaler(state) else state[_ZERO_KEY]  # type: ignore[index]
    dynamic = bool(getattr(obj, "dynamic", False))
    out = _from_deepspeed(
        obj.cur_scale,
        dynamic,
        getattr(obj, "cur_iter", 0),
        getattr(obj, "last_overflow_iter", -1),
        getattr(obj, "scale_factor", 2.0),
        getattr(obj, "scale_window", current["growth_interval"]),
        current,
    )
    out["policy"] = "deepspeed" if dynamic else "static"
    if dynamic:
        out.update(
            hysteresis=getattr(obj, "delayed_shift", 1),
            consecutive_hysteresis=getattr(obj, "consecutive_hysteresis", False),
            cur_hysteresis=getattr(obj, "cur_hysteresis", getattr(obj, "delayed_shift", 1)),
            min_scale=getattr(obj, "min_scale", None),
        )
    return fmt, out
