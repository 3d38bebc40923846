"""The fused Triton pass (``distscaler/_triton/``) against independent references.

On the CPU the kernels run in Triton's interpreter (the package picks it for CPU tensors, whatever
``TRITON_INTERPRET`` says; nothing here sets that variable, which would decide Triton's own
functions for every other test of the worker). References: Python integers for the checksum's
moments, torch's ``_foreach_norm`` / ``linalg.vector_norm`` and a float64 sum for the norms, torch's
``_foreach_mul_`` / ``_foreach_div_`` / ``_amp_foreach_non_finite_check_and_unscale_`` for the
write pass, bit for bit. The ``cuda`` variants run the same asserts on compiled kernels (``pytest
-m cuda tests/test_triton_pass.py`` on a GPU). The interpreter costs milliseconds per program:
inputs stay small, and a small block configuration (`small_config`) exercises the multi-block,
multi-flush and multi-tile paths with few elements.
"""

from __future__ import annotations

import math
import time
import types

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="the Triton pass needs triton (the test extra)")

from _common import interpreted, interpreted_mark  # noqa: E402

from distscaler import _triton as tp  # noqa: E402
from distscaler._replica.checksum import PRIMES  # noqa: E402
from distscaler._triton import diagnostics as diag  # noqa: E402
from distscaler.attribution import NAN_CODE  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICES = [pytest.param("cpu", marks=interpreted_mark()),
           pytest.param("cuda", marks=pytest.mark.cuda)]  # fmt: skip
U = 2.0**-24


@pytest.fixture
def small_config(monkeypatch):
    """Tiles of 64 elements, 4 tiles per flush, chunks of 256 to 1024 elements (aiming at 40
    blocks), reduction tiles of 16 partials: every loop of the kernels runs several times on
    tensors of a few thousand elements."""
    monkeypatch.setitem(diag.CONFIG, "BLOCK", 64)
    monkeypatch.setitem(diag.CONFIG, "INNER", 4)
    monkeypatch.setitem(diag.CONFIG, "RT", 16)
    monkeypatch.setitem(diag.CONFIG, "target_blocks", 40)
    monkeypatch.setitem(diag.CONFIG, "max_chunk", 1024)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- references


def ref_moments(t: torch.Tensor, primes: tuple[int, int]) -> list[int]:
    """[A mod P1, A mod P2, B mod P1, B mod P2] with Python integers (no wrap, no float)."""
    words = t.detach().cpu().contiguous().view(-1).view(torch.int16).tolist()
    a = sum(words)
    b = sum(k * w for k, w in enumerate(words))
    return [a % primes[0], a % primes[1], b % primes[0], b % primes[1]]


def exact_sumsq(t: torch.Tensor) -> float:
    return float(t.detach().cpu().double().pow(2).sum())


def grads_mixed(seed: int, sizes=(0, 1, 3, 700, 2049, 5000)) -> list[torch.Tensor]:
    """Tensors of every dtype and the given sizes, normal values of a few magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        dtype = DTYPES[i % 3]
        scale = (1e-3, 1.0, 30.0)[i % 3]
        out.append((torch.randn(n, generator=gen) * scale).to(dtype))
    return out


def block_rows(tables) -> list[list[int]]:
    """The block table's rows: each block's tensor, first element, element count, aligned."""
    nb = tables.num_blocks
    return tables.host[len(tables.host) - 4 * nb :].view(4, nb).tolist()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Every element bit-identical, except that a NaN only has to be a NaN (payloads differ
    between torch's paths themselves: the CPU's vectorized bfloat16 rounding gives 0xFFFF where
    its scalar one gives 0x7FC0)."""
    ours, theirs = ours.cpu(), theirs.cpu()
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(bits(ours)[~nan], bits(theirs)[~nan])


# ---------------------------------------------------------------------- the checksum


@pytest.mark.parametrize("device", DEVICES)
def test_moments_exact_against_python_integers(device, small_config):
    grads = grads_mixed(1, sizes=(0, 1, 2, 63, 64, 65, 257, 1023, 1024, 3001, 6000))
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 1e-45, -3e38])
    grads.append(specials.clone())  # float32 words of every sign and exponent
    grads.append(torch.full((1500,), -1.0).bfloat16())  # every word negative: no cancelling
    grads.append(torch.full((1500,), 65504.0).half())
    grads = [g.to(device) for g in grads]
    result = tp.grad_pass(grads, primes=PRIMES, flags=False)
    _sync(device)
    assert result.moments is not None and result.per_tensor is None
    assert result.moments.dtype == torch.int64 and result.moments.shape == (len(grads), 4)
    assert result.moments.cpu().tolist() == [ref_moments(g, PRIMES) for g in grads]
    # the case is not vacuous: several flushes per block, blocks per tensor, reduction tiles
    tables = diag.tables_for([g.contiguous() for g in grads], None)
    assert tables.chunk == 2 * 64 * 4 and tables.num_blocks > 2 * diag.CONFIG["RT"]


@pytest.mark.parametrize("device", DEVICES)
def test_moments_at_the_default_configuration(device):
    grads = [g.to(device) for g in grads_mixed(2, sizes=(5, 40000, 70000))]
    result = tp.grad_pass(grads, primes=(101, 16777213), norm_type=2.0)
    assert result.moments.cpu().tolist() == [ref_moments(g, (101, 16777213)) for g in grads]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inner", [16, 128])
def test_moments_exact_where_the_row_sums_are_at_their_bounds(device, inner, monkeypatch):
    """Every word at an extreme of int16 (-2**15, or 2**15 - 1) over whole flushes of the default
    tile: the kernel's int32 row sums reach the bounds ``distscaler._triton.kernels`` states
    (``INNER`` up to 128, its limit; at 256 they wrap and this test fails), and the moments stay
    exact."""
    monkeypatch.setitem(diag.CONFIG, "INNER", inner)
    span = diag.CONFIG["BLOCK"] * inner
    n = 2 * span + 3
    words = {  # each element's words all -2**15 (low) or all 2**15 - 1 (high)
        torch.float32: (torch.int32, -(2**31) + 0x8000, 0x7FFF7FFF),
        torch.float16: (torch.int16, -(2**15), 0x7FFF),
        torch.bfloat16: (torch.int16, -(2**15), 0x7FFF),
    }
    grads = [torch.full((n,), w, dtype=view).view(dtype)
             for dtype, (view, low, high) in words.items() for w in (low, high)]  # fmt: skip
    result = tp.grad_pass([g.to(device) for g in grads], primes=PRIMES, norm_type=None)
    assert result.moments.cpu().tolist() == [ref_moments(g, PRIMES) for g in grads]
    # the case reaches the bound: whole flushes of one block, every u = +-2**16 (float32)
    tables = diag.tables_for([g.contiguous() for g in grads], None)
    assert tables.chunk >= span and n > span
    assert grads[0][:1].view(torch.int16).tolist() == [-(2**15)] * 2


@pytest.mark.parametrize("device", DEVICES)
def test_moments_see_a_flipped_bit(device):
    grads = [g.to(device) for g in grads_mixed(3, sizes=(300, 300, 300))]
    before = tp.grad_pass(grads, primes=PRIMES).moments.clone()
    for t, (index, bit) in zip(grads, [(0, 31), (299, 0), (150, 14)]):
        b = bits(t)
        b[index] ^= (1 << bit) if bit < 15 else -(1 << bit)  # the sign bit
    after = tp.grad_pass(grads, primes=PRIMES).moments
    assert after.cpu().tolist() == [ref_moments(g, PRIMES) for g in grads]
    assert (before != after).any(dim=1).all()


# ---------------------------------------------------------------------- flags and found


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("where", ["first-first", "first-last", "last-first", "last-last"])
def test_nonfinite_at_the_edges_is_flagged_exactly(device, value, where):
    grads = grads_mixed(4, sizes=(130, 7, 260, 65))
    tensor, element = where.split("-")
    t = 0 if tensor == "first" else len(grads) - 1
    grads[t][0 if element == "first" else -1] = value
    grads = [g.to(device) for g in grads]
    for norm_type in (None, 2.0):
        result = tp.grad_pass(grads, norm_type=norm_type)
        ord_ = 2.0 if norm_type == 2.0 else math.inf
        expected = torch.stack(torch._foreach_norm(grads, ord_, dtype=torch.float32)).cpu()
        per_tensor = result.per_tensor.cpu()
        assert result.found.item() == 1.0
        # the poisoned tensor exactly as torch has it (NaN, or inf), the others finite
        assert torch.equal(per_tensor.isnan(), expected.isnan())
        assert torch.equal(per_tensor.isinf(), expected.isinf())
        assert (
            not per_tensor[[i for i in range(len(grads)) if i != t]].isfinite().logical_not().any()
        )
        assert not per_tensor[t].isfinite()
        if norm_type is None:  # the max is exact
            assert torch.equal(per_tensor[expected.isfinite()], expected[expected.isfinite()])
        else:
            assert math.isnan(result.norm_stat.item()) == math.isnan(value)


@pytest.mark.parametrize("device", DEVICES)
def test_clean_gradients_found_zero_and_max_exact(device):
    grads = [g.to(device) for g in grads_mixed(5, sizes=(1, 3, 700, 2049, 5000))]
    grads.append(torch.full((9,), 65504.0, dtype=torch.float16, device=device))  # fp16's max
    result = tp.grad_pass(grads)
    expected = torch.stack(torch._foreach_norm(grads, math.inf, dtype=torch.float32))
    assert result.found.item() == 0.0 and result.norm_stat is None
    assert result.stat.dtype == torch.float32 and result.stat.shape == (2,)
    assert torch.equal(result.per_tensor.cpu(), expected.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_negative_zero_and_denormals(device):
    grads = [torch.tensor([-0.0, 0.0, -0.0], dtype=dtype, device=device) for dtype in DTYPES] + [
        torch.tensor(
            [torch.finfo(dtype).smallest_normal / 4, -torch.finfo(dtype).tiny / 8],
            dtype=dtype,
            device=device,
        )  # fmt: skip
        for dtype in DTYPES
    ]
    # denormals: nonzero, finite
    assert all((g != 0).all() for g in grads[3:])
    result = tp.grad_pass(grads, norm_type=1.0, primes=PRIMES)
    assert result.found.item() == 0.0
    max_norms = torch.stack(torch._foreach_norm(grads, math.inf, dtype=torch.float32))
    flags = tp.grad_pass(grads).per_tensor
    assert torch.equal(flags.cpu(), max_norms.cpu())
    assert (flags[:3] == 0).all() and (flags[3:] > 0).all()  # the denormals' max is exact
    l1 = sum(float(g.double().abs().sum()) for g in grads)
    assert result.norm_stat.item() == pytest.approx(l1, rel=1e-6)
    # -0.0's sign bit is in the checksum
    assert result.moments.cpu().tolist() == [ref_moments(g, PRIMES) for g in grads]
    assert result.moments[0].tolist() != [0, 0, 0, 0]


# ---------------------------------------------------------------------- the norm


@pytest.mark.parametrize("device", DEVICES)
def test_two_norm_within_the_stated_bound(device):
    grads = [g.to(device) for g in grads_mixed(6, sizes=(1, 5000, 33000, 70000, 3))]
    numels = [g.numel() for g in grads]
    weights = [1.0, 0.5, 0.25, 1.0, 2.0]
    result = tp.grad_pass(grads, norm_type=2.0, weights=weights)
    bound = tp.norm_bound(numels)
    assert 0 < bound < 1e-5
    exact = [exact_sumsq(g) for g in grads]
    total = sum(w * e for w, e in zip(weights, exact))
    assert abs(result.norm_stat.item() - total) <= bound * total
    ours = result.per_tensor.cpu().double()
    for i, e in enumerate(exact):
        assert abs(float(ours[i]) - math.sqrt(e)) <= (bound / 2 + 2 * U) * math.sqrt(e)
    # torch's recipe (clip_grad_norm_): _foreach_norm, stack, vector_norm; its bound is the
    # same form with a sequential sum's depth (the tensor's size) at worst
    per_tensor = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    torch_bound = tp.norm_bound([1]) + max(numels) * U
    assert torch.allclose(ours, per_tensor.cpu().double(), rtol=bound + torch_bound, atol=0)
    unweighted = tp.grad_pass(grads, norm_type=2.0).norm_stat.item()
    torch_total = torch.linalg.vector_norm(per_tensor).item() ** 2
    assert abs(unweighted - torch_total) <= (bound + torch_bound) * torch_total
    assert unweighted != result.norm_stat.item()  # the weights were applied


@pytest.mark.parametrize("device", DEVICES)
def test_one_and_inf_norms(device):
    grads = [g.to(device) for g in grads_mixed(7, sizes=(10, 3000, 5000))]
    l1 = tp.grad_pass(grads, norm_type=1.0, weights=[1.0, 0.5, 1.0]).norm_stat.item()
    exact = sum(w * float(g.double().abs().sum()) for g, w in zip(grads, [1.0, 0.5, 1.0]))
    assert abs(l1 - exact) <= tp.norm_bound([10, 3000, 5000], 1.0) * exact
    linf = tp.grad_pass(grads, norm_type=math.inf, weights=[0.0, 0.0, 0.0]).norm_stat
    assert linf.item() == max(float(g.abs().max()) for g in grads)  # exact, weights ignored


@pytest.mark.parametrize("device", DEVICES)
def test_same_bits_on_every_run(device):
    grads = [g.to(device) for g in grads_mixed(8, sizes=(100, 70000, 40000, 3))]
    runs = [tp.grad_pass(grads, norm_type=2.0, primes=PRIMES) for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(bits(r.stat), bits(runs[0].stat))
        assert torch.equal(bits(r.per_tensor), bits(runs[0].per_tensor))
        assert torch.equal(r.moments, runs[0].moments)


# ---------------------------------------------------------------------- sizes


@pytest.mark.parametrize("device", DEVICES)
def test_no_tensors_empty_and_one_element(device):
    result = tp.grad_pass([], norm_type=2.0, primes=PRIMES, device=device)
    assert result.stat.tolist() == [0.0, 0.0] and result.stat.device.type == device
    assert result.per_tensor.shape == (0,) and result.moments.shape == (0, 4)
    grads = [torch.empty(0, device=device), torch.tensor([-2.5], device=device).half()]
    result = tp.grad_pass(grads, norm_type=2.0, primes=PRIMES)
    assert result.stat.tolist() == [0.0, 6.25]
    assert result.per_tensor.tolist() == [0.0, 2.5]
    assert result.moments.cpu().tolist() == [ref_moments(g, PRIMES) for g in grads]
    only_empty = tp.grad_pass([torch.empty(0, 3, device=device)], norm_type=math.inf)
    assert only_empty.stat.tolist() == [0.0, 0.0]


@interpreted
def test_many_tiny_tensors_in_two_launches(small_config):
    """2,000 tensors of 1 to 3 elements, more partials than the reduction's tiles (16 here): the
    tables, every program and the fixed-order totals. Not 10,000: the interpreter spends ~5 ms per
    tensor (its read and its reduction program), so 10,000 took 141 s on the 2-core dev machine
    under load (2,000: 9 s unloaded); the kernel does the same per tensor at any count."""
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(1 + i % 3, generator=gen).to(DTYPES[i % 3]) for i in range(2000)]
    grads[1234][0] = float("inf")
    start = time.perf_counter()
    result = tp.grad_pass(grads, norm_type=2.0)
    elapsed = time.perf_counter() - start
    assert result.found.item() == 1.0
    per_tensor = result.per_tensor
    expected = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    assert per_tensor.isinf().nonzero().flatten().tolist() == [1234]
    finite = expected.isfinite()
    assert torch.allclose(per_tensor[finite], expected[finite], rtol=4 * U, atol=0)
    assert elapsed < 120, f"the interpreter took {elapsed:.0f} s for 2,000 tensors"


# ---------------------------------------------------------------------- int64 addressing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [2**31 + 5, 2**32 - 3, 2**33 + 1])
def test_offsets_past_two_to_the_31(device, offset):
    """A fake table entry whose tensor starts ``offset`` elements before a real buffer and whose
    blocks start at and past ``offset``: the kernels address the real buffer only through int64
    offsets above 2**31 (and word indices above 2**32), as for a tensor of 2**31+ elements."""
    for dtype in (torch.float32, torch.bfloat16):
        real = (torch.randn(700, generator=torch.Generator().manual_seed(offset)) * 3).to(dtype)
        real = real.to(device)
        size = real.element_size()
        chunk = 256
        starts = [offset + k * chunk for k in range(3)]  # the last block is partial (700)
        tables = diag.build_tables(
            [real.data_ptr() - offset * size], [offset + 700], [diag.DTYPE_KIND[dtype]], None,
            chunk, real.device, block_starts=[starts],
        )  # fmt: skip
        stat = torch.empty(2, dtype=torch.float32, device=device)
        per_tensor = torch.empty(1, dtype=torch.float32, device=device)
        moments = torch.empty((1, 4), dtype=torch.int64, device=device)
        diag.launch_pass(tables, stat, per_tensor, moments, 2, True, PRIMES)
        _sync(device)
        words = real.cpu().view(-1).view(torch.int16).tolist()
        k0 = offset * size // 2  # the first real word's index in the fake tensor
        a = sum(words)
        b = sum((k0 + k) * w for k, w in enumerate(words))
        assert abs(b) > 2**40  # the indices really are past 2**32
        assert moments.cpu().tolist() == [
            [a % PRIMES[0], a % PRIMES[1], b % PRIMES[0], b % PRIMES[1]]
        ]
        exact = exact_sumsq(real)
        assert abs(stat[1].item() - exact) <= tp.norm_bound([700]) * exact
        assert stat[0].item() == 0.0
        # the write pass through the same fake table
        before = real.clone()
        factor = torch.tensor(0.75, device=device)
        diag.launch_scale(tables, factor, divide=False)
        expected = before.clone()
        torch._foreach_mul_([expected], factor)
        assert_same_bits(real, expected)


# ---------------------------------------------------------------------- the write pass


def _specials(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    t = (torch.randn(n, generator=gen) * 100).to(dtype)
    t[:8] = torch.tensor(
        [
            float("inf"),
            -float("inf"),
            float("nan"),
            -0.0,
            info.max,
            -info.max,
            info.smallest_normal / 2,
            -info.tiny / 4,
        ]  # fmt: skip
    ).to(dtype)
    return t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor", [1 / 3, 0.7, 2.0**-14, 65504.0 * 4, 1e-30, 1.0])
def test_scale_and_div_bit_identical_to_torch(device, factor):
    """``factor_in_dtype=False``: torch's unscale kernel (float32 and float16 on a GPU, which has
    no bfloat16 one; every dtype on the CPU), torch's CPU ``_foreach_mul_``/``_foreach_div_``, and
    on a GPU torch's own cast of the float32 product. ``factor_in_dtype=True``: torch's foreach ops
    with the factor in the tensors' dtype, and on a GPU its ``_foreach_mul_``/``_foreach_div_``
    with the float32 factor (its per-tensor path casts it)."""
    grads = [_specials(dtype, 3000 + i, i).to(device) for i, dtype in enumerate(DTYPES * 2)]
    f = torch.tensor(factor, dtype=torch.float32, device=device)
    for divide in (False, True):
        ours = [g.clone() for g in grads]
        (tp.div_ if divide else tp.scale_)(ours, f)
        in_dtype = [g.clone() for g in grads]
        (tp.div_ if divide else tp.scale_)(in_dtype, f, factor_in_dtype=True)
        for dtype in DTYPES:
            pick = [i for i, g in enumerate(grads) if g.dtype == dtype]
            group = [grads[i].clone() for i in pick]
            (torch._foreach_div_ if divide else torch._foreach_mul_)(group, f.to(dtype))
            for i, t in zip(pick, group):
                assert_same_bits(in_dtype[i], t)
            group = [grads[i].clone() for i in pick]
            (torch._foreach_div_ if divide else torch._foreach_mul_)(group, f)
            for i, t in zip(pick, group):  # torch's own, with the float32 factor
                assert_same_bits(in_dtype[i] if device == "cuda" else ours[i], t)
            if device == "cuda" and dtype != torch.float32:  # torch's cast of the fp32 result
                for i in pick:
                    x = grads[i].float()
                    assert_same_bits(ours[i], (x / f if divide else x * f).to(dtype))
            if divide or (device == "cuda" and dtype == torch.bfloat16):
                continue
            group = [grads[i].clone() for i in pick]
            torch._amp_foreach_non_finite_check_and_unscale_(
                group, torch.zeros(1, device=device), f
            )
            for i, t in zip(pick, group):
                assert_same_bits(ours[i], t)


@pytest.mark.parametrize("device", DEVICES)
def test_scale_leaves_what_it_does_not_own_to_torch(device):
    grads = [torch.randn(6, 5, device=device).t(), torch.randn(40, device=device).double(),
             torch.randn(6, 5, device=device).bfloat16().t()]  # fmt: skip
    expected = [g.clone() for g in grads]
    f = torch.tensor(0.3, device=device)
    tp.div_(grads, f)
    torch._foreach_div_(expected[:2], f)
    expected[2] = (expected[2].float() / f).bfloat16()
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)


# ---------------------------------------------------------------------- finish


@pytest.mark.parametrize("device", DEVICES)
def test_finish_matches_torch_ops(device):
    """p = 2 (and 1): the float64 statistic's norm, T / scale and T / max_norm computed in float64
    and rounded once to float32, as torch's ops give them; an overflow where either passes
    float32's range. p = inf: float32 statistic and IEEE float32 divisions."""
    scale = torch.tensor(1024.0, device=device)
    max_norm = torch.tensor(1.0, device=device)
    f64 = torch.float64
    cases = [[0.0, 2.5e7], [0.0, 1.0], [2.0, 9.0], [0.0, float("inf")], [0.0, float("nan")],
             [0.0, 1e80], [0.0, 1.3e77]]  # fmt: skip
    for flag, s in cases:
        stat = torch.tensor([flag, s], device=device, dtype=f64)
        out = tp.finish(stat, scale, max_norm=max_norm)
        t = torch.sqrt(stat[1])
        norm, q = (t / scale).float(), (t / max_norm).float()
        bad = flag > 0 or not (math.isfinite(norm.item()) and math.isfinite(q.item()))
        assert out.found_inf.item() == (1.0 if bad else 0.0), s
        expected_scale = scale if bad else torch.fmax(q, scale)
        assert torch.equal(bits(out.grad_scale), bits(expected_scale))
        if not bad:
            assert torch.equal(bits(out.total_norm), bits(norm))
    assert tp.finish(torch.tensor([0.0, 1.3e77], dtype=f64, device=device), scale,
                     max_norm=torch.tensor(1e30, device=device)).found_inf.item() == 0.0  # fmt: skip
    out = tp.finish(torch.tensor([0.0, 0.0], device=device), scale, norm_type=None)
    assert out.out.tolist() == [0.0, 1024.0, 0.0]
    small = torch.tensor(1e-3, device=device)
    stat = torch.tensor([0.0, 3.0], device=device)
    out = tp.finish(stat, scale, norm_type=math.inf, max_norm=small)
    assert torch.equal(out.grad_scale, torch.fmax(stat[1] / small, scale))  # 2999.9998
    assert out.found_inf.item() == 0.0 and torch.equal(out.total_norm, stat[1] / scale)
    # a scale below 1: a finite statistic whose norm passes float32's range once unscaled is an
    # overflow for every p
    for norm_type, sc, s in [(1.0, 0.5, 3e38), (math.inf, 0.5, 3e38), (2.0, 1e-30, 1e30)]:
        sc_t = torch.tensor(sc, device=device)
        dtype = torch.float32 if norm_type == math.inf else f64
        stat = torch.tensor([0.0, s], device=device, dtype=dtype)
        out = tp.finish(stat, sc_t, max_norm=max_norm, norm_type=norm_type)
        t = torch.sqrt(stat[1]) if norm_type == 2.0 else stat[1]
        assert math.isinf((t / sc_t).float().item()) and out.found_inf.item() == 1.0, norm_type
        assert torch.equal(out.total_norm, (t / sc_t).float())
        assert torch.equal(out.grad_scale, sc_t)
    with pytest.raises(ValueError, match="stat must be a torch.float64 tensor"):
        tp.finish(torch.tensor([0.0, 1.0], device=device), scale, max_norm=max_norm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [None, 2.0, 1.0, math.inf])
def test_phase_without_a_collective_finishes_in_the_reduction(device, norm_type):
    """``phase(reduce=None, validate=False)`` (one rank: the reduction writes found_inf,
    grad_scale and the norm) gives what the checked phase with a collective in between gives,
    bit for bit: clean, inf, NaN, clipped or not, unscaled in place, float64 among them."""
    scale = torch.tensor(1024.0, device=device)
    for poison, unscale, clip, extra64 in [(None, False, False, False), (None, True, True, False),
                                           (math.inf, False, True, False),
                                           (math.nan, True, False, False),
                                           (None, False, True, True)]:  # fmt: skip
        grads = [g.to(device) for g in grads_mixed(31, sizes=(1, 700, 2049, 5, 300))]
        if extra64:
            grads.append(torch.randn(50, dtype=torch.float64, device=device))
        if poison is not None:
            grads[1].view(-1)[-1] = poison
        twin = [g.clone() for g in grads]
        kwargs = dict(norm_type=norm_type, flags=True, primes=PRIMES,
                      unscale=(1.0 / scale) if unscale else None,
                      max_norm=torch.tensor(0.5, device=device) if norm_type else None,
                      clip=clip and norm_type is not None, device=device)  # fmt: skip
        seen: list[torch.Tensor] = []
        a, a_done = tp.phase(grads, scale, lambda stat, _, seen=seen: seen.append(stat), **kwargs)
        b, b_done = tp.phase(twin, scale, None, validate=False, **kwargs)
        _sync(device)
        assert len(seen) == 1  # the collective's place was taken
        assert torch.equal(bits(a.stat), bits(b.stat))
        assert torch.equal(bits(a_done.out), bits(b_done.out)), (a_done.out, b_done.out)
        assert torch.equal(a.moments, b.moments)
        assert torch.equal(a.per_tensor.nan_to_num(nan=-1.0), b.per_tensor.nan_to_num(nan=-1.0))
        for g, h in zip(grads, twin):
            assert torch.equal(g.nan_to_num(nan=-1.0), h.nan_to_num(nan=-1.0))
        assert b_done.found_inf.item() == (0.0 if poison is None else 1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [None, 2.0, math.inf])
def test_the_reduction_writes_the_report_flags_as_nan_to_num_does(device, norm_type):
    """``phase(report_flags=True)``: the per-tensor statistics written as the overflow report's flags
    by the reduction (the scaler's step where the host reads nothing), bit for bit what
    `distscaler.attribution.flag_tensors()` makes of the plain statistics: a NaN tensor, an inf
    one, one of finite values whose squares overflow (its 2-norm saturates at float32's largest:
    not flagged, docs/pass-semantics.md), -inf, clean ones; on one
    rank (the reduction finishes) and with a collective, checked and unchecked, float64 among
    them (torch's ops)."""
    from distscaler.attribution import flag_tensors

    scale = torch.tensor(1.0, device=device)
    for extra64, reduce in [(False, None), (False, lambda *a: None), (True, None)]:
        grads = [g.to(device) for g in grads_mixed(7, sizes=(1, 700, 2049, 5, 300, 64))]
        grads[0].view(-1)[0] = math.nan
        grads[1].view(-1)[-1] = math.inf
        grads[3].view(-1)[2] = -math.inf
        grads[5] = torch.full((64,), 3e38, device=device)  # finite; its squares are not
        if extra64:
            grads.append(torch.tensor([math.nan, 1.0], dtype=torch.float64, device=device))
        plain, _ = tp.phase(grads, scale, reduce, norm_type=norm_type, validate=False)
        expected = flag_tensors(plain.per_tensor)
        assert expected.lt(0).sum().item() == 3 + extra64  # seen: the inf/NaN ones only
        big = plain.per_tensor[5].item()  # type: ignore[index]
        assert big == torch.finfo(torch.float32).max or norm_type != 2.0
        for validate in (False, True):
            coded, _ = tp.phase(grads, scale, reduce, norm_type=norm_type, validate=validate,
                                report_flags=True)  # fmt: skip
            _sync(device)
            assert torch.equal(bits(coded.per_tensor), bits(expected)), (coded.per_tensor, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_the_reduction_sums_the_replica_slots_as_checksum_slots(device):
    """``phase(terms=...)``: the reduction's int64 atomics give exactly the slot sums of torch's
    ops (`slot_sums`), for replica sets of
    2 to 5 ranks at every position (negative coefficients among them) and unchecked tensors; the
    checked phase and float64 gradients (torch's pass) give the same. (Torch's path,
    `rank_slots()`, values a word by its signed bytes: other residues, the same guarantee; the
    ranks of one run all take one path.)"""
    from distscaler._replica import ReplicaCheck
    from distscaler._replica.checksum import (
        coefficient,
        global_rows,
        layout_terms,
        moduli_tensor,
        naming_rows,
        word_moments,
    )
    from distscaler.replica_check import ReplicaSet

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(5)
    for trial in range(6):
        grads = [g.to(device) for g in grads_mixed(40 + trial, sizes=(0, 1, 3, 700, 2049, 64))]
        if trial == 5:
            grads.append(torch.randn(33, dtype=torch.float64, device=device))
        sets = []
        for _ in grads:
            replicas = int(torch.randint(1, 6, (1,), generator=gen))
            position = int(torch.randint(0, max(replicas, 1), (1,), generator=gen))
            sets.append(None if replicas == 1 else ReplicaSet(tuple(range(replicas)), position))
        terms = ReplicaCheck(True, None, 1000, "skip").layout_terms("gradients", grads, sets, dev)
        words = [g.numel() * g.element_size() // 2 for g in grads]
        assert torch.equal(terms, layout_terms(words, sets, dev))
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        for validate in (False, True):
            tp.phase(
                [g.clone() for g in grads], torch.tensor(1.0, device=device),
                lambda stat, moments, sums, seen=seen: seen.append((moments, sums)),
                norm_type=2.0, primes=PRIMES, terms=terms, validate=validate, device=device,
            )  # fmt: skip
        _sync(device)
        assert len(seen) == 2
        (moments, sums), (_, checked_sums) = seen
        assert torch.equal(moments, word_moments(grads, dev)), trial
        assert torch.equal(sums, tp.slot_sums(moments, terms, PRIMES)), trial
        assert torch.equal(sums, checked_sums), trial
        residues = sums.remainder(moduli_tensor(dev, 8))
        assert not residues[6:].any()  # no keys: no keyed sums
        assert torch.equal(global_rows(moments, terms), naming_rows(grads, sets, None, dev)[:, :4])
    assert any(s is not None and coefficient(s.position, len(s.ranks)) < 0 for s in sets)


def _python_keyed(t: torch.Tensor, first: int, a: list[list[int]], d: list[list[int]]) -> list[int]:
    """A tensor's keyed sums with Python integers: ``sum_k a[k mod 512][q] * d[first + k div
    512][q] * w_k`` modulo each prime, over its words ``w_k`` as signed int16."""
    words = t.detach().cpu().contiguous().view(-1).view(torch.int16).tolist()
    return [sum(a[k % 512][q] * d[first + k // 512][q] * w for k, w in enumerate(words)) % p
            for q, p in enumerate(PRIMES)]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [64, 1024], ids=["tile-below-a-row", "tiles-of-rows"])
def test_the_keyed_sums_are_exact_at_any_offset_and_caught_what_the_fixed_weights_miss(
    device, block, monkeypatch
):
    """``grad_pass(keys=...)``: each tensor's keyed sums (the moments' columns 4 and 5) equal the
    Python-integer sums over its words, and the reduction's slots add them (``sums[6:8]``), for
    views at every offset 0 to 7 of every dtype (head blocks, rows cut across tiles: the launch's
    tile of 32 elements is below a row, of 512 holds one or two rows), unchecked tensors (0) and
    three replica sets; the torch reference (`keyed_sums`) agrees. Then the kernel path of the
    replica check: a second difference (+1, -2, +1 on three neighbouring words of one rank), which
    ``A``, ``B`` and ``C`` cannot see, leaves the fixed slots as a clean set's and moves ``R``."""
    from distscaler._replica.checksum import Key, kernel_keys, layout_terms, moduli_tensor
    from distscaler._triton.reference import keyed_sums
    from distscaler.replica_check import ReplicaSet

    monkeypatch.setitem(diag.CONFIG, "BLOCK", block)
    monkeypatch.setitem(diag.CONFIG, "INNER", 4)
    monkeypatch.setitem(diag.CONFIG, "RT", 16)
    monkeypatch.setitem(diag.CONFIG, "target_blocks", 40)
    monkeypatch.setitem(diag.CONFIG, "max_chunk", 4 * block)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(11)
    sets_of = [ReplicaSet((0, 1), 1), ReplicaSet((0, 2, 4), 2), ReplicaSet((1, 3, 5, 7), 0), None]
    grads, sets = [], []
    for i, offset in enumerate(range(8)):
        dtype = DTYPES[i % 3]
        buffer = torch.randn(1400 + 37 * i, generator=gen).to(dtype).to(device)
        grads.append(buffer[offset : offset + 1300 + 11 * i])
        sets.append(sets_of[i % 4])
    sizes = [g.numel() * g.element_size() // 2 for g in grads]
    key = Key(0x5EED + block)
    keys = kernel_keys(sizes, sets, key, dev)
    n = len(grads)
    a = keys[:1024].view(512, 2).tolist()
    first = keys[1024 : 1024 + n].tolist()
    d = keys[1024 + n :].view(-1, 2).tolist()
    taken = tp.grad_pass(grads, norm_type=2.0, primes=PRIMES, keys=keys)
    _sync(device)
    expected = torch.tensor([_python_keyed(g, f, a, d) if f >= 0 else [0, 0]
                             for g, f in zip(grads, first)])  # fmt: skip
    assert first.count(-1) == 2 and expected[[f >= 0 for f in first]].all()
    assert torch.equal(taken.moments[:, 4:].cpu(), expected)
    assert torch.equal(keyed_sums(grads, keys, PRIMES).cpu(), expected)
    assert torch.equal(taken.moments[:, :4].cpu(), torch.tensor([ref_moments(g, PRIMES) for g in grads]))
    terms = layout_terms(sizes, sets, dev)
    seen = []
    tp.phase([g.clone() for g in grads], torch.tensor(1.0, device=device),
             lambda stat, moments, sums: seen.append(sums), norm_type=2.0, primes=PRIMES,
             terms=terms, keys=keys, device=device, validate=False)  # fmt: skip
    _sync(device)
    assert torch.equal(seen[0][6:].cpu() % torch.tensor(PRIMES), expected.sum(0) % torch.tensor(PRIMES))
    clean = tp.slot_sums(taken.moments, terms, PRIMES).remainder(moduli_tensor(dev, 8))

    # a second difference on words 100..102 of a checked float16 tensor (index 1: set (0, 2, 4))
    changed = [g.clone() for g in grads]
    w = changed[1].view(torch.int16)
    w[100:103] += torch.tensor([1, -2, 1], dtype=torch.int16, device=device)
    moved = tp.slot_sums(tp.grad_pass(changed, primes=PRIMES, keys=keys).moments, terms, PRIMES)
    moved = moved.remainder(moduli_tensor(dev, 8))
    assert torch.equal(moved[:6], clean[:6])  # A, B, C: as the clean words'
    assert not torch.equal(moved[6:], clean[6:])  # R: moved


@pytest.mark.parametrize("device", DEVICES)
def test_views_at_any_offset_read_aligned_after_a_head(device):
    """Gradients that are views at odd element offsets (a bucket's, a flat buffer's): each gets
    a head block of the elements before its first 16-byte boundary (read by the unaligned
    branches), then aligned blocks; the pass, the moments and the write pass give what fresh
    tensors give."""
    for dtype in DTYPES:
        source = (torch.randn(40_000, generator=torch.Generator().manual_seed(7)) * 5).to(dtype)
        buffer = source.to(device)
        views = [buffer[1:9001], buffer[9003:9006], buffer[9011:39_000]]
        fresh = [v.clone() for v in views]
        tables = diag.tables_for(views, None)
        nb, size = tables.num_blocks, source.element_size()
        owners, starts, counts, _ = block_rows(tables)
        for t, v in enumerate(views):
            mine = [b for b in range(nb) if owners[b] == t]
            head = (16 - v.data_ptr() % 16) % 16 // size
            assert head > 0 and starts[mine[0]] == 0 and counts[mine[0]] == min(head, v.numel())
            assert not tables.aligned[mine[0]] and all(tables.aligned[b] for b in mine[1:])
            assert sum(counts[b] for b in mine) == v.numel()  # every element, once
        assert bool(diag.tables_for(fresh, None).aligned.all())
        a = tp.grad_pass(views, norm_type=2.0, primes=PRIMES)
        b = tp.grad_pass(fresh, norm_type=2.0, primes=PRIMES)
        _sync(device)
        assert a.found.item() == 0.0 and torch.equal(a.moments, b.moments)
        # other blocks, so other sums of the squares: each within the stated bound of the exact
        exact = [exact_sumsq(v) for v in views]
        bound = tp.norm_bound([v.numel() for v in views])
        assert abs(a.norm_stat.item() - sum(exact)) <= bound * sum(exact)
        for norm, e in zip(a.per_tensor.cpu().tolist(), exact):
            assert abs(norm - math.sqrt(e)) <= (bound / 2 + 2 * U) * math.sqrt(e)
        maxima = tp.grad_pass(views).per_tensor
        assert torch.equal(maxima, tp.grad_pass(fresh).per_tensor)  # a max: the same bits
        factor = torch.tensor(1 / 3, device=device)
        tp.div_(views, factor)
        tp.div_(fresh, factor)
        _sync(device)
        assert all(torch.equal(bits(v), bits(f)) for v, f in zip(views, fresh))
        assert torch.equal(bits(buffer[:1].cpu()), bits(source[:1]))  # outside the views: kept


def test_aligned_kernels_compile_to_16_byte_vector_accesses():
    """Compiled for an H100 (on the CPU: PTX, no GPU), the read and write kernels' branches for
    16-byte aligned blocks access every full tile in 16-byte vectors (``ld.global.v4.b32``; the
    write kernel's stores too): one vector per 16 bytes a thread holds, for each of the three
    dtypes. No more than that: the branches for unaligned blocks (views at any offset) keep
    scalar accesses, as does the masked last tile of a block in both."""
    if not diag.can_compile_for_a_gpu():
        pytest.skip("compiling for a GPU on the CPU needs Triton >= 3.3 and its CUDA backend")
    cfg = diag.CONFIG
    threads = 32 * cfg["num_warps"]
    vectors = sum(cfg["BLOCK"] * size // (threads * 16) for size in (4, 2, 2))  # f32, f16, bf16
    read = {"NORM": 2, "BLOCK": cfg["BLOCK"], "INNER": cfg["INNER"], "DYNAMIC": False,
            "UNSCALED": True, "KEYED": False, "ROW": 512}  # fmt: skip
    write = {"DIVIDE": True, "ROUND": True, "BLOCK": cfg["BLOCK"]}
    for moments in (False, True):
        found = diag.ptx_accesses(diag.compile_for_a_gpu("_read_kernel", {**read, "MOMENTS": moments}))
        assert found["ld.global.v4.b32"] == vectors, found
        assert not {a for a in found if ".v" in a} - {"ld.global.v4.b32"}, found
        assert found["ld.global.b16"] > 0 and found["ld.global.b32"] > 0, found  # the others
    found = diag.ptx_accesses(diag.compile_for_a_gpu("_scale_kernel", write))
    assert found["ld.global.v4.b32"] == vectors == found["st.global.v4.b32"], found
    assert found["st.global.b16"] > 0 and found["st.global.b32"] > 0, found


def test_the_checksum_keeps_32_warps_per_sm_in_the_read_kernel():
    """Compiled for an H100 on the CPU, the read kernel with the checksum (``MOMENTS``) takes
    at most 64 registers per thread and spills none: 4 blocks of 8 warps, 32 warps per SM (with
    its int32 sums kept per element it took 124: 16 warps). Its rows are reshaped without a
    layout conversion (each row is one thread's), so the tile loop moves nothing through shared
    memory for them."""
    if not diag.can_compile_for_a_gpu():
        pytest.skip("compiling for a GPU on the CPU needs Triton >= 3.3 and its CUDA backend")
    cfg = diag.CONFIG
    consts = {"NORM": 2, "MOMENTS": True, "BLOCK": cfg["BLOCK"], "INNER": cfg["INNER"],
              "DYNAMIC": False, "UNSCALED": True, "KEYED": False, "ROW": 512}  # fmt: skip
    compiled = diag.compile_for_a_gpu("_read_kernel", consts)
    resources = diag.registers(compiled)
    if not resources:
        pytest.skip("Triton's bundled cuobjdump did not run here")
    assert resources["REG"] <= 64 and resources["STACK"] == 0, resources
    ir = compiled.asm["ttgir"]
    assert "tt.reshape" in ir and "convert_layout" not in ir
    # With the keyed sums (every INTERVAL updates), on half the tile as the launch takes them:
    # at most 104 registers, no spill (16 warps per SM), the spans reduced without a layout
    # conversion; on the whole tile it would take 166 (8 warps).
    keyed = dict(consts, KEYED=True, BLOCK=cfg["BLOCK"] // 2, INNER=cfg["INNER"] * 2)
    compiled = diag.compile_for_a_gpu("_read_kernel", keyed)
    resources = diag.registers(compiled)
    assert resources["REG"] <= 104 and resources["STACK"] == 0, resources
    assert "convert_layout" not in compiled.asm["ttgir"]


def test_the_slot_sums_compile_to_relaxed_integer_reductions():
    """The reduction's replica slots (``SLOTS``), compiled for an H100 on the CPU: six 64-bit
    integer reductions without a return value or ordering (``red.global.gpu.relaxed.add.u64``),
    none without them. (With the overflow report's flags written by the reduction, as the scaler's
    step on a GPU launches it.)"""
    if not diag.can_compile_for_a_gpu():
        pytest.skip("compiling for a GPU on the CPU needs Triton >= 3.3 and its CUDA backend")
    consts = {"NORM": 2, "PER_TENSOR": True, "MOMENTS": True, "RT": diag.CONFIG["RT"],
              "FINISH": False, "CLIP": False, "AS_FLAGS": True, "NAN_AS": -1.0,
              "INF_AS": -2.0, "UNSCALED": False}  # fmt: skip
    for keyed, count in ((False, 6), (True, 8)):  # with the keyed sums, their two slots too
        consts["KEYED"] = keyed
        with_slots = diag.ptx_accesses(diag.compile_for_a_gpu("_reduce_kernel", {**consts, "SLOTS": True}))
        without = diag.ptx_accesses(diag.compile_for_a_gpu("_reduce_kernel", {**consts, "SLOTS": False}))
        reductions = {a: n for a, n in with_slots.items() if a.startswith(("red.", "atom."))}
        assert reductions == {"red.global.gpu.relaxed.add.u64": count}, with_slots
        assert not {a for a in without if a.startswith(("red.", "atom."))}, without


# ---------------------------------------------------------------------- any gradients

_SPECIALS = (float("inf"), -float("inf"), float("nan"), -0.0, 1e-40, 3e38, -65504.0)


@st.composite
def _gradient_lists(draw):
    """1 to 6 gradients: each a dtype, a size (edges of the small configuration's tiles, chunks
    and 16-byte words likely), a fresh tensor or a view at an element offset of 0 to 9 in a
    buffer, normal values of a magnitude, and up to 2 special values at drawn places."""
    grads = []
    for _ in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        size = draw(st.one_of(st.sampled_from([0, 1, 7, 8, 63, 64, 65, 256, 257, 1024, 1025]),
                              st.integers(0, 2600)))  # fmt: skip
        offset = draw(st.integers(0, 9))
        seed = draw(st.integers(0, 2**16))
        magnitude = draw(st.sampled_from([1e-4, 1.0, 300.0]))
        gen = torch.Generator().manual_seed(seed)
        buffer = (torch.randn(size + offset, generator=gen) * magnitude).to(dtype)
        g = buffer[offset:]
        for _ in range(draw(st.integers(0, 2)) if size else 0):
            g[draw(st.integers(0, size - 1))] = draw(st.sampled_from(_SPECIALS))
        grads.append(g)
    return grads


@interpreted
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(grads=_gradient_lists(), factor=st.sampled_from([1 / 3, 0.7, 2.0**-14, 4096.0]))
def test_any_gradients_against_torch_and_python_integers(small_config, grads, factor):
    """Drawn gradient lists (mixed dtypes, sizes at and between the tiles' edges, views at any
    offset, inf/NaN/-0.0/denormals/extremes at drawn places) through the interpreter: ``found``
    and the per-tensor max exactly torch's, the checksum exactly Python's integers, the
    2-norm within `norm_bound()`, the write pass bit for bit torch's CPU ``_foreach_div_``; the
    blocks cover every element once, and for every block the tables call aligned, what the
    kernels' aligned branches state to the compiler holds (its first element at a multiple of 16
    bytes)."""
    nonfinite = any(not bool(g.isfinite().all()) for g in grads)
    tables = diag.tables_for(grads, None)
    heads = sum(g.numel() > 0 and g.data_ptr() % 16 != 0 for g in grads)
    event(f"views with a head block: {min(heads, 2)}{'+' if heads > 2 else ''}, "
          f"inf/NaN: {nonfinite}, blocks > tensors: {tables.num_blocks > len(grads)}")  # fmt: skip
    taken = tp.grad_pass(grads, norm_type=2.0, primes=PRIMES)
    assert taken.found.item() == float(nonfinite)
    assert taken.moments.tolist() == [ref_moments(g, PRIMES) for g in grads]
    maxima = tp.grad_pass(grads).per_tensor
    expected = torch.stack([torch._foreach_norm([g], math.inf, dtype=torch.float32)[0]
                            if g.numel() else torch.tensor(0.0) for g in grads])  # fmt: skip
    assert torch.equal(maxima.nan_to_num(nan=-1.0), expected.nan_to_num(nan=-1.0))
    if not nonfinite:
        exact = sum(exact_sumsq(g) for g in grads)
        numels = [g.numel() for g in grads]
        # norm_bound() is relative (Higham's, inside float32's range); a square or a sum below
        # its normal range is rounded to a multiple of 2**-149: at most that per operation; one
        # that may pass its largest value is inf (an overflow for the scaler, as torch's norm)
        bound = tp.norm_bound(numels)
        ours = taken.norm_stat.item()
        if ours == math.inf:
            assert exact * (1 + bound) > torch.finfo(torch.float32).max
        else:
            assert abs(ours - exact) <= bound * exact + 2 * sum(numels) * 2.0**-149
    owners, starts, counts, aligned = block_rows(tables)
    for t, start, is_aligned in zip(owners, starts, aligned):  # what the kernels state holds
        if is_aligned:
            assert (grads[t].data_ptr() + start * grads[t].element_size()) % 16 == 0
    for t, g in enumerate(grads):  # every element in one block, once
        assert sum(c for o, c in zip(owners, counts) if o == t) == g.numel()
    f = torch.tensor(factor)
    ours = [g.clone() for g in grads]
    theirs = [g.clone() for g in grads]
    tp.div_(ours, f)
    torch._foreach_div_(theirs, f)
    for a, b in zip(ours, theirs):
        assert_same_bits(a, b)


# ---------------------------------------------------------------------- launches


@interpreted
def test_launches_per_call_on_the_cpu(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    launched: list[str] = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        ops.paused = True  # the interpreter's own copies of the arguments
        try:
            return run(self, *args, **kwargs)
        finally:
            ops.paused = False

    ops = _TorchOps()
    monkeypatch.setattr(InterpretedFunction, "run", counting)
    grads = grads_mixed(10, sizes=(50, 3000, 7))
    tp.grad_pass(grads, norm_type=2.0, primes=PRIMES)  # the tables: built, then cached
    launched.clear()
    with ops:
        result = tp.grad_pass(grads, norm_type=2.0, primes=PRIMES)
    assert launched == ["_read_kernel", "_reduce_kernel"] and tp.LAUNCHES["grad_pass"] == 2
    assert set(ops.names) <= {"aten.empty.memory_format"}, ops.names  # outputs, partials
    launched.clear()
    out = tp.finish(result.stat, torch.tensor(8.0), max_norm=torch.tensor(1.0))
    tp.div_(grads, out.grad_scale)
    assert launched == ["_finish_kernel", "_scale_kernel"]


class _TorchOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.cuda
def test_launches_per_call_on_the_gpu():
    from torch.profiler import ProfilerActivity, profile

    grads = [g.cuda() for g in grads_mixed(11, sizes=(50, 300000, 7, 2_000_000))]
    tp.grad_pass(grads, norm_type=2.0, primes=PRIMES)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = tp.grad_pass(grads, norm_type=2.0, primes=PRIMES)
        out = tp.finish(result.stat, torch.tensor(8.0, device="cuda"),
                        max_norm=torch.tensor(1.0, device="cuda"))  # fmt: skip
        tp.div_(grads, out.grad_scale)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [k for k in kernels if "memcpy" not in k.lower() and "memset" not in k.lower()]
    assert len(kernels) == 4, kernels


# ---------------------------------------------------------------------- float64, errors, ops


def test_float64_goes_to_torch():
    grads = [torch.randn(100).double(), torch.randn(30), torch.tensor([1.0, float("nan")]).double()]
    result = tp.grad_pass(grads, norm_type=2.0, primes=PRIMES)
    assert result.found.item() == 1.0
    assert result.moments.tolist() == [ref_moments(g, PRIMES) for g in grads]
    assert math.isnan(result.per_tensor[2].item())
    assert result.per_tensor[:2].tolist() == pytest.approx(
        [float(g.norm()) for g in grads[:2]], rel=1e-6
    )


@pytest.mark.parametrize("norm_type", [None, 1.0, math.inf])
def test_float64_with_an_empty_tensor_flags_it_as_holding_nothing(norm_type):
    """torch's pass (float64 among the tensors) takes each tensor's largest magnitude for the
    per-tensor statistics where the norm is not the 2-norm: an empty tensor's is 0.0, as in the
    kernels (torch's ``_foreach_norm`` at p = inf raises on it), a NaN's NaN, an inf's inf."""
    grads = [torch.zeros(0, dtype=torch.float64), torch.tensor([1.0, -3.0], dtype=torch.float64),
             torch.zeros(0), torch.tensor([2.0, -math.inf]), torch.tensor([math.nan]).double()]
    result = tp.grad_pass(grads, norm_type=norm_type)
    assert result.found.item() == 1.0
    flags = result.per_tensor.tolist()
    assert flags[:4] == [0.0, 3.0, 0.0, math.inf] and math.isnan(flags[4])
    clean = tp.grad_pass(grads[:3], norm_type=norm_type)  # the norm without the non-finite
    assert clean.found.item() == 0.0
    if norm_type is None:
        assert clean.norm_stat is None
    else:
        assert clean.norm_stat.item() == {1.0: 4.0, math.inf: 3.0}[norm_type]


def test_bad_arguments_are_named():
    g = [torch.randn(3)]
    with pytest.raises(ValueError, match=r"norm_type must be 1.0, 2.0, inf or None .* got: 3.0"):
        tp.grad_pass(g, norm_type=3.0)
    with pytest.raises(
        ValueError, match=r"primes must be odd and in \(2, 2\*\*24\), got: \(4, 7\)"
    ):
        tp.grad_pass(g, primes=(4, 7))
    with pytest.raises(ValueError, match=r"weights must have one float per tensor \(1\), got: 2"):
        tp.grad_pass(g, weights=[1.0, 2.0])
    with pytest.raises(
        TypeError, match=r"tensors\[1\] must be float32, float16, bfloat16 or float64"
    ):
        tp.grad_pass([torch.randn(3), torch.arange(3)])
    with pytest.raises(TypeError, match="tensors must be a list of tensors, got: Tensor"):
        tp.grad_pass(torch.randn(3))
    with pytest.raises(ValueError, match=r"factor must be a 0-dim float32 tensor"):
        tp.scale_(g, torch.ones(2))
    with pytest.raises(ValueError, match=r"divisor must be float32, got: torch.float64"):
        tp.div_(g, torch.tensor(2.0, dtype=torch.float64))


@interpreted
def test_available(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not tp.available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tp.available("cpu")
    assert not tp.available("meta")
    assert tp.available("cuda") == torch.cuda.is_available()


@interpreted
def test_custom_ops_trace_with_fullgraph():
    """A phase that reads, finishes and divides compiles with ``fullgraph=True`` (the ops are
    opaque to the compiler: their fake implementations give the shapes) and gives eager's bits."""
    assert diag.OPS is not None
    grads = grads_mixed(12, sizes=(40, 300, 9))
    scale, max_norm = torch.tensor(64.0), torch.tensor(0.5)

    def phase(grads):
        result = tp.grad_pass(grads, norm_type=2.0, primes=PRIMES)
        out = tp.finish(result.stat, scale, max_norm=max_norm)
        tp.div_(grads, out.grad_scale)
        return result.stat, result.per_tensor, result.moments, out.out

    eager_grads = [g.clone() for g in grads]
    expected = phase(eager_grads)
    compiled = torch.compile(phase, fullgraph=True, backend="aot_eager")
    got = compiled(grads)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    for e, g in zip(eager_grads, grads):
        assert torch.equal(e, g)
    grad_pass = torch.ops.distscaler.grad_pass.default
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        outs = grad_pass([torch.empty(5), torch.empty(3)], torch.device("cpu"), None, 2.0, True,
                         list(PRIMES))  # fmt: skip
    assert [tuple(o.shape) for o in outs] == [(2,), (2,), (2, 4)]
    finished = torch.ops.distscaler.grad_pass_finished.default
    with fake:
        outs = finished([torch.empty(5), torch.empty(3)], torch.device("cpu"), None, 2.0, True,
                        list(PRIMES), torch.empty(()), None)  # fmt: skip
    assert [tuple(o.shape) for o in outs] == [(2,), (2,), (2, 4), (3,)]


@interpreted
def test_the_phase_without_a_collective_traces_as_one_op_and_finishes_in_the_reduction():
    """``phase(reduce=None)`` (one rank) compiled with ``fullgraph=True``: the pass whose
    reduction finishes is one custom op (2 launches, as eager), and the results, the clipped
    gradients and the coded flags are eager's, bit for bit; its arguments are checked as
    ``grad_pass()`` and ``finish()`` check them."""
    grads = grads_mixed(13, sizes=(40, 300, 9))
    grads[1].view(-1)[4] = math.nan
    scale, max_norm = torch.tensor(64.0), torch.tensor(0.5)
    launched: list[str] = []

    def phase(grads):
        taken, done = tp.phase(grads, scale, None, norm_type=2.0, primes=PRIMES, max_norm=max_norm,
                               clip=True, report_flags=True)  # fmt: skip
        return taken.stat, taken.per_tensor, taken.moments, done.out

    eager_grads = [g.clone() for g in grads]
    expected = phase(eager_grads)
    compiled = torch.compile(phase, fullgraph=True, backend="aot_eager")
    got = compiled([g.clone() for g in grads])
    interp = diag.get_kernels(True)
    counted = {n: getattr(interp, n) for n in diag.RAW}
    saved = diag.use_kernels(lambda interpret: types.SimpleNamespace(**{
        n: _Counting(k, n, launched) for n, k in counted.items()}))  # fmt: skip
    try:
        got = compiled(grads)
    finally:
        diag.use_kernels(saved)
        torch._dynamo.reset()
    for e, g in zip(expected, got):
        assert torch.equal(bits(e), bits(g)), (e, g)
    assert expected[1][1].item() == NAN_CODE  # the NaN tensor's flag, as the report keeps it
    for e, g in zip(eager_grads, grads):
        assert torch.equal(bits(e), bits(g))
    assert launched == ["_read_kernel", "_reduce_kernel", "_scale_kernel"], launched
    with pytest.raises(ValueError, match="scale must be a float32 tensor"):
        tp.phase(grads, scale.double(), None, norm_type=2.0)
    with pytest.raises(ValueError, match="max_norm must be a float32 tensor"):
        tp.phase(grads, scale, None, norm_type=2.0, max_norm=max_norm.half())


class _Counting:
    """A kernel whose launches are named into a list, then run."""

    def __init__(self, kernel, name: str, launched: list[str]) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]
