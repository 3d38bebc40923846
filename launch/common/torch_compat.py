"""Where a torch API the job uses moved between the torch versions distscaler supports.

The one place that knows; everything else calls these helpers. Each entry names the versions.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

__all__ = ["pipeline_grad_kwargs"]


@functools.cache
def _stage_takes_grad_args() -> bool:
    from torch.distributed.pipelining import PipelineStage

    return "output_grads" in inspect.signature(PipelineStage.__init__).parameters


def pipeline_grad_kwargs(
    output_grads: torch.Tensor | None, input_grads: torch.Tensor | None
) -> dict[str, Any]:
    """``PipelineStage``'s static gradient shapes, for the torch versions that take them.

    torch 2.13 and 2.14 (checked) take ``output_grads=``/``input_grads=`` and, with static shapes,
    need them to know what gradient a stage sends back; torch 2.6 and 2.7 (checked) have no such
    arguments and take the gradients' shapes from ``output_args``/``input_args`` (the same shapes
    in the job). Returns the keyword arguments to pass (none where torch lacks them).
    """
    if not _stage_takes_grad_args():
        return {}
    return {"output_grads": output_grads, "input_grads": input_grads}
