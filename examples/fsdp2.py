"""FSDP2 (``fully_shard``): sharded gradients, one agreed found_inf, an exact global norm.

    torchrun --standalone --nproc-per-node=2 examples/fsdp2.py

Each rank holds a shard of every gradient (DTensors), so each rank checks different numbers for
inf/NaN: torch's ``ShardedGradScaler`` with a fused optimizer lets the ranks disagree; here they
cannot. The gradients say how they lie (DTensor placements): no ``register_model`` needed, and
``clip_grad_norm_`` gives the norm of the full gradients. Mixed precision is FSDP2's own
(``MixedPrecisionPolicy``: fp16 compute, fp32 gradient reduction and parameters), no autocast. At
iteration 8 an inf goes into rank 1's shard of one gradient only: every rank skips.
"""

import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from distscaler import GradScaler

if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh(device.type, (dist.get_world_size(),))

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 64),
    torch.nn.ReLU(),
    torch.nn.Linear(64, 64),
    torch.nn.ReLU(),
    torch.nn.Linear(64, 1),
).to(device)
mp_policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
fully_shard(model, mesh=mesh, mp_policy=mp_policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = GradScaler(device.type)  # DTensor gradients: nothing to register

torch.manual_seed(1 + rank)
for step in range(10):
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if step == 7 and rank == 1:
        model[0].weight.grad.to_local()[0, 0] = float("inf")  # in rank 1's shard only
    norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # of the full gradients
    scaler.step(optimizer)
    scaler.update()

totals = scaler.skip_totals
assert totals.last_skipped == 8, totals  # the injected overflow skipped on every rank
if rank == 0:
    print(
        f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
    )
# Free the sharded model (its mesh holds the process group) before destroying the group.
del model, optimizer, mesh
gc.collect()
dist.barrier()
dist.destroy_process_group()
