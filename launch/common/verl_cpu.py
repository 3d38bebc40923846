"""Run verl's FSDP training engine on CPU processes (gloo), for the tests and the verl job.

verl is written for accelerators: it picks its platform (``cuda``, ``npu``...) from what the
machine has, looks its engines up by that device name, and builds FSDP1 with
``sync_module_states=True`` on ``device_id=get_device_id()``. None of that is what distscaler's
integration is about, so each gets a stand-in here, in the test and launch code only;
``distscaler.integrations.verl`` patches nothing. Every stand-in, and why (verl 0.9.1):

* :class:`PlatformCPU`, registered with verl's own ``PlatformRegistry`` (its plugin mechanism for
  new hardware) and made current with ``set_platform``: ``get_device_name()`` says ``"cpu"``, so
  verl moves the model, the batch and the optimizer to the CPU, builds its device meshes for the
  CPU and asks for gloo. verl ships no CPU platform.
* ``VERL_ENGINE_DEVICE=cuda``: verl registers its FSDP engines for ``"cuda"`` and ``"npu"`` only
  (``EngineRegistry.register(..., device=["cuda", "npu"])``); the variable is verl's own override
  of the device its registry looks the engine up by.
* the platform's device module is ``torch.cpu`` plus no-op stand-ins for the ``torch.cuda`` calls
  verl makes on it (``empty_cache``, ``memory_allocated``...).
* ``current_device()`` returns ``torch.device("cpu")``: verl passes it as FSDP1's ``device_id``
  (an int would mean a CUDA device) and moves tensors ``.to()`` it.
* FSDP1's ``sync_module_states=True`` broadcasts the module from rank 0, and first refuses CPU
  parameters ("The module has CPU parameters or buffers when `sync_module_states=True`, which
  requires them to be on GPU", ``_check_module_states_for_sync_module_states`` in torch's
  ``fsdp/_init_utils.py``): the check is lifted, the broadcast (on gloo) is kept.
* ``save_checkpoint`` moves a model whose parameters are on ``"cpu"`` "back to the GPU" first
  (``load_fsdp_model_to_gpu``, for offloaded parameters); on a CPU process that move is to where
  the model already is, and FSDP2's ``module.to`` refuses it ("Couldn't swap FSDPEmbedding.weight"):
  the engine module's name for it does nothing here.
* :func:`rebuild_stock_scaler_for_cpu`: the stock engine's scaler, for comparisons (its doc).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["PlatformCPU", "rebuild_stock_scaler_for_cpu", "use_cpu_platform"]


class _CpuDeviceModule(ModuleType):
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes on its device module
    (``empty_cache``, ``memory_allocated``, ``get_rng_state``...): nothing to free, no device
    memory, the CPU generator."""

    def __getattr__(self, name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
            return getattr(torch, name.replace("_all", ""))
        if name.startswith(("memory_", "max_memory_", "mem_get_info", "reset_")):
            return lambda *args, **kwargs: (0, 0) if name == "mem_get_info" else 0
        return lambda *args, **kwargs: None


_CPU_DEVICE_MODULE = _CpuDeviceModule("verl_cpu_device")


def _platform_base() -> type:
    from verl.plugin.platform.platform_base import PlatformBase

    return PlatformBase


def _make_platform_cls() -> type:
    base = _platform_base()

    class PlatformCPU(base):  # type: ignore[misc, valid-type]
        """verl's platform for CPU processes: device ``"cpu"``, gloo, nothing to synchronize."""

        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self) -> ModuleType:
            return _CPU_DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:
            return torch.device("cpu")

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


PlatformCPU: type | None = None


def use_cpu_platform() -> None:
    """Make verl run on this process's CPU: its platform, its engine lookup (see the module doc).

    Call before verl builds anything (before ``EngineRegistry.new``); idempotent.
    """
    global PlatformCPU
    from verl.plugin.platform import platform_manager

    if PlatformCPU is None:
        PlatformCPU = platform_manager.PlatformRegistry.register(platform="cpu")(
            _make_platform_cls()
        )
    platform_manager.set_platform(PlatformCPU())
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    from torch.distributed.fsdp import _init_utils

    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.load_fsdp_model_to_gpu = lambda module: None


def rebuild_stock_scaler_for_cpu(engine: Any) -> None:
    """verl builds ``ShardedGradScaler(growth_interval=400)`` for torch's default device
    ``"cuda"``, which torch disables on a CPU process (with a warning: fp16 with no loss scale and
    no inf check). Rebuilt with the same settings for ``"cpu"``, it runs what it runs on a GPU: the
    stock side of a side-by-side comparison. Only for verl's stock engine in fp16."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if isinstance(engine.scaler, ShardedGradScaler):
        engine.scaler = ShardedGradScaler("cpu", growth_interval=400)
