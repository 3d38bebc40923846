"""Several models, losses and optimizers: one scaler, one all_reduce per optimizer step.

    pip install numpy    # torch's CommDebugMode (torch.distributed.tensor.debug) imports it
    torchrun --standalone --nproc-per-node=2 examples/multiple_models.py

torch's recipe: one scaler serves every model and optimizer; ``scale`` each loss, ``unscale_``
(or ``clip_grad_norm_``) and ``step`` each optimizer, then one ``update``. Each optimizer's skip
is agreed on its own: one ``all_reduce`` per ``step`` (or ``clip_grad_norm_``), so two optimizers
cost two per iteration and ``update`` none. The script counts them with torch's
``CommDebugMode`` and checks the count. If one optimizer's gradients overflow, that
optimizer skips on every rank; the scale backs off once, at ``update``.
"""

import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler

if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
rank = dist.get_rank()
device_ids = [device.index] if device.type == "cuda" else None

torch.manual_seed(0)
model0 = DDP(torch.nn.Linear(32, 1).to(device), device_ids=device_ids)
model1 = DDP(
    torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(
        device
    ),
    device_ids=device_ids,
)
optimizer0 = torch.optim.AdamW(model0.parameters(), lr=1e-3)
optimizer1 = torch.optim.SGD(model1.parameters(), lr=1e-2, momentum=0.9)
scaler = GradScaler(device.type).register_model(model0).register_model(model1)

torch.manual_seed(1 + rank)
for _ in range(10):
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    optimizer0.zero_grad(set_to_none=True)
    optimizer1.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.float16):
        loss0 = torch.nn.functional.mse_loss(model0(x), y)
        loss1 = torch.nn.functional.smooth_l1_loss(model1(x), y)
    scaler.scale(loss0).backward()
    scaler.scale(loss1).backward()

    with CommDebugMode() as comm:
        # Clip only model0 (clip_grad_norm_ is optimizer0's collective; its step adds none).
        scaler.clip_grad_norm_(optimizer0, max_norm=1.0)
        scaler.step(optimizer0)
        scaler.step(optimizer1)
        scaler.update()
    assert comm.get_total_counts() == 2, comm.get_comm_counts()  # one per optimizer step

totals = scaler.skip_totals
if rank == 0:
    print(f"all_reduce per iteration: {comm.get_total_counts()} (2 optimizers)")
    print(
        f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
    )
# Free what holds the process group (the DDP model) before destroying it: left to interpreter
# exit, gloo can abort there ("terminate called without an active exception").
del model0, model1, optimizer0, optimizer1
gc.collect()
dist.barrier()
dist.destroy_process_group()
