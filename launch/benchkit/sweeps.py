"""Which cases each sweep runs: one knob varied from a base case at a time.

``full`` is what ``launch/bench.py`` runs by default (about 10 minutes on a 2-core CPU); ``quick``
is the smoke run (``--quick``, under 2 minutes) that CI runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cases import DTYPES, OPTIMIZERS, Case

__all__ = ["SINGLE_SWEEPS", "SWEEPS", "Plan", "plan"]

#: Sweeps that run in this process (world size 1, plain tensors). ``launch``: host time and device
#: ops on tiny gradients (see ``benchkit/launch_cost.py``).
SINGLE_SWEEPS = ("bytes", "tensors", "dtype", "optimizer", "launch")
#: Every sweep: the single-process ones, the torchrun worlds, and the fake-process-group simulation.
SWEEPS = (*SINGLE_SWEEPS, "world", "simulate")


@dataclass(frozen=True)
class Plan:
    """The cases of one run: ``single`` (sweep name, case) pairs, the torchrun worlds and the
    simulated world sizes."""

    single: list[tuple[str, Case]]
    world_sizes: list[int]
    world_case: Case
    world_layouts: list[str]
    #: fused (distscaler's best case) and foreach (ShardedGradScaler cannot run a fused AdamW
    #: after unscale_ in torch 2.13, so torch's FSDP2 recipe is only measured there).
    world_optimizers: list[str]
    simulate_world_sizes: list[int]
    rounds: int
    warmup: int


def plan(
    sweeps: list[str], *, quick: bool, max_params: int, base_params: int | None = None
) -> Plan:
    """The cases of ``sweeps``; ``max_params`` caps the gradient-bytes sweep (elements)."""
    base = Case(
        params=base_params or (2_000_000 if quick else 38_000_000), tensors=48 if quick else 144
    )
    single: list[tuple[str, Case]] = []
    if "bytes" in sweeps:
        sizes = (
            (1_000_000, 4_000_000)
            if quick
            else (
                1_000_000,
                4_000_000,
                16_000_000,
                38_000_000,
                64_000_000,
                128_000_000,
                256_000_000,
            )
        )
        single += [("bytes", base.but(params=n)) for n in sizes if n <= max_params]
    if "tensors" in sweeps:
        counts = (10, 1000) if quick else (10, 100, 1000, 10_000)
        single += [("tensors", base.but(tensors=t)) for t in counts]
    if "dtype" in sweeps:
        single += [("dtype", base.but(dtype=d)) for d in DTYPES]
    if "optimizer" in sweeps:
        kinds = ("fused", "foreach") if quick else OPTIMIZERS
        single += [
            ("optimizer", base.but(optimizer=k, clip=clip)) for k in kinds for clip in (True, False)
        ]
    if "launch" in sweeps:
        counts = (10, 144) if quick else (10, 144, 1000, 10_000)
        single += [
            ("launch", base.but(tensors=t, clip=clip)) for t in counts for clip in (True, False)
        ]
    return Plan(
        single=single,
        world_sizes=([1, 2] if quick else [1, 2, 4]) if "world" in sweeps else [],
        world_case=base.but(params=200_000 if quick else 8_000_000, tensors=8 if quick else 32),
        world_layouts=["ddp", "fsdp2"],
        world_optimizers=["fused", "foreach"],
        simulate_world_sizes=([8, 64] if quick else [8, 64, 1024, 4096])
        if "simulate" in sweeps
        else [],
        rounds=3 if quick else 11,
        warmup=1 if quick else 2,
    )
