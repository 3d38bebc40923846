"""Integrations of ``distscaler.GradScaler`` with training frameworks.

* :mod:`distscaler.integrations.accelerate`: HuggingFace Accelerate (``install(accelerator)``).

Each integration imports its framework when it is imported, so ``import distscaler`` never needs
them.
"""

__all__: list[str] = []
