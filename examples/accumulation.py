"""Gradient accumulation under DDP: ``no_sync()`` on all micro-batches but the last.

    torchrun --standalone --nproc-per-node=2 examples/accumulation.py

torch's recipe: the scale stays the same over the micro-batches of one effective batch, so
``scale``/``backward`` run per micro-batch, and ``unscale_``/``clip_grad_norm_``, ``step`` and
``update`` once per effective batch. ``no_sync()`` keeps DDP from all-reducing the gradients of
the first micro-batches; the scaler adds its one all_reduce per optimizer step, whatever the
number of micro-batches. The loss is divided by the number of micro-batches so that the gradients
are those of the mean loss over the effective batch.
"""

import contextlib
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

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(
    device
)
model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = GradScaler(device.type).register_model(model)
num_micro_batches = 4

torch.manual_seed(1 + rank)
for _ in range(5):
    optimizer.zero_grad(set_to_none=True)
    for micro in range(num_micro_batches):
        x, y = torch.randn(8, 32, device=device), torch.randn(8, 1, device=device)
        last = micro == num_micro_batches - 1
        # DDP all-reduces the gradients in the last micro-batch's backward only.
        with contextlib.nullcontext() if last else model.no_sync():
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x), y) / num_micro_batches
            scaler.scale(loss).backward()
    # Once per effective batch: clip, step, update.
    scaler.clip_grad_norm_(optimizer, max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()

totals = scaler.skip_totals
if rank == 0:
    print(f"micro-batches per step: {num_micro_batches}")
    print(
        f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
    )
# Free what holds the process group (the DDP model) before destroying it: left to interpreter
# exit, gloo can abort there ("terminate called without an active exception").
del model, optimizer
gc.collect()
dist.barrier()
dist.destroy_process_group()
