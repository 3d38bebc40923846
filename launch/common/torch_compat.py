"""Where a torch API the job uses moved between the torch versions distscaler supports.

The one place that knows; everything else calls these helpers. Each entry names the versions.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

__all__ = ["pipeline_eval", "pipeline_grad_kwargs"]


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


def pipeline_eval(
    schedule: Any, *args: Any, target: torch.Tensor | None = None, losses: list | None = None
) -> Any:
    """A forward-only pass of a single-stage pipeline ``schedule`` (``schedule.eval``), on every
    stage's rank; the last stage's per-micro-batch losses go to ``losses``.

    torch 2.13 and 2.14 (checked) have ``eval()`` on their schedules; torch 2.6 and 2.7 (checked)
    do not: there a schedule without a loss function over the same stage (``ScheduleGPipe``,
    which then runs no backward) does the forward, and the last stage applies the schedule's loss
    function to the whole batch (per-sequence losses concatenate the same either way). Call under
    ``torch.no_grad()``.
    """
    if hasattr(schedule, "eval"):
        return schedule.eval(*args, target=target, losses=losses)
    from torch.distributed.pipelining import ScheduleGPipe

    stage = schedule._stage
    has_backward = stage.has_backward  # a schedule sets it on its stage: restore the trainer's
    try:
        output = ScheduleGPipe(stage, schedule._n_microbatches).step(*args)
    finally:
        stage.has_backward = has_backward
    if output is not None and target is not None and losses is not None:
        losses.append(schedule._loss_fn(output, target))
    return output
