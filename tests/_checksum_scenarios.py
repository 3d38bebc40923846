"""Scenarios of tests/test_checksum_guarantee.py on 4 gloo ranks (one spawn): a bit flipped after
the reduce on two ranks of two different replica sets, chosen so that the two changes go the way
that cancels where the sets share their weights, and the same flip on one rank alone as the control.

- FSDP2 HSDP on a 2 x 2 mesh (replicate x shard), ``clip_grad_norm_(opt, 1.0)``: the replica sets
  are ranks (0, 2) and (1, 3); ranks 0 and 3 flip the same bit of the same word of their local
  shard of ``model[0].weight.grad``, the bit holding the same value on both (the same change).
- DDP over the groups {0, 2} and {1, 3} (a pipeline whose two stages are each replicated; the
  scaler's group is the world): ranks 0 and 3 flip a bit holding the same value, ranks 0 and 1 a
  bit holding opposite values (opposite changes).

The word and the bit are chosen at the flip step from the reduced gradients themselves (every rank
gathers them and takes the same choice), so that the case holds whatever the initialization and
the batches give: the sign bit (bit 15 of the high word of a float32 element, so that the step the
changed gradient drives visibly differs) of the first nonzero element where the two ranks' bits
relate as asked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _replica_scenarios import digest
from _torch_gaps import GAPS, run_case, torch_gaps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler

#: The step (0-based) whose reduced gradients are corrupted; the one before it is clean.
FLIP_STEP = 1
STEPS = 2
#: The flipped bit of the chosen 16-bit word: its top bit, the float32 element's sign.
BIT = 15


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as 16-bit signed words, flat (a view)."""
    return tensor.detach().reshape(-1).view(torch.int16)


def _bit(word: int, bit: int) -> int:
    return (word >> bit) & 1


def choose_word(grad: torch.Tensor, ranks: tuple[int, int], same: bool) -> int:
    """The index of the 16-bit word of ``grad`` (this rank's local gradient; every rank calls,
    with tensors of the same size) to flip `BIT` of on ``ranks``: the high word of the first
    float32 element nonzero on both where that bit holds the same value on both (``same``) or
    opposite values. One ``all_gather_object`` of the words; the same choice on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _words(grad).tolist())
    a, b = (gathered[r] for r in ranks)
    for high in range(1, len(a), 2):  # little endian: word 2i + 1 holds element i's sign
        nonzero = (a[high] or a[high - 1]) and (b[high] or b[high - 1])
        if nonzero and (_bit(a[high], BIT) == _bit(b[high], BIT)) == same:
            return high
    raise AssertionError(f"no element of {len(a) // 2} fits ranks {ranks} (same={same})")


def _flip(grad: torch.Tensor, word: int, flip: bool) -> dict[str, int]:
    """Flip `BIT` of ``grad``'s 16-bit word ``word`` in place where ``flip``; the word before and
    after, as unsigned 16-bit values (the proof that it was flipped)."""
    words = _words(grad)
    before = int(words[word]) & 0xFFFF
    if flip:
        words[word] ^= -(1 << 15)  # bit 15 of a signed 16-bit word
    return {"word": word, "before": before, "after": int(words[word]) & 0xFFFF}


def _run(
    rank: int,
    model: nn.Module,
    forward: Any,
    scaler: GradScaler,
    opt: torch.optim.Optimizer,
    grad: Any,
    local: Any,
    flip_ranks: tuple[int, ...],
    pair: tuple[int, int],
    same: bool,
    clip: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {"skipped": [], "flip": None}
    for step in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own batch: the reduce averages
        scaler.scale(forward(torch.randn(4, 8)).square().mean()).backward()
        if step == FLIP_STEP:
            word = choose_word(grad(), pair, same)
            out["flip"] = _flip(grad(), word, rank in flip_ranks)
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        out["skipped"].append(bool(scaler.step_was_skipped))
    ledger = scaler.replica_ledger.as_dict()
    out["checks"] = ledger["replica_checks"]
    out["mismatches"] = ledger["replica_mismatches"]
    out["replica_skipped"] = ledger["replica_skipped"]
    out["params"] = digest(local(p) for p in model.parameters())
    return out


def hsdp_cases(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 HSDP (replicate 2 x shard 2), fused AdamW, clipping: ranks 0 and 3 (replica sets
    (0, 2) and (1, 3)) flip the sign bit of the same word of their shard of
    ``model[0].weight.grad``, the bit the same on both; the control flips it on rank 0 alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    results: dict[str, Any] = {}
    for name, flip_ranks in (("pair", (0, 3)), ("one", (0,))):
        model = _mlp(0)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = GradScaler("cpu", init_scale=2.0**4, replica_check_interval=1)
        out = _run(rank, model, model, scaler, opt, lambda m=model: m[0].weight.grad._local_tensor,
                   lambda p: p._local_tensor, flip_ranks, (0, 3), True, clip=True)  # fmt: skip
        out["coordinate"] = list(mesh.get_coordinate())
        results[name] = out
    return results


def ddp_cases(rank: int, world_size: int) -> dict[str, Any]:
    """DDP over {0, 2} and {1, 3} (each set its own model: two pipeline stages, each replicated),
    the scaler over the world: ranks 0 and 3 flip a bit holding the same value (``"pair-same"``),
    ranks 0 and 1 a bit holding opposite values (``"pair-opposite"``); the control flips it on
    rank 0 alone."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
    stage = rank % 2
    results: dict[str, Any] = {}
    cases = (("pair-same", (0, 3), (0, 3), True), ("pair-opposite", (0, 1), (0, 1), False),
             ("one", (0,), (0, 3), True))  # fmt: skip
    for name, flip_ranks, pair, same in cases:
        model = _mlp(stage)
        ddp = DDP(model, process_group=groups[stage])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = GradScaler("cpu", init_scale=2.0**4, replica_check_interval=1).register_model(ddp)
        results[name] = _run(rank, model, ddp, scaler, opt, lambda m=model: m[0].weight.grad,
                             lambda p: p, flip_ranks, pair, same, clip=False)  # fmt: skip
    return results


def erased_cases(rank: int, world_size: int) -> dict[str, Any]:
    """DDP over the world: after the reduce, every rank's ``model[0].weight.grad[0, 0]`` is set to
    0.0 and rank 1 alone flips the lowest bit of its low word (1.4e-45, a float32 denormal), which
    the unscale (a loss scale of 2**16) takes back to 0.0. ``foreach``: the gradients are unscaled
    in place before the checksum reads them; ``fused``: the checksum reads the scaled gradients,
    the optimizer divides them itself."""
    results: dict[str, Any] = {}
    for name, fused in (("foreach", False), ("fused", True)):
        model = _mlp(0)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused,
                                foreach=None if fused else True)  # fmt: skip
        scaler = GradScaler("cpu", init_scale=2.0**16, replica_check_interval=1).register_model(ddp)
        opt.zero_grad()
        torch.manual_seed(100 + rank)
        scaler.scale(ddp(torch.randn(4, 8)).square().mean()).backward()
        grad = model[0].weight.grad
        grad[0, 0] = 0.0
        if rank == 1:
            _words(grad)[0] ^= 1  # the low word of element 0 on a little-endian machine
        flipped = float(grad[0, 0])
        scaler.step(opt)
        scaler.update()
        results[name] = {
            "flipped": flipped,
            "skipped": bool(scaler.step_was_skipped),
            "mismatches": scaler.replica_ledger.mismatch_events,
            "grad_after": float(grad[0, 0]) if not fused else None,
            "params": digest(p for p in model.parameters()),
        }
    return results


def everything_4(rank: int, world_size: int) -> dict[str, Any]:
    return {
        GAPS: torch_gaps(world_size),  # torch 2.6's own fully_shard fails on CPUs
        "hsdp": run_case(lambda: hsdp_cases(rank, world_size)),
        "ddp": run_case(lambda: ddp_cases(rank, world_size)),
        "erased": run_case(lambda: erased_cases(rank, world_size)),
    }
