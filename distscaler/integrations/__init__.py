"""Integrations of ``distscaler.GradScaler`` with training frameworks.

* [`distscaler.integrations.accelerate`][distscaler.integrations.accelerate]: HuggingFace Accelerate
  (``install(accelerator)``).
* [`distscaler.integrations.transformers`][distscaler.integrations.transformers]: Transformers'
  ``Trainer`` and TRL's trainers (``install(trainer)``).
* [`distscaler.integrations.torchtitan`][distscaler.integrations.torchtitan]: torchtitan's
  ``Trainer`` in fp16 (``--module distscaler.integrations.torchtitan --config llama3.llama3_8b``,
  ``fp16(config)``).
* [`distscaler.integrations.torchft`][distscaler.integrations.torchft]: torchft's fault-tolerant
  replica groups (``install(manager, optimizer)``).

Each integration imports its framework when it is imported, so ``import distscaler`` never needs
them.
"""

__all__: list[str] = []
