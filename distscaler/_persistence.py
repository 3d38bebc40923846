"""Saving and loading a scaler's state: ``state_dict`` contents and ``load_state_dict`` checks.

A saved state holds plain Python numbers only (``torch.load(weights_only=True)`` reads it): torch's
five keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
``_growth_tracker``), so ``torch.amp.GradScaler.load_state_dict`` loads it, and keys torch ignores:
``min_scale``, ``max_scale``, ``num_updates``, ``num_skipped_steps`` (of which
``num_replica_mismatch_skips`` and ``num_not_committed_skips`` had those causes), ``policy``,
``hysteresis``, ``consecutive_hysteresis`` and the policy's counters (``cur_iter``, ``last_overflow_iter``,
``cur_hysteresis`` or ``hysteresis_tracker``). Other stacks' formats are converted first by
[`distscaler.interop`][distscaler.interop].

`parse_state()` checks every value with the ranges of [`distscaler.config`][distscaler.config] and
reports all problems in one error; it changes nothing, so a scaler applies the result only once it
is valid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import _validation as V
from ._state import HostValues
from .config import FIELD_CHECKS, raise_problems, settings_problems
from .interop import to_native_state
from .policies import get_policy, policy_names

if TYPE_CHECKING:
    from .config import ScalerConfig
    from .telemetry import SkipTotals

__all__ = ["LoadedState", "export_state", "parse_state"]


def export_state(config: ScalerConfig, values: HostValues, totals: SkipTotals) -> dict[str, Any]:
    """The ``state_dict`` of a scaler with settings ``config`` and state ``values``."""
    return {
        "scale": float(values.scale),
        "growth_factor": config.growth_factor,
        "backoff_factor": config.backoff_factor,
        "growth_interval": config.growth_interval,
        "_growth_tracker": int(values.growth_tracker),
        "min_scale": config.min_scale,
        "max_scale": config.max_scale,
        "num_updates": totals.num_updates,
        "num_skipped_steps": totals.num_skipped,
        "num_replica_mismatch_skips": totals.replica_mismatches,
        "num_not_committed_skips": totals.not_committed,
        # the skips of a cause a check on the collective gave (distscaler.checks)
        **{f"num_{cause}_skips": n for cause, n in totals.other_causes},
        "policy": config.policy,
        "hysteresis": config.hysteresis,
        "consecutive_hysteresis": config.consecutive_hysteresis,
        **values.policy,
    }


@dataclass(frozen=True, slots=True)
class LoadedState:
    """A checked state to continue from.

    Attributes:
        config: the scaler's settings with what the state carries (``init_scale`` is its scale).
        values: scale, growth tracker and counters of ``config.policy``.
        num_updates, num_skipped: the run's counts so far.
        skip_causes: of ``num_skipped``, those of a cause the host knows (``replica_mismatch``,
            ``not_committed``); the rest were overflows.
        warnings: settings of the constructor the state replaced, or a change of policy.
    """

    config: ScalerConfig
    values: HostValues
    num_updates: int
    num_skipped: int
    skip_causes: dict[str, int]
    warnings: tuple[str, ...]


def _check_policy_name(name: str, value: object) -> str:
    if value not in policy_names():
        raise ValueError(f"{name} must be one of {policy_names()}, got: {value!r}")
    return str(value)


# A state's keys, with the checks of the settings they hold (config.FIELD_CHECKS).
_SETTINGS: tuple[tuple[str, Any, dict[str, Any]], ...] = (
    ("scale", *FIELD_CHECKS["init_scale"]),
    ("growth_factor", *FIELD_CHECKS["growth_factor"]),
    ("backoff_factor", *FIELD_CHECKS["backoff_factor"]),
    ("growth_interval", *FIELD_CHECKS["growth_interval"]),
    ("_growth_tracker", V.check_int, {"minimum": 0, "maximum": V.INT32_MAX}),
)
# Keys a state may lack, with their checks.
_OPTIONAL: tuple[tuple[str, Any, dict[str, Any]], ...] = (
    ("num_updates", V.check_int, {"minimum": 0}),
    ("num_skipped_steps", V.check_int, {"minimum": 0}),
    ("num_replica_mismatch_skips", V.check_int, {"minimum": 0}),
    ("num_not_committed_skips", V.check_int, {"minimum": 0}),
    ("policy", _check_policy_name, {}),
    ("hysteresis", *FIELD_CHECKS["hysteresis"]),
    ("consecutive_hysteresis", *FIELD_CHECKS["consecutive_hysteresis"]),
)


def _counter_checks() -> dict[str, dict[str, int]]:
    """Every registered policy's counters, with their ranges (``LossScalePolicy.counter_ranges``)."""
    checks: dict[str, dict[str, int]] = {}
    for name in policy_names():
        policy = get_policy(name)
        for key in policy.state_keys:
            low, high = policy.counter_ranges.get(key, (-V.INT64_MAX, V.INT64_MAX))
            checks.setdefault(key, {"minimum": low, "maximum": high})
    return checks


def parse_state(state_dict: object, config: ScalerConfig) -> LoadedState:
    """Check a saved state (any format [`distscaler.interop`][distscaler.interop] reads) against
    ``config``.

    Settings a format carries replace the constructor's, as torch does for ``growth_factor`` etc.;
    a replaced ``min_scale``, ``max_scale``, ``hysteresis`` or ``consecutive_hysteresis`` is listed
    in ``warnings``, and so is a state saved under another policy (its counters are converted where
    they mean the same, else start fresh). No host read (a tensor value is read once).

    Raises:
        RuntimeError: ``state_dict`` is empty (saved from a disabled scaler; torch's wording).
        ValueError: a key is missing or a value has the wrong type or range (all problems at once).
        TypeError: ``state_dict`` is neither a mapping nor a DeepSpeed loss scaler.
    """
    current = {
        "growth_factor": config.growth_factor,
        "backoff_factor": config.backoff_factor,
        "growth_interval": config.growth_interval,
    }
    fmt, state = to_native_state(state_dict, current)
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict must be a mapping, got: {type(state).__name__}")
    if len(state) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved "
            "from a disabled instance of GradScaler."
        )
    problems: list[str] = []
    parsed: dict[str, Any] = {}

    def check(key: str, fn: Any, kwargs: dict[str, Any]) -> None:
        value = state[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        try:
            parsed[key] = fn(f"state_dict[{key!r}]", value, **kwargs)
        except (TypeError, ValueError) as e:
            problems.append(str(e))

    for key, fn, kwargs in _SETTINGS:
        if key not in state:
            problems.append(f"missing key {key!r}")
        else:
            check(key, fn, kwargs)
    for key in ("min_scale", "max_scale"):
        if state.get(key) is not None:
            check(key, *FIELD_CHECKS[key])
    for key, fn, kwargs in _OPTIONAL:
        if key in state:
            check(key, fn, kwargs)
    counter_checks = _counter_checks()
    for key, ranges in counter_checks.items():
        if key in state:
            check(key, V.check_int, ranges)
    if problems:
        raise ValueError("invalid GradScaler state_dict:\n- " + "\n- ".join(problems))

    notes: list[str] = []
    changes: dict[str, Any] = {
        "init_scale": parsed["scale"],
        "growth_factor": parsed["growth_factor"],
        "backoff_factor": parsed["backoff_factor"],
        "growth_interval": parsed["growth_interval"],
    }
    for key in ("min_scale", "max_scale"):
        if key in state and parsed.get(key) != getattr(config, key):
            notes.append(
                f"load_state_dict: {key}={getattr(config, key)} given to the constructor is "
                f"replaced by the checkpoint's {key}={parsed.get(key)}"
            )
            changes[key] = parsed.get(key)
    saved_policy = parsed.get("policy", config.policy)
    settings = (
        parsed.get("hysteresis", config.hysteresis),
        parsed.get("consecutive_hysteresis", config.consecutive_hysteresis),
    )
    if "policy" in parsed and saved_policy == config.policy:
        if settings != (config.hysteresis, config.consecutive_hysteresis):
            notes.append(
                f"load_state_dict: hysteresis={config.hysteresis}, consecutive_hysteresis="
                f"{config.consecutive_hysteresis} given to the constructor are replaced by the "
                f"checkpoint's hysteresis={settings[0]}, consecutive_hysteresis={settings[1]}"
            )
            changes["hysteresis"], changes["consecutive_hysteresis"] = settings
    elif saved_policy != config.policy:
        notes.append(
            f"load_state_dict: the {fmt} state was saved under policy={saved_policy!r}; this "
            f"scaler continues it with policy={config.policy!r}"
        )
    merged = {**config.scaler_kwargs(), **changes}
    raise_problems(
        "GradScaler state_dict",
        [(t, f"state_dict settings: {m}") for t, m in settings_problems(merged)],
    )
    new_config = dataclasses.replace(config, **changes)
    saved = {k: parsed[k] for k in (*counter_checks, "num_updates") if k in parsed}
    policy_values = get_policy(new_config.policy).state_from_checkpoint(
        saved, parsed["_growth_tracker"], new_config.rule()
    )
    num_skipped = parsed.get("num_skipped_steps", 0)
    causes = {
        "replica_mismatch": parsed.get("num_replica_mismatch_skips", 0),
        "not_committed": parsed.get("num_not_committed_skips", 0),
    }
    for key, value in state.items():  # the skips of a cause a check gave: num_<cause>_skips
        named = isinstance(key, str) and key.startswith("num_") and key.endswith("_skips")
        cause = key[4:-6] if named else ""
        if cause and cause not in causes:
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            causes[cause] = V.check_int(f"state_dict[{key!r}]", value, minimum=0)
    if sum(causes.values()) > num_skipped:
        counts = " + ".join(f"num_{cause}_skips ({n})" for cause, n in causes.items())
        raise ValueError(
            f"state_dict: {counts} must be at most num_skipped_steps ({num_skipped})"
        )
    return LoadedState(
        config=new_config,
        values=HostValues(parsed["scale"], parsed["_growth_tracker"], policy_values),
        num_updates=parsed.get("num_updates", 0),
        num_skipped=num_skipped,
        skip_causes=causes,
        warnings=tuple(notes),
    )
