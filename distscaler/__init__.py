"""distscaler: a rank-consistent gradient (loss) scaler for mixed-precision PyTorch training.

``distscaler.GradScaler`` is a drop-in for ``torch.amp.GradScaler`` whose skip decision and scale
update are agreed by every rank in one collective per optimizer step.
"""

from __future__ import annotations

from ._scaler import GradScaler, OptState
from .attribution import OverflowEntry, OverflowReport
from .config import ScalerConfig
from .errors import (
    CallOrderError,
    LossScaleAtMinimumError,
    ReplicaMismatchError,
    TrainingCollapsedError,
    UnknownLayoutError,
)
from .replica_check import ReplicaLedger, ReplicaMismatch
from .telemetry import CollapseReport, SkipReport, SkipTotals

__all__ = [
    "CallOrderError",
    "CollapseReport",
    "GradScaler",
    "LossScaleAtMinimumError",
    "OptState",
    "OverflowEntry",
    "OverflowReport",
    "ReplicaLedger",
    "ReplicaMismatch",
    "ReplicaMismatchError",
    "ScalerConfig",
    "SkipReport",
    "SkipTotals",
    "TrainingCollapsedError",
    "UnknownLayoutError",
    "__version__",
]


def _version() -> str:
    """The installed distribution's version (its metadata); in a source tree that is not
    installed, the version pyproject.toml declares; ``"0+unknown"`` without either."""
    import importlib.metadata
    import re
    from pathlib import Path

    try:
        return importlib.metadata.version("distscaler")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        text = pyproject.read_text(encoding="utf-8") if pyproject.is_file() else ""
        ours = re.search(r'^name = "distscaler"$', text, re.MULTILINE)
        match = re.search(r'^version = "([^"]+)"$', text, re.MULTILINE)
        return match[1] if ours and match else "0+unknown"


#: The version of distscaler, from the package metadata (``importlib.metadata.version``).
__version__: str = _version()
