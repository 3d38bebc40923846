"""slime scenarios run inside spawned gloo ranks (tests/test_slime.py checks the results).

Nothing here asserts: every rank runs the same collectives whatever it sees.

The step is slime's own ``train_one_step`` (``slime/backends/megatron_utils/model.py``), imported
from slime's source where it imports (:data:`SLIME`: slime is not on PyPI); elsewhere (CI) a copy
of its optimizer part (:func:`standin_train_one_step`, lines 552-702 at
``distscaler.integrations.slime.TESTED_COMMIT`` minus the forward, the MTP check and the metrics).
Around it: megatron-core's own machinery on a tiny ``MegatronModule`` (tests/_megatron_scenarios.py:
fp16 parameters, Megatron's ``DistributedDataParallel`` with fp32 gradient buffers, what slime's
``--accumulate-allreduce-grads-in-fp32`` gives, and ``get_megatron_optimizer``: the distributed
optimizer, slime's default), slime's ``get_optimizer_param_scheduler``, Megatron's global args
(``set_args``) with what slime's step reads, ``check_for_nan_in_loss_and_grad=False`` (Megatron's
setting in fp16 with a dynamic scale). slime's forward-backward is replaced
(``get_forward_backward_func``): its packed-sequence forward needs Transformer Engine; the
stand-in runs the tiny model's forward and backward per micro-batch, with the loss scaled by the
optimizer (``optimizer.scale_loss``, as Megatron's schedule does through ``config.grad_scale_func``),
and returns slime's per-micro-batch log dict. "stock" runs without the hook; "ours" with
``args.custom_megatron_before_train_step_hook_path = distscaler.integrations.slime.HOOK``.
"""

from __future__ import annotations

import math
import typing
from argparse import Namespace
from typing import Any

import torch
import torch.distributed as dist

from common.megatron_cpu import cpu_megatron

if not hasattr(typing, "override"):  # megatron.training uses Python 3.12's typing.override
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]

try:
    from common.megatron_cpu import install_stubs

    install_stubs()
    import slime.backends.megatron_utils.model as slime_model

    SLIME: Any = slime_model
except ImportError:
    SLIME = None

INF_RANK = 1
MICRO_BATCHES = 2
GLOBAL_BATCH = 8


def slime_args(*, ours: bool, loss_scale_window: int = 4) -> Namespace:
    """Megatron's global args with what slime's ``train_one_step`` and
    ``get_optimizer_param_scheduler`` read."""
    from distscaler.integrations import slime as ds_slime

    return Namespace(
        fp16=True,
        check_for_nan_in_loss_and_grad=False,
        custom_megatron_before_train_step_hook_path=ds_slime.HOOK if ours else None,
        ci_test=False,
        enable_mtp_training=False,
        calculate_per_token_loss=False,
        seq_length=8,
        micro_batch_size=4,
        decoder_seq_length=None,
        rollout_top_p=1.0,
        # get_optimizer_param_scheduler's: a linear warmup over 4 steps.
        num_rollout=10,
        rollout_batch_size=GLOBAL_BATCH,
        n_samples_per_prompt=1,
        global_batch_size=GLOBAL_BATCH,
        lr_decay_iters=None,
        lr_wsd_decay_iters=None,
        lr_warmup_fraction=None,
        lr_warmup_iters=4,
        lr_warmup_init=0.0,
        lr=1e-3,
        min_lr=0.0,
        lr_decay_style="constant",
        start_weight_decay=0.0,
        end_weight_decay=0.0,
        weight_decay_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
        lr_wsd_decay_style="linear",
        loss_scale_window=loss_scale_window,
    )


class Run:
    """One model + optimizer + scheduler, and the state the stand-in forward-backward needs."""

    def __init__(self, rank: int, *, ours: bool, loss_scale_window: int = 4) -> None:
        import _megatron_scenarios as M
        from megatron.training import global_vars

        self.rank = rank
        self.args = slime_args(ours=ours, loss_scale_window=loss_scale_window)
        global_vars._GLOBAL_ARGS = self.args  # what set_args does, without its "set once" check
        self.model, self.optimizer = M.build(
            rank, dist_opt=True, experts=False, loss_scale_window=loss_scale_window
        )
        self.scheduler = scheduler(self.args, self.optimizer)
        self.inf_steps: tuple[int, ...] = ()
        self.step = -1
        self.seen: list[float] = []  # |main grads| the inner optimizer stepped with, per step

    def forward_backward(self, **kwargs: Any) -> list[dict[str, Any]]:
        """Stands for Megatron's schedule running slime's ``forward_step`` (module doc)."""
        import _megatron_scenarios as M

        out = []
        for mb in range(MICRO_BATCHES):
            gen = torch.Generator().manual_seed(100 * self.step + 10 * mb + self.rank)
            x = torch.randn(4, M.HIDDEN, generator=gen).half()
            loss = self.model(x)
            self.optimizer.scale_loss(loss).backward()
            out.append({"keys": ["loss"], "values": torch.tensor([1.0, float(loss)])})
        self.model.finish_grad_sync()
        if self.step in self.inf_steps and self.rank == INF_RANK:
            M.inject(self.model, "dense")
        return out


def scheduler(args: Namespace, optimizer: Any) -> Any:
    if SLIME is not None:
        return SLIME.get_optimizer_param_scheduler(args, optimizer)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    steps = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=0.0,
        lr_warmup_steps=args.lr_warmup_iters * steps,
        lr_decay_steps=args.num_rollout * steps,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=args.num_rollout * steps,
        wd_incr_style="constant",
    )


def standin_train_one_step(
    args: Any,
    rollout_id: int,
    step_id: int,
    data_iterator: Any,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    num_microbatches: int,
    step_global_batch_size: int,
    forward_backward: Any = None,
) -> tuple[dict[str, float], float]:
    """slime's ``train_one_step`` at the tested commit, its optimizer part as written."""
    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if args.custom_megatron_before_train_step_hook_path:
        from importlib import import_module

        module, name = args.custom_megatron_before_train_step_hook_path.rsplit(".", 1)
        hook = getattr(import_module(module), name)
        hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)
    forward_backward()
    valid_step = True
    grad_norm = float("nan")
    if not getattr(args, "check_for_nan_in_loss_and_grad", True):
        found_inf_flag = optimizer.prepare_grads()
        if found_inf_flag:
            valid_step = False
        else:
            grad_norm = optimizer.get_grad_norm()
            if isinstance(grad_norm, torch.Tensor):
                valid_step = not (torch.isnan(grad_norm) or torch.isinf(grad_norm))
            else:
                valid_step = not (math.isnan(grad_norm) or math.isinf(grad_norm))
    if valid_step:
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        assert update_successful
        opt_param_scheduler.step(increment=step_global_batch_size)
    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    return {}, grad_norm


def _main_grad_sum(optimizer: Any) -> float:
    return sum(float(p.grad.abs().sum()) for p in optimizer.get_parameters() if p.grad is not None)


def _scaler_entry(state: dict[str, Any]) -> dict[str, float]:
    """Megatron's ``"grad_scaler"`` entry of an optimizer state dict, as numbers."""
    return {k: float(torch.as_tensor(v).reshape(-1)[0]) for k, v in state["grad_scaler"].items()}


def _scale(optimizer: Any) -> float:
    return float(optimizer.get_loss_scale().reshape(-1)[0])


def train(run: Run, steps: range) -> list[dict[str, Any]]:
    """slime's ``train_one_step`` per step; per step what it returned, the scale, the LR, whether
    the parameters changed, and the size of the main gradients the inner optimizer stepped with."""
    import _megatron_scenarios as M

    optimizer = run.optimizer
    records = []
    for step in steps:
        run.step = step
        seen: list[float] = []
        # What the inner optimizer steps with: its main gradients, read as it starts (wrapped
        # here, on this instance; after the hook's install the binding calls it).
        inner = optimizer.optimizer
        real_step = inner.step

        def spy_step(*a: Any, _real: Any = real_step, _seen: list = seen, **k: Any) -> Any:
            _seen.append(_main_grad_sum(optimizer))
            return _real(*a, **k)

        inner.step = spy_step
        # The unscaled gradients, for reference: Megatron's buffer over the scale, before the step.
        before = M._digest(run.model)
        with cpu_megatron():
            if SLIME is not None:
                real_fb = SLIME.get_forward_backward_func
                SLIME.get_forward_backward_func = lambda: run.forward_backward
                try:
                    _, grad_norm = SLIME.train_one_step(
                        run.args, 0, step, [iter([])], [run.model], optimizer, run.scheduler,
                        MICRO_BATCHES, GLOBAL_BATCH,
                    )  # fmt: skip
                finally:
                    SLIME.get_forward_backward_func = real_fb
            else:
                _, grad_norm = standin_train_one_step(
                    run.args, 0, step, None, [run.model], optimizer, run.scheduler,
                    MICRO_BATCHES, GLOBAL_BATCH, forward_backward=run.forward_backward,
                )  # fmt: skip
        del inner.step
        records.append(
            {
                "step": step,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "scale": _scale(optimizer),
                "lr": float(optimizer.param_groups[0]["lr"]),
                "changed": M._digest(run.model) != before,
                "stepped_main_grads": seen[0] if seen else None,
            }
        )
    return records


def reference_grad_sum(rank: int, step: int) -> float:
    """|main grads| of one step, unscaled once, computed apart: a stock optimizer's
    ``prepare_grads`` alone (one copy, one unscale) after the same backward."""
    run = Run(rank, ours=False)
    run.step = step
    run.optimizer.zero_grad()
    run.forward_backward()
    run.optimizer.prepare_grads()
    return _main_grad_sum(run.optimizer)


def everything(rank: int, world_size: int) -> dict[str, Any]:
    """Every scenario, on every rank (inside Megatron's CPU stand-ins)."""
    with cpu_megatron():
        return _everything(rank, world_size)


def _everything(rank: int, world_size: int) -> dict[str, Any]:
    import _megatron_scenarios as M

    from distscaler.integrations import megatron as ds_megatron

    M.init_parallel(world_size)
    out: dict[str, Any] = {"slime": SLIME is not None}
    out["reference_step0"] = reference_grad_sum(rank, 0)
    # (a) clean steps: the main gradients the optimizer steps with, the scale's growth.
    for name, ours in (("stock", False), ("ours", True)):
        run = Run(rank, ours=ours)
        out[f"{name}_clean"] = train(run, range(5))
        out[f"{name}_installed"] = ds_megatron.installed_scaler(run.optimizer) is not None
    # (b) an inf in rank 1's gradient at step 1; ours saves its state after step 3 (Megatron's
    # optimizer state dict, what slime's checkpoint holds) and goes on one more step.
    for name, ours in (("stock", False), ("ours", True)):
        run = Run(rank, ours=ours, loss_scale_window=1000)
        run.inf_steps = (1,)
        out[f"{name}_inf"] = train(run, range(4))
        if ours:
            state = run.optimizer.state_dict()
            out["ours_saved"] = _scaler_entry(state)
            out["ours_inf"] += train(run, range(4, 5))
            out["ours_after_step4"] = _scaler_entry(run.optimizer.state_dict())
            totals = ds_megatron.installed_scaler(run.optimizer).skip_totals
            out["ours_totals"] = (totals.num_updates, totals.num_skipped)
        # A second unscale of a step's main gradients: Megatron's own prepare_grads after the
        # step's (the one optimizer.step() runs in stock slime), called on the optimizer itself.
        run.step = 9
        run.optimizer.zero_grad()
        run.forward_backward()
        run.optimizer.prepare_grads()
        once = _main_grad_sum(run.optimizer)
        try:
            type(run.optimizer).prepare_grads(run.optimizer)
            out[f"{name}_second_unscale"] = "no error"
        except Exception as e:  # noqa: BLE001 - the error is the result
            out[f"{name}_second_unscale"] = f"{type(e).__name__}: {e}"
        out[f"{name}_second_unscale_ratio"] = _main_grad_sum(run.optimizer) / once
        # The same, on the (one) sub-optimizer, Megatron's MixedPrecisionOptimizer method.
        (sub,) = getattr(run.optimizer, "chained_optimizers", [run.optimizer])
        try:
            type(sub).prepare_grads(sub)
            out[f"{name}_sub_second_unscale"] = "no error"
        except Exception as e:  # noqa: BLE001 - the error is the result
            out[f"{name}_sub_second_unscale"] = f"{type(e).__name__}: {e}"
        out[f"{name}_sub_second_unscale_ratio"] = _main_grad_sum(run.optimizer) / once
    # (c) resume: slime loads the checkpoint into the stock optimizer, then the hook installs.
    run = Run(rank, ours=True, loss_scale_window=1000)
    run.optimizer.load_state_dict(state)
    out["resumed_before_hook"] = _scale(run.optimizer)
    out["resumed"] = train(run, range(4, 5))
    out["resumed_state"] = _scaler_entry(run.optimizer.state_dict())
    # distscaler's own counters are not in Megatron's keys: they start again at the resume.
    totals = ds_megatron.installed_scaler(run.optimizer).skip_totals
    out["resumed_totals"] = (totals.num_updates, totals.num_skipped)
    dist.barrier()
    return out
