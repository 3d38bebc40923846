"""Scenarios of tests/test_faults.py (issue 41), run on every rank of a gloo group.

Faults are written into gradients after the reduce (DDP's all_reduce, a manual all_reduce of a
replicated model, FSDP2's reduce-scatter, HSDP's replicate reduce), on one rank or two: a finite
corruption (an exponent bit flipped: 0.75 becomes ~2.55e38), inf, NaN, single bit flips, and pairs
of flips built to cancel in a plain sum of bit patterns. Every rank records, after every step, what
must be the same on every rank (the scale, the growth tracker, ``step_was_skipped``, the norms
``clip_grad_norm_`` returned) and what the replica check saw (``last_replica_mismatch``,
``replica_ledger``). Nothing here asserts: the tests compare the ranks' records.

Only public API: ``distscaler.GradScaler`` (``get_scale``, torch's ``_get_growth_tracker``,
``step_was_skipped``, ``last_replica_mismatch``, ``replica_ledger``, ``unscale_``,
``clip_grad_norm_``, ``step``, ``update``, ``register_model``, torch's ``_check_inf_per_device``
and ``_get_scale_async`` for an optimizer of torch's deprecated ``grad_scaler=`` contract).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from _torch_gaps import GAPS, run_case, torch_gaps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.tensors import local_tensor
from distscaler import GradScaler

_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------- bits


def _ints(tensor: torch.Tensor) -> torch.Tensor:
    return local_tensor(tensor).detach().view(-1).view(_INT[tensor.dtype])


def _mask(tensor: torch.Tensor, bit: int) -> int:
    width = tensor.element_size() * 8
    return -(1 << (width - 1)) if bit == width - 1 else 1 << bit  # the sign bit as a signed int


def flip_bit_(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` of element ``index`` (flat, of the local part) of ``tensor`` in place."""
    ints = _ints(tensor)
    ints[index] ^= _mask(tensor, bit)


def bit_of(tensor: torch.Tensor, index: int, bit: int) -> int:
    return int(bool(int(_ints(tensor)[index]) & _mask(tensor, bit)))


def flipped_value(tensor: torch.Tensor, index: int, bit: int) -> float:
    """The value element ``index`` would hold with ``bit`` flipped (the tensor unchanged)."""
    one = local_tensor(tensor).detach().reshape(-1)[index : index + 1].clone()
    flip_bit_(one, 0, bit)
    return float(one.float())


def pick(
    tensor: torch.Tensor, bit: int, value: int, *, avoid: tuple[int, ...] = (), start: int = 0
) -> int | None:
    """The first element (flat, from ``start``) whose ``bit`` is ``value``, whose flip stays finite
    and nonzero-changing, and that is not in ``avoid``; None if there is none."""
    flat = local_tensor(tensor).detach().reshape(-1)
    n = flat.numel()
    for k in range(n):
        i = (start + k) % n
        if i in avoid or bit_of(tensor, i, bit) != value:
            continue
        if math.isfinite(flipped_value(tensor, i, bit)):
            return i
    return None


def huge_finite_index(tensor: torch.Tensor) -> int:
    """An element whose exponent bit 30 (float32) flip makes it huge but finite (0.75 -> 2.55e38):
    its square overflows float32, the value itself does not."""
    flat = local_tensor(tensor).detach().reshape(-1)
    for i in range(flat.numel()):
        v = flipped_value(tensor, i, 30)
        if math.isfinite(v) and abs(v) > 1e30:
            return i
    raise AssertionError("no element whose bit-30 flip is huge and finite")


def norm_repr(norm: torch.Tensor | float) -> str:
    """A norm as compared across ranks: its float32 bits in hex, or "nonfinite" (inf and NaN
    alike: both say the step is skipped)."""
    v = float(norm)
    if not math.isfinite(v):
        return "nonfinite"
    return struct.pack("<f", v).hex()


def digest(tensors: Any) -> str:
    """The bytes of the tensors' local parts, as one hex string."""
    return "".join(
        local_tensor(t).detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex()
        for t in tensors
    )


def _mismatch_at(scaler: GradScaler, update: int) -> bool:
    last = scaler.last_replica_mismatch
    return last is not None and last.step == update


def _snap(scaler: GradScaler, norms: list[str], update: int) -> dict[str, Any]:
    return {
        "scale": scaler.get_scale(),
        "tracker": scaler._get_growth_tracker(),
        "skipped": bool(scaler.step_was_skipped),
        "norms": norms,
        "mismatch": _mismatch_at(scaler, update),
    }


def _mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _batch(step: int, micro: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=g).to(dtype)


# ---------------------------------------------------------------------- defect 1: the split


def split(rank: int, world_size: int) -> dict[str, Any]:
    """DDP, ``unscale_`` then ``clip_grad_norm_(opt, 1.0)``: at step 1 rank 1 (the last rank)
    flips exponent bit 30 of a gradient element (0.75-like -> ~2.55e38, finite) after backward;
    the replica check on and off. Per step: scale, tracker, skipped, the norm, the mismatch."""
    out: dict[str, Any] = {}
    for check in (True, False):
        model = _mlp()
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=2,
                            replica_check=check, replica_check_interval=1).register_model(ddp)  # fmt: skip
        steps = []
        flipped = None
        for step in range(4):
            opt.zero_grad()
            scaler.scale(ddp(_batch(step, 0, rank)).square().mean()).backward()
            if step == 1 and rank == world_size - 1:
                i = huge_finite_index(model[0].weight.grad)
                flip_bit_(model[0].weight.grad, i, 30)
                flipped = float(model[0].weight.grad.view(-1)[i])
            scaler.unscale_(opt)
            norm = scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            steps.append(_snap(scaler, [norm_repr(norm)], step + 1))
        out[f"check={'on' if check else 'off'}"] = {"steps": steps, "flipped": flipped}
    return out


# ---------------------------------------------------------------------- the property test

#: Call orders of one iteration (the optimizer(s) of the model).
ORDERS = ("step", "clip", "unscale_clip", "unscale", "accum_clip", "two_opts", "two_opts_unscale")
#: Orders that call clip_grad_norm_ (norm_type matters).
CLIPPING = {"clip", "unscale_clip", "accum_clip", "two_opts", "two_opts_unscale"}
NORM_TYPES = (2.0, math.inf, 1.5)
FAULTS = ("none", "corrupt", "inf", "nan")
#: The step (0-based) faults hit; steps per case.
FAULT_STEP = 1
STEPS = 4
#: Layouts whose gradients have replicas (the replica check applies).
REPLICATED = {"ddp", "replicated", "hsdp"}


def property_cases(
    layouts: tuple[str, ...], world_size: int, per_pair: int, seed: int
) -> list[dict]:
    """A seeded sample of the product of orders, layouts, norm types (clipping orders only), faults
    (on rank 0 or the last rank), the check on/off and fused/foreach AdamW: for each (order,
    layout), a finite corruption with the check on at every norm type, then random others up to
    ``per_pair`` cases."""
    rng = random.Random(seed)
    cases = []
    for order, layout in itertools.product(ORDERS, layouts):
        norms = NORM_TYPES if order in CLIPPING else (2.0,)
        rest = []
        for norm_type, fault, check, opt in itertools.product(
            norms, FAULTS, (True, False), ("fused", "foreach")
        ):
            for fault_rank in (None,) if fault == "none" else (0, world_size - 1):
                rest.append(dict(order=order, layout=layout, norm_type=norm_type, fault=fault,
                                 fault_rank=fault_rank, check=check, opt=opt))  # fmt: skip
        chosen = []
        for norm_type in norms:  # the corruption the replica check must catch, at every norm
            chosen.append(dict(order=order, layout=layout, norm_type=norm_type, fault="corrupt",
                               fault_rank=rng.choice((0, world_size - 1)), check=True,
                               opt=rng.choice(("fused", "foreach"))))  # fmt: skip
        rest = [c for c in rest if c not in chosen]
        chosen += rng.sample(rest, max(0, per_pair - len(chosen)))
        cases += chosen
    return cases


def case_key(case: dict) -> str:
    norm = "inf" if case["norm_type"] == math.inf else f"{case['norm_type']:g}"
    where = "" if case["fault_rank"] is None else f"@r{case['fault_rank']}"
    return (f"{case['layout']}/{case['order']}/p={norm}/{case['fault']}{where}/"
            f"check={'on' if case['check'] else 'off'}/{case['opt']}")  # fmt: skip


class _Setup:
    """A model of ``layout``, its optimizer(s) and scaler."""

    def __init__(self, layout: str, two_opts: bool, opt_kind: str, check: bool, world_size: int):
        self.layout = layout
        self.model = model = _mlp()
        self.forward: nn.Module = model
        scaler_kwargs: dict[str, Any] = dict(init_scale=1024.0, growth_interval=2,
                                             replica_check=check, replica_check_interval=1)  # fmt: skip
        if layout == "ddp":
            self.forward = DDP(model)
        elif layout == "replicated":
            scaler_kwargs["grad_layout"] = "replicated"
        elif layout in ("fsdp", "hsdp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if layout == "fsdp":
                mesh = init_device_mesh("cpu", (world_size,))
            else:
                mesh = init_device_mesh("cpu", (2, world_size // 2),
                                        mesh_dim_names=("replicate", "shard"))  # fmt: skip
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            raise ValueError(layout)
        flags = {"fused": True} if opt_kind == "fused" else {"foreach": True}
        if two_opts:
            self.opts = [torch.optim.AdamW(model[0].parameters(), lr=1e-2, **flags),
                         torch.optim.AdamW(model[2].parameters(), lr=1e-2, **flags)]  # fmt: skip
        else:
            self.opts = [torch.optim.AdamW(model.parameters(), lr=1e-2, **flags)]
        self.scaler = GradScaler("cpu", **scaler_kwargs)
        if layout == "ddp":
            self.scaler.register_model(self.forward)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.layout == "ddp":
            with self.forward.no_sync():  # type: ignore[operator]
                yield
        elif self.layout in ("fsdp", "hsdp"):
            self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)  # type: ignore[operator]
        else:  # replicated: the manual all_reduce runs after the last micro-batch only
            yield

    def backward(self, step: int, micro: int, rank: int) -> None:
        loss = self.forward(_batch(step, micro, rank)).square().mean()
        self.scaler.scale(loss).backward()

    def reduce_replicated(self, world_size: int) -> None:
        if self.layout != "replicated":
            return
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)


def inject(grad: torch.Tensor, fault: str) -> None:
    """Write ``fault`` into the local part of ``grad``."""
    local = local_tensor(grad)
    if fault == "corrupt":
        flip_bit_(local, huge_finite_index(local), 30)
    elif fault == "inf":
        local.view(-1)[0] = math.inf
    elif fault == "nan":
        local.view(-1)[0] = math.nan
    else:
        raise ValueError(fault)


def run_property_case(rank: int, world_size: int, case: dict) -> dict[str, Any]:
    order = case["order"]
    two = order.startswith("two_opts")
    s = _Setup(case["layout"], two, case["opt"], case["check"], world_size)
    scaler, opts = s.scaler, s.opts
    steps = []
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        if order == "accum_clip":
            with s.no_sync():
                s.backward(step, 0, rank)
        s.backward(step, 1, rank)
        s.reduce_replicated(world_size)
        if step == FAULT_STEP and rank == case["fault_rank"]:
            inject(s.model[0].weight.grad, case["fault"])
        norms: list[str] = []
        p = case["norm_type"]
        if order == "step":
            pass
        elif order in ("clip", "accum_clip"):
            norms.append(norm_repr(scaler.clip_grad_norm_(opts[0], 1.0, norm_type=p)))
        elif order == "unscale_clip":
            scaler.unscale_(opts[0])
            norms.append(norm_repr(scaler.clip_grad_norm_(opts[0], 1.0, norm_type=p)))
        elif order == "unscale":
            scaler.unscale_(opts[0])
        elif order == "two_opts":
            for opt in opts:
                norms.append(norm_repr(scaler.clip_grad_norm_(opt, 1.0, norm_type=p)))
        elif order == "two_opts_unscale":
            scaler.unscale_(opts[0])
            for opt in opts:
                norms.append(norm_repr(scaler.clip_grad_norm_(opt, 1.0, norm_type=p)))
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        steps.append(_snap(scaler, norms, step + 1))
    return {"steps": steps}


def property_run(rank: int, world_size: int, cases: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        out[case_key(case)] = run_case(lambda case=case: run_property_case(rank, world_size, case))
    return out


# ---------------------------------------------------------------------- defect 2: p = inf, paths

#: The 12 flips of the p = inf run: (step, bit, element of the first layer's weight gradient).
INF_FLIPS = [
    (1, 31, 3), (2, 0, 17), (3, 22, 40), (4, 12, 5), (5, 27, 99), (6, 23, 64),
    (7, 5, 127), (9, 18, 8), (10, 29, 33), (11, 24, 71), (12, 1, 2), (13, 20, 110),
]  # fmt: skip
INF_STEPS = 15


def inf_norm_flips(rank: int, world_size: int) -> dict[str, Any]:
    """DDP, ``replica_check_interval=1``, ``clip_grad_norm_(opt, 1.0, norm_type=inf)`` then step:
    :data:`INF_FLIPS` on the last rank after backward."""
    model = _mlp()
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cpu", init_scale=16.0, replica_check_interval=1).register_model(ddp)
    flips = {step: (bit, index) for step, bit, index in INF_FLIPS}
    steps = []
    for step in range(INF_STEPS):
        opt.zero_grad()
        scaler.scale(ddp(_batch(step, 0, rank)).square().mean()).backward()
        if step in flips and rank == world_size - 1:
            bit, index = flips[step]
            flip_bit_(model[0].weight.grad, index, bit)
        before = digest(model.parameters())
        norm = scaler.clip_grad_norm_(opt, 1.0, norm_type=math.inf)
        scaler.step(opt)
        scaler.update()
        steps.append(dict(_snap(scaler, [norm_repr(norm)], step + 1),
                          unchanged=digest(model.parameters()) == before))  # fmt: skip
    return {"steps": steps, "params": digest(model.parameters()),
            "ledger": scaler.replica_ledger.as_dict()}  # fmt: skip


class OldContractSGD(torch.optim.SGD):
    """An optimizer of torch's deprecated contract: ``step(grad_scaler=...)`` drives the scaler
    (torch's ``_check_inf_per_device``, then it unscales and steps itself)."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        if grad_scaler is not None:
            found = grad_scaler._check_inf_per_device(self)
            if sum(float(v) for v in found.values()):
                return None
            inv = 1.0 / grad_scaler._get_scale_async().double()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv.to(p.grad.dtype))
        return super().step(closure)


#: Every path that reduces, one flip each: how the iteration calls the scaler.
PATHS = ("clip_p2", "clip_pinf", "clip_p1.5", "unscale", "check_inf_per_device", "step_fused",
         "step_foreach", "unscale_clip_p2")  # fmt: skip


def path_flip(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """3 steps of DDP; at step 1 the last rank flips mantissa bit 22 of one gradient element."""
    model = _mlp()
    ddp = DDP(model)
    if path == "check_inf_per_device":
        opt: torch.optim.Optimizer = OldContractSGD(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=path != "step_foreach",
                                foreach=path == "step_foreach")  # fmt: skip
    scaler = GradScaler("cpu", init_scale=16.0, replica_check_interval=1).register_model(ddp)
    steps = []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(ddp(_batch(step, 0, rank)).square().mean()).backward()
        if step == 1 and rank == world_size - 1:
            flip_bit_(model[2].weight.grad, 9, 22)
        before = digest(model.parameters())
        if path.startswith("clip_"):
            p = {"clip_p2": 2.0, "clip_pinf": math.inf, "clip_p1.5": 1.5}[path]
            scaler.clip_grad_norm_(opt, 1.0, norm_type=p)
        elif path == "unscale":
            scaler.unscale_(opt)
        elif path == "unscale_clip_p2":
            scaler.unscale_(opt)
            scaler.clip_grad_norm_(opt, 1.0)
        with _quiet_future_warning():
            scaler.step(opt)
        scaler.update()
        steps.append(dict(_snap(scaler, [], step + 1),
                          unchanged=digest(model.parameters()) == before))  # fmt: skip
    return {"steps": steps, "params": digest(model.parameters()),
            "ledger": scaler.replica_ledger.as_dict()}  # fmt: skip


@contextlib.contextmanager
def _quiet_future_warning() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


# ---------------------------------------------------------------------- defect 3: cancelling flips

#: Bits per dtype: the sign, exponent bits, mantissa bits.
CANCEL_BITS = {
    "float32": [31, 30, 29, 26, 23, 22, 12, 0],
    "float16": [15, 14, 12, 10, 9, 0],
    "bfloat16": [15, 14, 11, 7, 6, 0],
}
#: Two flips of the same bit position that cancel in a plain sum of bit patterns:
#: "tensor" (one element 0 -> 1, another 1 -> 0, one tensor), "tensors" (the same across the two
#: weight gradients of one rank), "ranks" (0 -> 1 on two ranks whose coefficients are opposite,
#: different elements).
PATTERNS_2 = ("tensor", "tensors", "ranks")
#: At 4 ranks (coefficients +1, -1, +1, -1 in a plain sum): "ranks01" (0 -> 1 on ranks 0 and 1,
#: different elements), "ranks02" (0 -> 1 on rank 0, 1 -> 0 on rank 2), "ranks13" (0 -> 1 on rank
#: 1, 1 -> 0 on rank 3).
PATTERNS_4 = ("ranks01", "ranks02", "ranks13")


def _plan_flips(
    model: nn.Sequential, pattern: str, bit: int
) -> list[tuple[int, int, int, int]] | None:
    """The flips of ``pattern``: (rank, layer index, element, bit); None when the gradients (the
    same on every rank) hold no elements to build it."""
    g0, g2 = model[0].weight.grad, model[2].weight.grad
    if pattern == "tensor":
        a = pick(g0, bit, 0)
        b = pick(g0, bit, 1, avoid=() if a is None else (a,))
        return None if a is None or b is None else [(1, 0, a, bit), (1, 0, b, bit)]
    if pattern == "tensors":
        a, b = pick(g0, bit, 0), pick(g2, bit, 1)
        return None if a is None or b is None else [(1, 0, a, bit), (1, 2, b, bit)]
    if pattern in ("ranks", "ranks01"):  # the same direction, ranks of coefficients +1, -1
        a = pick(g0, bit, 0)
        b = pick(g0, bit, 0, avoid=() if a is None else (a,), start=0 if a is None else a + 1)
        return None if a is None or b is None else [(0, 0, a, bit), (1, 0, b, bit)]
    if pattern in ("ranks02", "ranks13"):  # opposite directions, ranks of one coefficient
        a, b = pick(g0, bit, 0), pick(g0, bit, 1)
        r = (0, 2) if pattern == "ranks02" else (1, 3)
        return None if a is None or b is None else [(r[0], 0, a, bit), (r[1], 0, b, bit)]
    raise ValueError(pattern)


def cancel_case(rank: int, dtype_name: str, pattern: str, bit: int) -> dict[str, Any]:
    """DDP of ``dtype`` gradients, fused AdamW, no clipping: a clean step, then the flips of
    ``pattern`` after backward. Did the check see them at that step, was it skipped, are the
    replicas still equal?"""
    dtype = DTYPES[dtype_name]
    model = _mlp(dtype)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    # A scale of 2**10: gradients both above 2 and below 1, so that every exponent bit has elements
    # holding it 0 and 1.
    scaler = GradScaler("cpu", init_scale=1024.0, replica_check_interval=1).register_model(ddp)
    out: dict[str, Any] = {}
    for step in range(2):
        opt.zero_grad()
        scaler.scale(ddp(_batch(step, 0, rank, dtype)).float().square().mean()).backward()
        before = digest(model.parameters())
        if step == 1:
            flips = _plan_flips(model, pattern, bit)
            if flips is None:
                return {"constructed": False}
            for flip_rank, layer, index, b in flips:
                if flip_rank == rank:
                    flip_bit_(model[layer].weight.grad, index, b)
            out["flips"] = flips
        scaler.step(opt)
        scaler.update()
        if step == 1:
            out.update(constructed=True, caught=_mismatch_at(scaler, 2),
                       skipped=bool(scaler.step_was_skipped),
                       unchanged=digest(model.parameters()) == before)  # fmt: skip
    out["params"] = digest(model.parameters())
    out["scale"] = scaler.get_scale()
    return out


def cancel_cases(world_size: int) -> list[tuple[str, str, int]]:
    if world_size == 2:
        return [(d, pat, bit) for d, bits in CANCEL_BITS.items() for pat in PATTERNS_2
                for bit in bits]  # fmt: skip
    return [("float32", pat, bit) for pat in PATTERNS_4 for bit in (31, 30, 23, 22, 0)]


def cancelling(rank: int, world_size: int) -> dict[str, Any]:
    return {f"{d}/{pat}/bit{bit}": cancel_case(rank, d, pat, bit)
            for d, pat, bit in cancel_cases(world_size)}  # fmt: skip


# ---------------------------------------------------------------------- the spawns

#: Cases of the property test per spawn (seeded samples of the product).
PROPERTY_2 = property_cases(("ddp", "replicated", "fsdp"), 2, 11, seed=41)
PROPERTY_4 = property_cases(("ddp", "hsdp"), 4, 5, seed=4141)


def _timed(fn: Callable[[], Any], times: dict[str, float], name: str) -> Any:
    import time

    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        times[name] = round(time.perf_counter() - t0, 2)


def faults_2(rank: int, world_size: int) -> dict[str, Any]:
    times: dict[str, float] = {}
    return {
        GAPS: torch_gaps(world_size),
        "split": _timed(lambda: split(rank, world_size), times, "split"),
        "inf_norm": _timed(lambda: inf_norm_flips(rank, world_size), times, "inf_norm"),
        "paths": _timed(lambda: {p: path_flip(rank, world_size, p) for p in PATHS}, times, "paths"),
        "cancel": _timed(lambda: cancelling(rank, world_size), times, "cancel"),
        "property": _timed(lambda: property_run(rank, world_size, PROPERTY_2), times, "property"),
        "times": times,
    }


def faults_4(rank: int, world_size: int) -> dict[str, Any]:
    times: dict[str, float] = {}
    return {
        GAPS: torch_gaps(world_size),
        "cancel": _timed(lambda: cancelling(rank, world_size), times, "cancel"),
        "property": _timed(lambda: property_run(rank, world_size, PROPERTY_4), times, "property"),
        "times": times,
    }
