"""A stand-in for NeMo-RL's DTensor policy worker (v2), for where NeMo-RL is not installed (CI).

NeMo-RL is not on PyPI (its ``nemo-rl`` there is a 0.0.0 placeholder) and CI installs from PyPI
only, so CI cannot run the worker itself (tests/_nemo_rl_scenarios.py does, where NeMo-RL's source
is importable). This module is what ``distscaler.integrations.nemo_rl`` relies on of the worker
(its module docstring lists it), written the way NeMo-RL writes it at
``distscaler.integrations.nemo_rl.TESTED_COMMIT``
(``nemo_rl/models/policy/workers/dtensor_policy_worker_v2.py``), minus Ray, Automodel and the
batching:

* ``train`` is decorated as NeMo-RL decorates it (``wrap_with_nvtx_name``: the function kept in
  the decorator's closure, no ``functools.wraps``);
* per global batch: ``self.optimizer.zero_grad()``, a backward per micro-batch of what the loss
  function returns (times the data-parallel size, as NeMo-RL's ``automodel_forward_backward``),
  the module-global ``scale_grads_and_clip_grad_norm`` (Automodel's, for a dense model: torch's
  clip over the DTensor gradients, the norm as a float), the module-global
  ``warn_if_inf_grad_norm``, ``self.optimizer.step()``; after the global batches one
  ``self.scheduler.step()``; metrics ``grad_norm`` (a CPU float32 tensor, the last global
  batch's), ``global_loss``, ``lr``;
* FSDP2 (``fully_shard`` per layer and at the root) with NeMo-RL's mixed-precision policy
  (``param_dtype`` the precision, ``reduce_dtype``/``output_dtype`` float32), fp32 master weights;
* ``__init__(config, weights_path=None, optimizer_path=None, init_optimizer=True, ...)`` loads a
  checkpoint when given one, as NeMo-RL's resume does; ``save_checkpoint(weights_path,
  optimizer_path=None, tokenizer_path=None, checkpointing_cfg=None)`` (raising NeMo-RL's
  ``ValueError`` without ``checkpointing_cfg``, before it writes anything) and
  ``load_checkpoint(weights_path, optimizer_path=None)``;
* the attributes ``dtype``, ``model``, ``optimizer``, ``scheduler``, ``device_mesh``,
  ``moe_mesh``, ``cpu_offload``, ``max_grad_norm``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WIDTH = 32

warnings_printed: list[float] = []


def wrap_with_nvtx_name(name: str) -> Any:
    """NeMo-RL's decorator (``nemo_rl/utils/nsys.py``), its NVTX range left out (CPU)."""

    def decorator(func: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        return wrapper

    return decorator


def scale_grads_and_clip_grad_norm(
    max_grad_norm: float | None,
    model_parts: list[torch.nn.Module],
    *,
    norm_type: float = 2.0,
    pp_enabled: bool = False,
    device_mesh: Any = None,
    moe_mesh: Any = None,
    ep_axis_name: str | None = None,
    pp_axis_name: str | None = None,
    foreach: bool = True,
    num_label_tokens: int | None = None,
    dp_group_size: int | None = None,
) -> float:
    """Automodel's, for a dense model without pipeline parallelism: ``0.0`` without clipping,
    else torch's ``clip_grad_norm_`` over the (DTensor) gradients, the norm as a float."""
    if max_grad_norm is None:
        return 0.0
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(
        params, max_grad_norm, norm_type, error_if_nonfinite=False, foreach=foreach
    )
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm.item())


def warn_if_inf_grad_norm(grad_norm: Any) -> None:
    """NeMo-RL's prints a diagnostic on rank 0 when the norm is inf (and the step goes on)."""
    if torch.isinf(torch.as_tensor(grad_norm)).any():
        warnings_printed.append(float(grad_norm))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)] + [torch.nn.Linear(WIDTH, 1)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


class StandInWorkerImpl:
    """NeMo-RL's ``DTensorPolicyWorkerV2Impl`` as the integration sees it (module doc)."""

    def __init__(
        self,
        config: dict[str, Any],
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        **kwargs: Any,
    ) -> None:
        self.cfg = config
        self.dtype = DTYPES[config["precision"]]
        self.max_grad_norm = config["max_grad_norm"]
        self.cpu_offload = config["dtensor_cfg"]["cpu_offload"]
        self.device_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        self.dp_mesh = self.device_mesh["dp"]
        self.dp_size = self.dp_mesh.size()
        self.moe_mesh = None
        torch.manual_seed(0)
        model = Model()
        mp = MixedPrecisionPolicy(
            param_dtype=self.dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
        for layer in model.layers:
            fully_shard(layer, mesh=self.device_mesh, mp_policy=mp)
        self.model = fully_shard(model, mesh=self.device_mesh, mp_policy=mp)
        self.optimizer = None
        self.scheduler = None
        if init_optimizer:
            kwargs_ = dict(config["optimizer"]["kwargs"])
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **kwargs_)
            warmup = config["warmup"]
            self.scheduler = torch.optim.lr_scheduler.LinearLR(
                self.optimizer, start_factor=0.1, end_factor=1.0, total_iters=warmup
            )
        if weights_path:
            self.load_checkpoint(weights_path, optimizer_path)

    @wrap_with_nvtx_name("dtensor_policy_worker_v2/train")
    def train(
        self,
        data: dict[str, torch.Tensor],
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """NeMo-RL's step sequence (module doc). ``data``: this rank's ``x`` and ``y``."""
        gbs = gbs or self.cfg["train_global_batch_size"]
        mbs = mbs or self.cfg["train_micro_batch_size"]
        local_gbs = gbs // self.dp_size
        total = torch.tensor(data["x"].shape[0])
        dist.all_reduce(total)
        num_global_batches = int(total.item()) // gbs
        losses = []
        grad_norm: Any = None
        self.model.train()
        for gb in range(num_global_batches):
            x = data["x"][gb * local_gbs : (gb + 1) * local_gbs]
            y = data["y"][gb * local_gbs : (gb + 1) * local_gbs]
            self.optimizer.zero_grad()
            mb_losses = []
            for start in range(0, local_gbs, mbs):
                out = self.model(x[start : start + mbs])
                loss, _ = loss_fn(out, y[start : start + mbs])
                if not eval_mode:
                    (loss * self.dp_size).backward()
                mb_losses.append(loss.item())
            if not eval_mode:
                grad_norm = scale_grads_and_clip_grad_norm(
                    self.max_grad_norm,
                    [self.model],
                    norm_type=2.0,
                    pp_enabled=False,
                    device_mesh=self.device_mesh,
                    moe_mesh=self.moe_mesh,
                    ep_axis_name=None,
                    pp_axis_name=None,
                    foreach=True,
                    num_label_tokens=1,
                    dp_group_size=self.dp_size,
                )
                grad_norm = torch.tensor(grad_norm, device="cpu", dtype=torch.float32)
                warn_if_inf_grad_norm(grad_norm)
                self.optimizer.step()
            losses.append(sum(mb_losses))
        self.optimizer.zero_grad()
        if not eval_mode:
            self.scheduler.step()
        return {
            "global_loss": torch.tensor(losses).sum(),
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: str | None = None,
        tokenizer_path: str | None = None,
        checkpointing_cfg: Any = None,
    ) -> None:
        if checkpointing_cfg is None:  # NeMo-RL's words (its Automodel checkpoint setup)
            raise ValueError("checkpointing_cfg must be provided when saving checkpoint")
        rank = dist.get_rank()
        os.makedirs(weights_path, exist_ok=True)
        torch.save(self.model.state_dict(), os.path.join(weights_path, f"model_{rank}.pt"))
        if optimizer_path:
            os.makedirs(optimizer_path, exist_ok=True)
            torch.save(
                {"optim": self.optimizer.state_dict(), "sched": self.scheduler.state_dict()},
                os.path.join(optimizer_path, f"optim_{rank}.pt"),
            )
        dist.barrier()

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        rank = dist.get_rank()
        self.model.load_state_dict(
            torch.load(os.path.join(weights_path, f"model_{rank}.pt"), weights_only=False)
        )
        if optimizer_path:
            state = torch.load(os.path.join(optimizer_path, f"optim_{rank}.pt"), weights_only=False)
            self.optimizer.load_state_dict(state["optim"])
            self.scheduler.load_state_dict(state["sched"])


def config(
    precision: str = "float16",
    *,
    max_grad_norm: float | None = 1.0,
    lr: float = 1e-2,
    warmup: int = 8,
    global_batch: int = 8,
    micro_batch: int = 2,
    distscaler: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The policy-config keys the stand-in (and the integration) read."""
    out: dict[str, Any] = {
        "precision": precision,
        "max_grad_norm": max_grad_norm,
        "train_global_batch_size": global_batch,
        "train_micro_batch_size": micro_batch,
        "dtensor_cfg": {"_v2": True, "enabled": True, "cpu_offload": False},
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": lr, "weight_decay": 0.0}},
        "warmup": warmup,
    }
    if distscaler is not None:
        out["distscaler"] = distscaler
    return out


# ----------------------------------------------------------------------------- scenarios (gloo)

INF_RANK = 1
#: The loss's factor: gradients of a size fp16 holds with the scale at its initial 65536.
FACTOR = 1e-2
#: The factor of the tiny-gradient case: gradients fp16 cannot hold unscaled.
TINY = 1e-9


def batch(step: int, rank: int, samples: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "x": torch.randn(samples, WIDTH, generator=g),
        "y": torch.randn(samples, 1, generator=g),
    }


def mse(factor: float = FACTOR) -> Any:
    def loss_fn(out: torch.Tensor, y: torch.Tensor, **_: Any) -> tuple[torch.Tensor, dict]:
        return (out - y).pow(2).mean() * factor, {}

    return loss_fn


def shards(worker: Any) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in worker.model.parameters()]


def build(cfg: dict[str, Any], *, ours: bool, **kwargs: Any) -> Any:
    from distscaler.integrations import nemo_rl as ds_nemo_rl

    cls = ds_nemo_rl.worker_class(StandInWorkerImpl) if ours else StandInWorkerImpl
    return cls(cfg, **kwargs)


def run(
    worker: Any,
    steps: range,
    *,
    inf_steps: tuple[int, ...] = (),
    factor: float = FACTOR,
    samples: int = 4,
) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    state = {"step": -1, "poisoned": False}
    param = next(iter(worker.model.parameters()))

    def poison(p: Any) -> None:  # once per step: the first global batch's gradient
        if state["step"] in inf_steps and rank == INF_RANK and not state["poisoned"]:
            p.grad.to_local().view(-1)[0] = float("inf")
            state["poisoned"] = True

    handle = param.register_post_accumulate_grad_hook(poison)
    out = []
    try:
        for step in steps:
            state.update(step=step, poisoned=False)
            before = shards(worker)
            metrics = worker.train(batch(step, rank, samples), mse(factor))
            after = shards(worker)
            out.append(
                {
                    "grad_norm": float(metrics["grad_norm"]),
                    "changed": any(not torch.equal(a, b) for a, b in zip(before, after)),
                    "finite": all(bool(torch.isfinite(t).all()) for t in after),
                    "lr": float(worker.optimizer.param_groups[0]["lr"]),
                    "metrics": {k: float(v) for k, v in metrics.items() if "distscaler" in k},
                }
            )
    finally:
        handle.remove()
    return out


def _refused(worker: Any, what: str) -> str:
    real = worker._distscaler_clip

    def clip(*args: Any, **kwargs: Any) -> Any:
        norm = real(*args, **kwargs)
        if what == "unscale":
            worker._distscaler_scaler.unscale_(worker._distscaler_step._optimizer)
        else:
            worker.optimizer.step()
        return norm

    worker._distscaler_clip = clip
    try:
        worker.train(batch(99, dist.get_rank()), mse())
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    finally:
        worker._distscaler_clip = real
    return "no error"


def everything(rank: int, world_size: int) -> dict[str, Any]:
    import tempfile

    from distscaler.integrations import nemo_rl as ds_nemo_rl

    root = [tempfile.mkdtemp(prefix="nemo-rl-standin-") if rank == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    out: dict[str, Any] = {}
    # Tiny gradients: fp32 (the reference), stock fp16, ours fp16.
    for name, precision, ours in (
        ("fp32", "float32", False),
        ("stock", "float16", False),
        ("ours", "float16", True),
    ):
        out[f"tiny_{name}"] = run(build(config(precision), ours=ours), range(1), factor=TINY)
    # An inf on rank 1 at step 1; ours saves after step 2 and resumes.
    del warnings_printed[:]
    out["stock"] = run(build(config(), ours=False), range(5), inf_steps=(1,))
    out["stock_warnings"] = list(warnings_printed)
    del warnings_printed[:]
    worker = build(config(), ours=True)
    out["ours"] = run(worker, range(3), inf_steps=(1,))
    weights, optim = os.path.join(root[0], "w"), os.path.join(root[0], "o")
    try:  # NeMo-RL's save needs its `checkpointing` settings; nothing is written without them
        worker.save_checkpoint(weights, optimizer_path=optim)
        out["save_without_cfg"] = "no error"
    except ValueError as e:
        out["save_without_cfg"] = f"{e}; written: {os.path.exists(optim)}"
    # every rank has looked before any writes: the ranks share the folder
    dist.barrier()
    worker.save_checkpoint(weights, optimizer_path=optim, checkpointing_cfg={"is_async": False})
    out["listing"] = sorted(os.listdir(optim))
    out["ours"] += run(worker, range(3, 5))
    out["ours_warnings"] = list(warnings_printed)
    out["ours_final"] = [t.tolist() for t in shards(worker)]
    out["module_untouched"] = (
        globals()["scale_grads_and_clip_grad_norm"].__module__ == __name__
        and StandInWorkerImpl.train.__closure__[0].cell_contents.__globals__ is globals()
    )
    resumed = build(config(), ours=True, weights_path=weights, optimizer_path=optim)
    out["resumed_scale"] = resumed._distscaler_scaler.get_scale()
    out["resumed"] = run(resumed, range(3, 5))
    out["resumed_final"] = [t.tolist() for t in shards(resumed)]
    out["refused_unscale"] = _refused(resumed, "unscale")
    # lr_on_skip="step" in the config.
    worker = build(config(distscaler={"lr_on_skip": "step"}), ours=True)
    out["ours_lr_step"] = run(worker, range(3), inf_steps=(1,))
    out["refused_step"] = _refused(worker, "step")
    # Two global batches per train() call, the first one's step skipped: the LR still steps.
    worker = build(config(), ours=True)
    out["two_batches"] = run(worker, range(2), inf_steps=(0,), samples=8)
    # No clipping (max_grad_norm None): stock reports 0.0, ours the norm.
    out["noclip_stock"] = run(build(config(max_grad_norm=None), ours=False), range(1))
    out["noclip_ours"] = run(build(config(max_grad_norm=None), ours=True), range(1))
    out["tested_commit"] = ds_nemo_rl.TESTED_COMMIT
    return out
