"""HSDP: FSDP2 sharding inside groups of ranks, replication across the groups.

    torchrun --standalone --nproc-per-node=4 examples/hsdp.py     # 2 replicas x 2 shards

A 2-D device mesh (``replicate``, ``shard``) given to ``fully_shard`` makes HSDP. found_inf and the
norm are agreed over every rank of the mesh (WORLD here); the gradients' placements (Replicate on
``replicate``, Shard on ``shard``) tell ``clip_grad_norm_`` to count each shard once, not once per
replica. Any even number of ranks works: N ranks make 2 replicas of N/2 shards. At iteration 8 an
inf goes into the last rank's shard of one gradient only: every rank skips.
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
rank, world_size = dist.get_rank(), dist.get_world_size()
if world_size % 2:
    raise SystemExit(f"HSDP here needs an even number of ranks, got {world_size}")
mesh = init_device_mesh(device.type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))

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
    if step == 7 and rank == world_size - 1:
        model[2].weight.grad.to_local()[0, 0] = float("inf")  # in this rank's shard only
    norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()

totals = scaler.skip_totals
assert totals.last_skipped == 8, totals  # the injected overflow skipped on every rank
if rank == 0:
    print(f"mesh: {mesh.mesh.tolist()} (replicate x shard)")
    print(
        f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
    )
# Free the sharded model (its mesh holds the process groups) before destroying them.
del model, optimizer, mesh
gc.collect()
dist.barrier()
dist.destroy_process_group()
