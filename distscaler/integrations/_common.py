"""What the integrations share: the import guard, the tested versions, the installed scaler, the
LR hold on skipped steps, the metrics of a log, and the subclass an integration swaps a framework
object's class to (`subclass()`: AReaL's engine, ROLL's strategy, NeMo-RL's worker).

One definition each, used by [`accelerate`][distscaler.integrations.accelerate],
[`lightning`][distscaler.integrations.lightning],
[`transformers`][distscaler.integrations.transformers],
[`torchtitan`][distscaler.integrations.torchtitan], [`megatron`][distscaler.integrations.megatron],
[`verl`][distscaler.integrations.verl] and [`torchft`][distscaler.integrations.torchft]; the
``scaler=`` argument they all take is `distscaler.integrations._scaler_arg`'s. Nothing here imports
a framework.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch

from .._scaler import GradScaler

__all__ = [
    "INSTALLED",
    "LR_ON_SKIP",
    "SKIPPED",
    "TESTED_VERSIONS",
    "LogMetrics",
    "LROnSkip",
    "LRHold",
    "check_lr_on_skip",
    "installed_scaler",
    "requires",
    "subclass",
    "warn_if_untested",
]

# ---------------------------------------------------------------------- the framework's class, ours

#: (mixin, the framework's class) -> the subclass `subclass()` made.
_SUBCLASSES: dict[tuple[type, type], type] = {}


def subclass(mixin: type, stock: type, *, module: str, doc: str) -> type:
    """The class ``(mixin, stock)``, named as ``stock`` (``__name__``, ``__qualname__``), in
    ``module`` (the integration's), with ``doc``: made once per ``(mixin, stock)``, so that an
    integration that swaps an object's class to it (``obj.__class__ = subclass(...)``) gives every
    object of one framework class the same class (``isinstance`` and pickling agree across them).
    """
    key = (mixin, stock)
    ours = _SUBCLASSES.get(key)
    if ours is None:
        namespace = {"__module__": module, "__qualname__": stock.__qualname__, "__doc__": doc}
        ours = _SUBCLASSES[key] = type(stock.__name__, (mixin, stock), namespace)
    return ours


# ---------------------------------------------------------------------- importing the framework


@contextlib.contextmanager
def requires(
    integration: str, framework: str, extra: str | None, *, hints: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Run the framework's imports of ``distscaler.integrations.<integration>``: an
    ``ImportError`` among them becomes one that says what to install.

    Args:
        integration: the module's short name (``"lightning"``).
        framework: what it needs, as the message names it (``"Lightning >= 2.4"``).
        extra: the ``distscaler`` extra that installs it, or None (the message then says
            ``pip install <framework's first word>``).
        hints: for a missing module of that name (``ImportError.name``), the message to give
            instead (torchtitan needs triton when it loads).

    Raises:
        ImportError: ``distscaler.integrations.<integration> needs <framework>: pip install
            'distscaler[<extra>]'``, from the original error.
    """
    try:
        yield
    except ImportError as e:
        prefix = f"distscaler.integrations.{integration}"
        hint = (hints or {}).get(e.name or "")
        if hint is not None:
            raise ImportError(f"{prefix}: {hint}") from e
        command = f"pip install 'distscaler[{extra}]'" if extra else f"pip install {integration}"
        raise ImportError(f"{prefix} needs {framework}: {command}") from e


#: The framework release (distribution name -> version) each integration is written against and
#: tested with; the extras in ``pyproject.toml`` pin them and CI installs them.
TESTED_VERSIONS: Mapping[str, str] = {
    "megatron-core": "0.19.2",
    "torchft": "0.2.0",
    "torchtitan": "0.3.0",
    "verl": "0.9.1",
}


def warn_if_untested(logger: logging.Logger, distribution: str, found: str, relies_on: str) -> bool:
    """Warn once (``logger``) when the installed ``distribution`` is not the tested release;
    returns whether it is another release.

    Args:
        logger: the integration's logger.
        distribution: a key of `TESTED_VERSIONS`.
        found: the installed version.
        relies_on: what of the framework the integration relies on, for the message.
    """
    tested = TESTED_VERSIONS[distribution]
    if found == tested:
        return False
    logger.warning(
        "%s is tested with %s %s, found %s: %s",
        logger.name,
        distribution,
        tested,
        found,
        relies_on,
    )
    return True


# ---------------------------------------------------------------------- the installed scaler

#: The attribute under which an integration keeps what it installed on the framework's object
#: (an accelerator, a Trainer, a Megatron optimizer); that object's ``scaler`` is the scaler.
INSTALLED = "_distscaler"


def installed_scaler(target: Any) -> GradScaler | None:
    """The scaler an integration's ``install()`` put on ``target`` (under `INSTALLED`), or None."""
    holder = getattr(target, INSTALLED, None)
    return None if holder is None else holder.scaler


# ---------------------------------------------------------------------- the LR on skipped steps

#: What an LR scheduler does after skipped optimizer steps: ``"hold"``, or ``"step"`` as stock.
LROnSkip = Literal["hold", "step"]
LR_ON_SKIP: tuple[str, ...] = ("hold", "step")


def check_lr_on_skip(value: Any, name: str = "lr_on_skip") -> LROnSkip:
    """``value`` if it is one of `LR_ON_SKIP`.

    Raises:
        ValueError: ``<name> must be one of ('hold', 'step'), got: <value>``.
    """
    if value not in LR_ON_SKIP:
        raise ValueError(f"{name} must be one of {LR_ON_SKIP}, got: {value!r}")
    return value  # type: ignore[no-any-return]


class LRHold:
    """The optimizer steps since an LR scheduler last stepped, for the hold rule: the scheduler
    holds when there was at least one and every one of them was skipped, so that the schedule
    counts the updates that happened (Accelerate's rule for its schedulers).

    A step is recorded as a bool or as the scaler's agreed ``found_inf`` (a 0-dim device tensor,
    read only when the scheduler asks).
    """

    def __init__(self) -> None:
        self._since: list[bool | torch.Tensor] = []
        self._last: bool | torch.Tensor = False

    def record(self, skipped: bool | torch.Tensor) -> None:
        """One optimizer step, skipped (True, a nonzero flag) or not. No host read."""
        self._since.append(skipped)
        self._last = skipped

    @property
    def last_skipped(self) -> bool:
        """Whether the last recorded step was skipped (one host read for a flag); False before
        any."""
        last = self._last
        return bool(last.item()) if isinstance(last, torch.Tensor) else last

    def hold(self) -> bool:
        """Whether the scheduler holds now, then count again from zero. One host read where flags
        were recorded (none after a step recorded as not skipped)."""
        since, self._since = self._since, []
        if not since or any(isinstance(s, bool) and not s for s in since):
            return False
        flags = [s for s in since if isinstance(s, torch.Tensor)]
        if not flags:
            return True
        if len(flags) == 1:
            return bool(flags[0].item())
        return bool(torch.stack(flags).amin().item())


# ---------------------------------------------------------------------- the metrics of a log

#: The key of the skipped optimizer steps since the previous log (the integrations' own count,
#: beside [`GradScaler.metrics()`][distscaler.GradScaler.metrics]' ``distscaler/skipped_total``).
SKIPPED = "distscaler/skipped"


class LogMetrics:
    """The ``distscaler/*`` entries of an integration's logs:
    [`GradScaler.metrics()`][distscaler.GradScaler.metrics] plus `SKIPPED`, the skipped optimizer
    steps since the previous log (counted from the checkpoint's totals on a resumed run).
    """

    def __init__(self) -> None:
        self.logged_skipped = 0

    def resume(self, scaler: GradScaler) -> None:
        """Count from the scaler's totals (after ``load_state_dict``): one host read."""
        self.logged_skipped = scaler.skip_totals.num_skipped

    def metrics(self, scaler: GradScaler, *, report: bool = False) -> dict[str, float | int]:
        """The entries of this log; empty when the scaler is disabled.

        With ``report``, after new skips,
        [`GradScaler.report_overflow()`][distscaler.GradScaler.report_overflow] runs first (it logs
        the report): every rank must then call at the same step. Cost: one host read; after new
        skips with ``report``, the report's (one ``all_gather`` at world size > 1) and one more.
        """
        metrics = scaler.metrics()
        if not metrics:
            return metrics
        total = int(metrics["distscaler/skipped_total"])
        new = total - self.logged_skipped
        self.logged_skipped = total
        if new and report:
            scaler.report_overflow()
            metrics = scaler.metrics()
        metrics[SKIPPED] = new
        return metrics
