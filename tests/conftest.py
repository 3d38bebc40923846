from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The helpers (_harness, _scenarios) are imported by name, here and in spawned ranks.
sys.path.insert(0, str(Path(__file__).parent))

# Tiny tensors: intra-op threads only contend with the other xdist worker on a 2-core runner.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "cuda" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
