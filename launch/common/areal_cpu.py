"""Run AReaL's FSDP engine on CPU processes (gloo), for the tests and the AReaL job.

AReaL 1.0.4 runs on a CPU as it is: with no accelerator it picks its own ``CpuPlatform``
(``areal/infra/platforms/cpu.py``: device ``"cpu"``, gloo), and its engine builds FSDP2 on a CPU
device mesh. Two things differ from a GPU run, here in the test and launch code only;
``distscaler.integrations.areal`` sets neither:

* ``LOCAL_RANK``: AReaL's engine reads it (``_create_device_model``); torchrun sets it, the test
  harness's spawned ranks do not: the rank is used (one machine).
* torch.compile off (``torch._dynamo.config.disable``): AReaL compiles its log-prob gather
  (``areal/utils/functional/vocab_parallel.py``) with inductor, which on a CPU means C++
  compilation: 60-80 s per process on a 2-core machine, for a function of a few ops. Eager runs
  the same ops; stock and ours alike.
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["prepare"]


def prepare() -> None:
    """Set what AReaL's engine needs on a CPU process (module doc); idempotent. Call after the
    process group is initialized, before AReaL builds an engine."""
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    import torch._dynamo

    torch._dynamo.config.disable = True
