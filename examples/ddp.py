"""DistributedDataParallel: every rank skips the same steps and keeps the same loss scale.

    # one machine, 2 processes (one per GPU, or CPU ranks):
    torchrun --standalone --nproc-per-node=2 examples/ddp.py
    # two machines of 8 GPUs, the same command on each (HOST: the first machine's address):
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 examples/ddp.py

GPUs (NCCL) when there are, the CPU (gloo) otherwise. At iteration 8 an inf is put in one gradient
of rank 1 only, after DDP's all-reduce (as a rank-local gradient hook, or a bad shard, would): torch's
scaler would skip on rank 1 and step on the others; here every rank skips, and the script checks
that the ranks' scales and parameters are equal at the end.
"""

import gc
import os

import torch
import torch.distributed as dist
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

torch.manual_seed(0)  # the same initial parameters on every rank (DDP also broadcasts rank 0's)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(
    device
)
model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
# found_inf and the norm are agreed over WORLD. register_model tells clip_grad_norm_ that DDP's gradients are copies
# (counted once in the norm); without clipping it is not needed.
scaler = GradScaler(device.type).register_model(model)

torch.manual_seed(1 + rank)  # each rank its own data
for step in range(10):
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if step == 7 and rank == 1:
        next(model.parameters()).grad[0, 0] = float("inf")  # an overflow only rank 1 sees
    # One all_reduce for clipping + the skip decision; the norm is the same on every rank.
    norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    if scaler.step_was_skipped:  # the same on every rank (one host read)
        report = scaler.report_overflow()  # every rank calls it; names the rank and parameter
        if rank == 0:
            print(f"skipped: {report.describe()}")

# Every rank skipped the same steps and holds the same scale and parameters.
params = torch.cat([p.detach().flatten() for p in model.parameters()])
mine = torch.tensor([scaler.get_scale(), params.double().sum().item()], device=device)
everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, mine)
assert all(torch.equal(other, mine) for other in everyone), everyone

totals = scaler.skip_totals
if rank == 0:
    print(
        f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
    )
# Free what holds the process group (the DDP model) before destroying it: left to interpreter
# exit, gloo can abort there ("terminate called without an active exception").
del model, optimizer
gc.collect()
dist.barrier()
dist.destroy_process_group()
