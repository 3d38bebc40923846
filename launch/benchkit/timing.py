"""Interleaved timing: every contender runs once per round (A B C A B C ...), medians over rounds.

Interleaving spreads the noise of a shared machine (other jobs, frequency changes, page cache)
evenly over the contenders, so the ratios measured side by side in one run hold even when the
absolute times drift. Every call starts from the same gradients: ``reset()`` runs before each timed
call, outside the timer.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

import torch

from common.probes import PhaseTimer

__all__ = ["Timer", "interleave", "median_ms"]


class Timer:
    """Wall time of one call in seconds, queued device work from before the call left out.

    Synchronizes the device first, then brackets the call with :class:`common.probes.PhaseTimer`
    (CUDA events on GPUs, so work the call queued is counted; the host clock on CPU).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._timer = PhaseTimer(device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], Any]) -> float:
        self.sync()
        self._timer.start()
        fn()
        self._timer.stop()
        return self._timer.seconds()


def interleave(
    fns: Mapping[str, Callable[[], Any]],
    *,
    reset: Callable[[], Any],
    rounds: int,
    warmup: int,
    device: torch.device,
    on_round: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Run each of ``fns`` once per round, ``warmup`` untimed rounds first, then ``rounds`` timed.

    Returns seconds per call for each name (``rounds`` values). A function that raises is timed no
    further; its entry is the exception (``str``) instead of a list, and the others go on.
    """
    timer = Timer(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    failed: dict[str, str] = {}
    for i in range(warmup + rounds):
        for name, fn in fns.items():
            if name in failed:
                continue
            reset()
            try:
                seconds = timer(fn)
            except Exception as exc:  # a contender that cannot run here (reported, not fatal)
                failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                continue
            if i >= warmup:
                times[name].append(seconds)
        if on_round is not None:
            on_round()
    return {name: failed.get(name, t) for name, t in times.items()}  # type: ignore[misc]


def median_ms(values: list[float] | str) -> float | None:
    """Median in milliseconds (None for a failed contender)."""
    if isinstance(values, str) or not values:
        return None
    return round(statistics.median(values) * 1e3, 3)
