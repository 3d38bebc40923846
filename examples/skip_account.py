"""The skip account: why each skipped step was skipped, the same answer on every rank.

    # one machine, 2 processes (one per GPU, or CPU ranks):
    torchrun --standalone --nproc-per-node=2 examples/skip_account.py

DDP, GPUs (NCCL) when there are, the CPU (gloo) otherwise. Two faults, on rank 1 only:

- iteration 4: an inf in rank 1's batch, before DDP's all-reduce. Every rank's averaged gradients
  hold it: an overflow (cause "overflow"), every rank skips and the scale backs off.
- iteration 7: one bit of a gradient flipped on rank 1 after the all-reduce, as a faulty GPU or
  memory would. The value stays finite, so no overflow check sees it; the replica check does (the
  ranks' gradients should be bit-identical): cause "replica_mismatch", every rank skips, and the
  scale stays where it was.

After a skipped step every rank asks `report_skip()` why; at the end `skip_totals` counts each
cause (`causes`, `describe()`) and `metrics()` gives the numbers a training log takes.
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

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(
    device
)
model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
# replica_check_interval=1: compare the replicas at every update (the CPU's default; on a GPU
# without kernels="triton" the default is every 32nd, which could miss this one flip).
scaler = GradScaler(device.type, replica_check_interval=1).register_model(model)

torch.manual_seed(1 + rank)  # each rank its own data
for step in range(10):
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    if step == 3 and rank == 1:
        x[0, 0] = float("inf")  # an overflow: DDP's average carries it to every rank
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if step == 6 and rank == 1:
        grad = next(model.parameters()).grad  # float32, identical on every rank after the reduce
        grad.view(-1).view(torch.int32)[5] ^= 1 << 12  # one bit flipped: finite, rank 1 only
    scaler.clip_grad_norm_(optimizer, max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    if scaler.step_was_skipped:  # the same on every rank (one host read)
        report = scaler.report_skip()  # every rank calls it: its cause and what it names
        if rank == 0:
            print(f"skipped: {report.describe()}")

totals = scaler.skip_totals  # every cause, each skipped step counted once
metrics = scaler.metrics()  # the same numbers under the keys a training log takes
if rank == 0:
    print(f"causes: {totals.causes}")
    print(totals.describe())
    for key in ("skipped_total", "skipped_overflow", "skipped_replica_mismatch",
                "replica_checks", "replica_mismatches"):  # fmt: skip
        print(f"metrics: distscaler/{key} = {metrics[f'distscaler/{key}']}")
    print(
        f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
    )

# Every rank skipped the same steps and holds the same parameters.
params = torch.cat([p.detach().flatten() for p in model.parameters()])
everyone = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, params)
assert all(torch.equal(other, params) for other in everyone)

del model, optimizer  # what holds the process group, before destroying it
gc.collect()
dist.barrier()
dist.destroy_process_group()
