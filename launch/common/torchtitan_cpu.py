"""torchtitan 0.3.0 on CPU processes (gloo): the shims it needs there and a tiny llama3, whatever
the job's data and config. For the tests and ``launch/train_torchtitan.py`` only (the job's byte
data and config function are in ``launch/torchtitan_job.py``); the library
(``distscaler.integrations.torchtitan``) patches nothing.

torchtitan is written for GPUs and a torch nightly. On a machine without GPUs, with torch 2.13, it
fails in seven places; :func:`apply_cpu_shims` (before anything imports torchtitan's trainer),
:func:`cpu_settings` (on the config) and :func:`adapt_pipeline_schedule` work around each:

1. ``import torchtitan.trainer`` imports triton (``distributed/minimal_async_ep/kernels.py``, expert
   parallel kernels), which CPU builds of torch do not bring: a stand-in module for those kernels.
2. ``torchtitan.tools.utils`` takes ``"cuda"`` as the device type when no accelerator is present
   (``_get_available_device_type() or "cuda"``): the device type becomes ``"cpu"`` and the device
   module a small stand-in for ``torch.cuda``'s memory queries.
3. After the first step the Trainer calls ``torch.distributed.set_timeout``, which torch 2.13 does
   not have (the nightly torchtitan 0.3.0 asks for has it): a no-op there, only when missing.
4. FlexAttention has no CPU backward: SDPA (``is_causal``) in :func:`tiny_llama3` (the data here
   has no document boundaries, so causal attention is the same mask).
5. FSDP2 reduce-scatters with ``PREMUL_SUM`` (torchtitan sets a gradient divide factor of 1) and
   gloo has no ``PREMUL_SUM``: plain sums (``set_force_sum_reduction_for_comms``, the same values:
   a factor of 1) after parallelizing, through the model spec's ``parallelize_fn``.

6. (torch 2.13, pipeline parallel only) torchtitan steps its pipeline schedule with the nightly's
   ``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``: :func:`adapt_pipeline_schedule`.
7. (torch 2.13) torchtitan's default ``spmd_types`` backend hands ``fully_shard`` the whole SPMD
   mesh, which torch 2.13 refuses ("all parameters must be DTensors on the full SPMD mesh"):
   ``spmd_backend="partial_dtensor"`` (DTensors on the model-parallel axes, FSDP2 on its own mesh).

Also: no CUDA graphs (CUDA only), no compile, no validation (no held-out data here).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import types
from typing import Any

import torch

__all__ = ["adapt_pipeline_schedule", "apply_cpu_shims", "cpu_settings", "tiny_llama3"]

_SHIMMED = False


def apply_cpu_shims(*, cpu: bool | None = None) -> None:
    """Apply shims 1-3 of the module docstring where needed (idempotent). Call before importing
    ``torchtitan.trainer`` (or ``distscaler.integrations.torchtitan``) in every process.

    Args:
        cpu: train on the CPU (shim 2): True for the tests, which run gloo CPU ranks on GPU
            machines too; None: when torch sees no GPU.
    """
    global _SHIMMED
    if _SHIMMED:
        return
    _SHIMMED = True
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if importlib.util.find_spec("triton") is None:
        # 1. Only expert-parallel code calls these kernels; a module whose every name is a
        #    placeholder satisfies ``from ...kernels import (...)`` without faking triton for torch.
        name = "torchtitan.distributed.minimal_async_ep.kernels"
        stub = types.ModuleType(name, "stand-in: triton is not installed (CPU build of torch)")
        stub.__getattr__ = _unavailable_kernel  # type: ignore[method-assign]
        sys.modules[name] = stub
    import torchtitan.tools.utils as tt_utils

    if cpu and tt_utils.device_type != "cpu":
        # 2. Before the modules that import ``device_type``/``device_module`` by name load.
        tt_utils.device_type = "cpu"
        tt_utils.device_module = _CpuDeviceModule()
        early = [
            name
            for name, module in list(sys.modules.items())
            if name.startswith("torchtitan.")
            and module is not tt_utils
            and "device_type" in getattr(module, "__dict__", {})
        ]
        if early:
            raise RuntimeError(
                f"apply_cpu_shims() must run before these import torchtitan's device type: {early}"
            )
    if not hasattr(torch.distributed, "set_timeout"):
        # 3. torch 2.13 has no set_timeout; the timeouts the Trainer shortens only bound hangs.
        torch.distributed.set_timeout = lambda timeout, group=None: None  # type: ignore[attr-defined]


def _unavailable_kernel(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} needs triton (expert parallelism on GPUs)")

    return kernel


class _CpuDeviceModule:
    """What torchtitan asks ``torch.cuda`` for, answered for the CPU (shim 2)."""

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total)


def adapt_pipeline_schedule(trainer: Any) -> None:
    """Shim 6 (torch 2.13): torchtitan 0.3.0 steps its pipeline schedule with the nightly keywords
    ``step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)``; torch 2.13's ``step(*args, target=, ...)``
    would take them for model inputs. Its ``_step_microbatches`` takes the micro-batch lists as
    they are: the trainer's schedule gets a ``step`` that calls it, after what 2.13's ``step``
    does first. A no-op without pipeline parallelism or on a torch that has the keywords."""
    import inspect

    schedule = getattr(trainer, "pp_schedule", None)
    if schedule is None or "arg_mbs" in inspect.signature(schedule.step).parameters:
        return

    def step(
        *,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        losses: Any = None,
        return_outputs: bool = True,
        loss_kwargs: Any = None,
    ) -> None:
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        schedule._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )

    schedule.step = step


# ----------------------------------------------------------------------------- model, settings


def tiny_llama3(
    *, dim: int = 64, n_layers: int = 2, n_heads: int = 4, vocab_size: int = 256
) -> Any:
    """torchtitan's llama3 debug model shrunk (its layer builder, dims, SDPA attention), as a
    ``ModelSpec`` whose ``parallelize_fn`` also applies shim 5."""
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
        model_registry,
    )
    from torchtitan.models.llama3.model import Llama3Model

    spec = model_registry("debugmodel")
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)
        ),
        layers=_build_llama3_layers(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
            rope=ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=4096, theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )
    for _, _, parent, attr in config.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())  # 4.
    return dataclasses.replace(
        spec, flavor="tiny", model=config, parallelize_fn=_sum_reductions(spec.parallelize_fn)
    )


def _sum_reductions(parallelize_fn: Any) -> Any:
    def parallelize(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # 5.
        return model

    return parallelize


def cpu_settings(config: Any, *, seq_len: int = 32) -> Any:
    """``config`` (a ``Trainer.Config``) set up for CPU processes, whatever its data: the tiny
    llama3 (shims 4 and 5), shim 7, no CUDA graphs, no compile, no validation, the loss over the
    byte vocabulary in chunks no longer than ``seq_len``."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    config.model_spec = tiny_llama3()
    config.hf_assets_path = "."
    config.training.seq_len = seq_len
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"  # 7.
    config.compile.enable = False
    config.validator.enable = False
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss.loss_fn = CrossEntropyLoss.Config(global_vocab_size=256)
        config.loss.num_chunks = min(config.loss.num_chunks, seq_len)
    return config
