from __future__ import annotations

import os

import pytest
import torch

# Tiny tensors: intra-op threads only contend with the other xdist worker on a 2-core runner.
torch.set_num_threads(1)

#: On GPU CI runners: the number of GPUs the machine must show, so that the GPU tests cannot pass
#: by skipping (a runner whose container lost its GPUs fails instead of going green).
REQUIRE_GPUS_ENV = "DISTSCALER_REQUIRE_GPUS"


def _required_gpus() -> int:
    value = os.environ.get(REQUIRE_GPUS_ENV, "").strip()
    if not value:
        return 0
    try:
        required = int(value)
    except ValueError:
        required = -1
    if required < 0:
        raise pytest.UsageError(
            f"{REQUIRE_GPUS_ENV} must be a non-negative integer (number of GPUs), got: {value!r}"
        )
    return required


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    required = _required_gpus()
    if num_gpus < required:
        raise pytest.UsageError(
            f"{REQUIRE_GPUS_ENV}={required} but torch sees {num_gpus} CUDA GPU(s) "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); with Docker, pass --gpus all"
        )
    for item in items:
        if "cuda" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
