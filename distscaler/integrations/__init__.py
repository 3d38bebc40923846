"""Integrations of ``distscaler.GradScaler`` with training frameworks.

* :mod:`distscaler.integrations.accelerate`: HuggingFace Accelerate (``install(accelerator)``).
* :mod:`distscaler.integrations.transformers`: Transformers' ``Trainer`` and TRL's trainers
  (``install(trainer)``).
* :mod:`distscaler.integrations.torchtitan`: torchtitan's ``Trainer`` in fp16
  (``--module distscaler.integrations.torchtitan --config llama3.llama3_8b``, ``fp16(config)``).
* :mod:`distscaler.integrations.torchft`: torchft's fault-tolerant replica groups
  (``install(manager, optimizer)``).

Each integration imports its framework when it is imported, so ``import distscaler`` never needs
them.
"""

__all__: list[str] = []
