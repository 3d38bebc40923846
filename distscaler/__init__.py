"""distscaler: a rank-consistent gradient (loss) scaler for mixed-precision PyTorch training.

``distscaler.GradScaler`` is a drop-in for ``torch.amp.GradScaler`` whose skip decision and scale
update are agreed by every rank in one collective per optimizer step.
"""

from __future__ import annotations

from .attribution import OverflowEntry, OverflowReport
from .config import ScalerConfig
from .errors import CallOrderError, LossScaleAtMinimumError, UnknownLayoutError
from .scaler import GradScaler, OptState
from .telemetry import SkipTotals

__all__ = [
    "CallOrderError",
    "GradScaler",
    "LossScaleAtMinimumError",
    "OptState",
    "OverflowEntry",
    "OverflowReport",
    "ScalerConfig",
    "SkipTotals",
    "UnknownLayoutError",
    "__version__",
]

__version__ = "0.1.0"
