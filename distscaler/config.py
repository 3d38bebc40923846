"""``ScalerConfig``: every setting of a ``GradScaler`` in one validated, frozen value.

This module is the one place where settings are validated: ``GradScaler.__init__``, its setters and
``load_state_dict`` use the same checks
([`settings_problems()`][distscaler.config.settings_problems]), so a value is refused with the same
message wherever it comes from, before anything changes. The ranges are what the device state can
hold (float32 scale, int32 growth tracker, int64 policy counters). ``ScalerConfig.from_deepspeed``
reads DeepSpeed's ``fp16`` config section (see [`distscaler.interop`][distscaler.interop]).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any, Literal

from . import _validation as V
from .policies import PolicyName, ScaleRule, get_policy  # PolicyName: pydantic resolves it
from .replica_check import OnMismatch, ReplicaMismatch  # noqa: F401  (pydantic resolves both)

__all__ = ["FIELD_CHECKS", "ScalerConfig", "settings_problems"]

#: ``on_collapse``: what a collapse does.
CollapseAction = Literal["warn", "raise"]
#: ``kernels``: which kernels read the gradients.
Kernels = Literal["auto", "triton", "torch"]

#: What a config's problems are reported as: "ScalerConfig", or the arguments it was built from
#: ([`ScalerConfig.of_arguments()`][distscaler.config.ScalerConfig.of_arguments]).
_WHAT: ContextVar[str] = ContextVar("distscaler_config_what", default="ScalerConfig")

#: The check and valid range of each numeric or bool setting (``policy`` is checked apart), shared
#: by [`settings_problems()`][distscaler.config.settings_problems] and ``load_state_dict``'s per-key
#: checks.
FIELD_CHECKS: dict[str, tuple[Any, dict[str, Any]]] = {
    "enabled": (V.check_bool, {}),
    "consecutive_hysteresis": (V.check_bool, {}),
    "raise_error_at_min_scale": (V.check_bool, {}),
    "skip_nonfinite": (V.check_bool, {}),
    "init_scale": (V.check_scale, {}),
    "growth_factor": (V.check_factor, {"low": 1.0, "high": None}),
    # float32's normal range: a denormal factor would take a small scale to exactly 0 in one
    # backoff (and torch's kernel multiplies in float32).
    "backoff_factor": (
        V.check_factor,
        {"low": V.FLOAT32_TINY, "high": 1.0, "low_inclusive": True},
    ),
    "growth_interval": (V.check_int, {"minimum": 1, "maximum": V.INT32_MAX}),
    "hysteresis": (V.check_int, {"minimum": 1}),
    "skip_log_interval": (V.check_int, {"minimum": 0}),
    "replica_check": (V.check_bool, {}),
    "param_check_interval": (V.check_int, {"minimum": 0}),
    "collapse_window": (V.check_int, {"minimum": 0}),
    "min_scale": (V.check_scale, {}),  # or None
    "max_scale": (V.check_scale, {}),  # or None
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalerConfig:
    """Settings of a [`distscaler.GradScaler`][distscaler.GradScaler]; see its docstring for each
    one's meaning.

    Every field is checked in ``__post_init__``; all problems are reported in one error
    (``ValueError``; ``TypeError`` when every problem is a wrong type).
    """

    enabled: bool = True
    """False: a disabled scaler only clips: ``clip_grad_norm_`` is
    ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, ``step`` calls
    ``optimizer.step()``, every other method is a no-op; no collective, no host read."""
    init_scale: float = 2.0**16
    """Initial loss scale, a normal float32 > 0 (the fixed scale for ``policy="static"``)."""
    growth_factor: float = 2.0
    """Factor (> 1) applied to the scale when it grows."""
    backoff_factor: float = 0.5
    """Factor in (0, 1) applied to the scale when it backs off."""
    growth_interval: int = 2000
    """Clean steps, in optimizer steps, before the scale grows (DeepSpeed's ``loss_scale_window``);
    in [1, 2**31 - 1] (torch's growth tracker is an int32 tensor)."""
    policy: PolicyName = "torch"
    """The update rule: ``"torch"``, ``"deepspeed"``, ``"megatron"``, ``"static"`` or the name of
    a registered one
    ([`distscaler.policies.register_policy()`][distscaler.policies.register_policy])."""
    hysteresis: int = 1
    """Overflows tolerated before a backoff (>= 1; > 1 where the policy accepts it:
    ``"deepspeed"``, ``"megatron"``)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every clean step (where the policy accepts it: ``"deepspeed"``)."""
    min_scale: float | None = None
    """Floor of the scale, or None."""
    max_scale: float | None = None
    """Ceiling of the scale, or None."""
    raise_error_at_min_scale: bool = False
    """Raise at an overflow with the scale at ``min_scale`` (one host read per update)."""
    skip_nonfinite: bool = True
    """Skip steps with inf/NaN gradients (False only with a policy whose scale does not react to
    overflows: ``"static"``)."""
    skip_log_interval: int = 100
    """Updates between two reads of the skip counters for logging (0: only when read anyway)."""
    replica_check: bool = True
    """Ranks holding the same gradients compare them on the step's collective; a mismatch skips
    the step on every rank ([`distscaler.replica_check`][distscaler.replica_check])."""
    replica_check_interval: int | None = None
    """Updates between two gradient comparisons (>= 1); None: every update where the Triton
    kernels read the checksum (CUDA: with a fused optimizer and ``skip_log_interval > 0`` the
    reading waits, with another it rides on the step's own host read), every 32
    (`distscaler.replica_check.INTERVAL`) where torch's kernels read it (the CPU, a GPU without
    the Triton kernels)."""
    param_check_interval: int = 1000
    """Updates between two comparisons of the replicated parameters and their optimizer state
    (>= 0; 0: never)."""
    on_replica_mismatch: OnMismatch = "skip"
    """``"skip"``, ``"raise"`` (`ReplicaMismatchError` on every rank before the optimizer steps)
    or a callable taking the `ReplicaMismatch` (called on every rank; the step is skipped)."""
    collapse_window: int = 2000
    """Updates in a row that all skipped (for any cause) after which the run is named collapsed
    (>= 0; 0: never); a non-finite parameter seen by the parameter check is one at once."""
    on_collapse: CollapseAction = "warn"
    """``"warn"`` (a warning with the report, once per collapse) or ``"raise"``
    (`TrainingCollapsedError` on every rank)."""
    kernels: Kernels = "auto"
    """The pass over the gradients: ``"triton"`` (one multi-tensor Triton kernel: CUDA with
    triton importable), ``"torch"`` (torch's multi-tensor kernels) or ``"auto"`` (Triton where it
    runs, else torch's); decided when the scaler is built."""

    def __post_init__(self) -> None:
        raise_problems(_WHAT.get(), settings_problems(self.scaler_kwargs()))
        # Valid values in the types the kernels take: a Python int scale of 2**64 is a valid
        # float32 but not a valid clamp bound; a numpy integer interval is an int.
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, float(value))
        for name in ("growth_interval", "hysteresis", "skip_log_interval",
                     "param_check_interval", "collapse_window"):  # fmt: skip
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.replica_check_interval is not None:
            object.__setattr__(self, "replica_check_interval", int(self.replica_check_interval))

    @classmethod
    def of_arguments(cls, what: str, **settings: Any) -> ScalerConfig:
        """``ScalerConfig(**settings)``, validated once, its problems reported as ``what``'s
        (``"GradScaler arguments"``)."""
        token = _WHAT.set(what)
        try:
            return cls(**settings)
        finally:
            _WHAT.reset(token)

    def scaler_kwargs(self) -> dict[str, Any]:
        """The config as keyword arguments of [`distscaler.GradScaler`][distscaler.GradScaler]
        (without ``device``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def rule(self) -> ScaleRule:
        """The settings the scale update rule reads
        ([`ScaleRule`][distscaler.policies.ScaleRule])."""
        return ScaleRule(
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
        )

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> ScalerConfig:
        """Read a DeepSpeed config: the whole config, its ``"fp16"`` section, or a JSON file path.

        Keys of the ``fp16`` section, with DeepSpeed's defaults: ``enabled`` (False),
        ``loss_scale`` (0: dynamic; > 0: that static scale), ``initial_scale_power`` (16: the
        dynamic scale starts at 2**16), ``loss_scale_window`` (1000), ``hysteresis`` (2),
        ``consecutive_hysteresis`` (False), ``min_loss_scale`` (1); ``auto_cast`` and
        ``fp16_master_weights_and_grads`` are accepted and warn when true (they configure
        DeepSpeed's engine, not a scaler). From a whole config, ``bf16`` (or ``bfloat16``)
        ``enabled`` and ``check_grad_overflow`` (True) are read too.

        The result:

        * fp16 with ``loss_scale == 0``: ``policy="deepspeed"``, ``init_scale =
          2**initial_scale_power``, ``growth_interval = loss_scale_window``, ``hysteresis``,
          ``consecutive_hysteresis``, ``min_scale = min_loss_scale``, factors 2 and 0.5,
          ``raise_error_at_min_scale=True`` (DeepSpeed ZeRO's ``DynamicLossScaler`` default; it
          costs one host read per update: ``dataclasses.replace(config,
          raise_error_at_min_scale=False)`` clamps at the minimum instead, as DeepSpeed's stage-0
          fp16 optimizer does).
        * fp16 with ``loss_scale > 0``: ``policy="static"`` at that scale.
        * fp16 not enabled (bf16 or fp32 training): ``policy="static"`` at 1.0; non-finite steps
          are still agreed on and skipped, unless bf16's ``check_grad_overflow`` is false.

        Which is which: a mapping with an ``"fp16"``, ``"bf16"`` or ``"bfloat16"`` key is a whole
        config; one whose keys include an fp16 key is the section; any other mapping is a whole
        config without fp16 or bf16 (fp32 training). Source of the semantics:
        ``deepspeed/runtime/precision_config.py``, ``deepspeed/runtime/fp16/loss_scaler.py``.

        Raises:
            ValueError: unknown keys, invalid values, ``"auto"`` values (Accelerate and the HF
                Trainer fill those in: pass the filled config), fp16 and bf16 both enabled; every
                problem in one error naming each key.
            TypeError: ``config`` is not a mapping or a path.
            FileNotFoundError: the path does not exist.
        """
        from .interop import read_deepspeed_config

        return cls(**read_deepspeed_config(config))


def settings_problems(s: Mapping[str, Any]) -> list[tuple[type[Exception], str]]:
    """Every problem of a set of scaler settings (the fields of
    [`ScalerConfig`][distscaler.config.ScalerConfig]).

    Returns ``(exception type, message)`` pairs, each message naming the setting, its value and the
    valid range; empty when the settings are valid. Cross-field checks run once the fields are valid.
    """
    problems: list[tuple[type[Exception], str]] = []

    for name, (fn, kwargs) in FIELD_CHECKS.items():
        if name in ("min_scale", "max_scale") and s[name] is None:
            continue
        try:
            fn(name, s[name], **kwargs)
        except (TypeError, ValueError) as e:
            problems.append((type(e), str(e)))
    interval = s["replica_check_interval"]
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int)
                                 or interval < 1):  # fmt: skip
        problems.append((ValueError, "replica_check_interval must be an int >= 1 or None "
                                     f"(None: chosen per device), got: {interval!r}"))  # fmt: skip
    on_mismatch = s["on_replica_mismatch"]
    if not (on_mismatch in ("skip", "raise") or callable(on_mismatch)):
        problems.append((ValueError, "on_replica_mismatch must be 'skip', 'raise' or a callable "
                                     f"taking a ReplicaMismatch, got: {on_mismatch!r}"))  # fmt: skip
    if s["kernels"] not in ("auto", "triton", "torch"):
        problems.append((ValueError, f"kernels must be 'auto', 'triton' or 'torch', got: {s['kernels']!r}"))
    if s["on_collapse"] not in ("warn", "raise"):
        problems.append((ValueError, f"on_collapse must be 'warn' or 'raise', got: {s['on_collapse']!r}"))
    try:
        policy = get_policy(s["policy"])
    except ValueError as e:
        problems.append((ValueError, str(e)))
    if problems:  # the cross-field checks need valid fields
        return problems
    # What the rule accepts (hysteresis, consecutive_hysteresis, skip_nonfinite), in its words.
    problems += [(ValueError, m) for m in policy.settings_problems(s)]
    low = s["min_scale"] if s["min_scale"] is not None else 0.0
    high = s["max_scale"] if s["max_scale"] is not None else math.inf
    if low > high:
        problems.append(
            (
                ValueError,
                f"min_scale must be <= max_scale, got: min_scale={s['min_scale']}, "
                f"max_scale={s['max_scale']}",
            )
        )
    elif not low <= s["init_scale"] <= high:
        problems.append(
            (
                ValueError,
                f"init_scale must be in [min_scale, max_scale] = [{s['min_scale']}, "
                f"{s['max_scale']}], got: {s['init_scale']}",
            )
        )
    if s["raise_error_at_min_scale"] and s["min_scale"] is None:
        problems.append(
            (ValueError, "raise_error_at_min_scale=True needs min_scale, got: min_scale=None")
        )
    return problems


def raise_problems(what: str, problems: list[tuple[type[Exception], str]]) -> None:
    """Raise one error listing ``problems`` (TypeError if every one is a type problem)."""
    if not problems:
        return
    kind = TypeError if all(t is TypeError for t, _ in problems) else ValueError
    messages = [m for _, m in problems]
    if len(messages) == 1:
        raise kind(messages[0])
    raise kind(f"invalid {what}:\n- " + "\n- ".join(messages))
