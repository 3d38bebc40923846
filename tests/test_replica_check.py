"""The replica check (distscaler.replica_check): silent data corruption caught at the step.

The arithmetic is checked in this process against exact integers (every single-bit flip of every
dtype changes the verdict; clean replicas never do, and the float32 sums are exact); the behaviour
on gloo: one spawn of 2 ranks (DDP: every listed bit, fp32 and fp16 gradients, fused and foreach
AdamW, clipping on and off, the CPU's path and a GPU's; raise, callable, a parameter flip; 2,000
clean steps; the ops a check adds) and one of 4 ranks (DDP names exactly the flipped rank; FSDP2
HSDP with replicate 2 names the flipped rank and its replica; 3 replicas).
"""

from __future__ import annotations

import itertools
import random

import _replica_scenarios as S
import pytest
import torch
from _harness import spawn
from _torch_gaps import guarded
from hypothesis import given, settings
from hypothesis import strategies as st

from distscaler import GradScaler, ReplicaMismatchError
from distscaler.replica_check import (
    FLOAT32_EXACT,
    MAX_WORLD_SIZE,
    SUSPECT_EVENTS,
    ReplicaLedger,
    ReplicaMismatch,
    bit_sums,
    coefficient,
    local_residues,
    mismatched,
    moduli,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------- the arithmetic, exactly


@pytest.mark.parametrize("replicas", range(2, 12))
def test_coefficients_sum_to_zero_and_are_never_zero(replicas):
    coefs = [coefficient(i, replicas) for i in range(replicas)]
    assert sum(coefs) == 0
    assert all(c != 0 and abs(c) <= 2 for c in coefs)
    assert coefficient(0, 1) == 0


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 1000, 16384, MAX_WORLD_SIZE])
def test_moduli_are_primes_whose_sums_stay_exact_in_float32(world_size):
    p1, p2 = moduli(world_size)
    assert p1 > p2 >= 3
    for p in (p1, p2):
        assert all(p % f for f in range(2, int(p**0.5) + 1))
        assert p * world_size <= FLOAT32_EXACT
    with pytest.raises(ValueError, match="world_size"):
        moduli(MAX_WORLD_SIZE + 1)


def _simulate(replica_grads: list[torch.Tensor], world_size: int) -> tuple[bool, list[float]]:
    """The check's verdict for ``replica_grads`` (one tensor per replica), the all-reduce done in
    float32 in a random order, as a ring would."""
    primes = moduli(world_size)
    p_t = torch.tensor(primes, dtype=torch.int64)
    n = len(replica_grads)
    slots = []
    for i, g in enumerate(replica_grads):
        coef = torch.tensor([coefficient(i, n)], dtype=torch.int64)
        local, _ = local_residues(bit_sums([g], torch.device("cpu")), coef, p_t)
        slots.append(local)
    order = list(range(n))
    random.Random(n).shuffle(order)
    total = torch.zeros(2, dtype=torch.float32)
    exact = [0, 0]
    for i in order:
        total += slots[i]
        exact = [exact[j] + int(slots[i][j]) for j in range(2)]
    assert total.tolist() == exact  # every partial sum exact in float32
    return mismatched(total.tolist(), primes), total.tolist()


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    replicas=st.integers(2, 9),
    numel=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_every_single_bit_flip_changes_the_verdict(dtype, replicas, numel, seed, data):
    torch.manual_seed(seed)
    g = torch.randn(numel).to(DTYPES[dtype])
    width = g.element_size() * 8
    bit = data.draw(st.integers(0, width - 1), label="bit")
    index = data.draw(st.integers(0, numel - 1), label="index")
    bad = data.draw(st.integers(0, replicas - 1), label="bad replica")
    clean = [g.clone() for _ in range(replicas)]
    assert _simulate(clean, replicas)[0] is False  # replicas that agree: never a mismatch
    corrupted = [g.clone() for _ in range(replicas)]
    ints = corrupted[bad].view({2: torch.int16, 4: torch.int32}[g.element_size()])
    ints[index] ^= -(1 << (width - 1)) if bit == width - 1 else 1 << bit
    assert not torch.equal(corrupted[bad].view(ints.dtype), g.view(ints.dtype))
    assert _simulate(corrupted, replicas)[0] is True


def test_bit_sums_keep_the_order_of_mixed_widths():
    tensors = [torch.randn(5), torch.randn(3).half(), torch.randn(4), torch.arange(3)]
    got = bit_sums(tensors, torch.device("cpu")).tolist()
    assert got[3] == 0  # not floating point
    for t, value in zip(tensors[:3], got, strict=False):
        ints = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
        assert value == int(ints.sum(dtype=ints.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bit_sums_change_by_exactly_the_flipped_bit_modulo_the_width(dtype):
    g = torch.randn(64).to(dtype) * 1e4  # large values: the sums wrap
    width = g.element_size() * 8
    ints = g.view({2: torch.int16, 4: torch.int32}[g.element_size()]).long()
    exact = int(ints.sum())
    before = int(bit_sums([g], torch.device("cpu"))[0])
    assert (before - exact) % (1 << width) == 0  # the exact sum, modulo 2**width
    for bit in range(width):
        h = g.clone()
        S.flip_bit_(h, 3, bit)
        delta = int(bit_sums([h], torch.device("cpu"))[0]) - before
        assert delta % (1 << width) in ((1 << bit), (1 << width) - (1 << bit))


@pytest.mark.parametrize("world_size", [2, 64, 16384])
def test_no_modulus_divides_a_wrapped_flip(world_size):
    for p in moduli(world_size):
        assert all(pow(2, m, p) != 1 for m in range(1, 65))


def test_ledger_names_a_rank_alone_at_fault_as_suspect():
    ledger = ReplicaLedger()
    for step in range(SUSPECT_EVENTS - 1):
        ledger.note_overflow(10 + step, {3})
        ledger.note_overflow(10 + step, {1, 2})  # two ranks: no one alone at fault
    assert ledger.suspects == () and ledger.lone_overflows[3] == SUSPECT_EVENTS - 1
    ledger.note_mismatch(ReplicaMismatch(20, "gradients", (3,)))
    assert ledger.suspects == (3,)
    assert ledger.as_dict()["replica_mismatches"] == 1


@pytest.mark.parametrize(
    ("setting", "value", "error"),
    [
        ("replica_check", 1, TypeError),
        ("replica_check_interval", 0, ValueError),
        ("replica_check_interval", True, ValueError),
        ("param_check_interval", -1, ValueError),
        ("on_replica_mismatch", "ignore", ValueError),
    ],
)
def test_bad_settings_name_the_argument_and_the_range(setting, value, error):
    with pytest.raises(error, match=setting):
        GradScaler("cpu", **{setting: value})


def test_a_single_process_never_checks():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = GradScaler("cpu", grad_layout="replicated", replica_check_interval=1)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.replica_ledger.checks == 0 and scaler.last_replica_mismatch is None


# ---------------------------------------------------------------------- on gloo


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(S.everything_2, 2, tmp_path_factory.mktemp("replica2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    # HSDP's results skip where torch's own fully_shard fails (torch 2.6 on CPUs: _torch_gaps).
    return guarded(spawn(S.everything_4, 4, tmp_path_factory.mktemp("replica4")))


def _cases():
    for dtype in S.BITS:
        opts = ["fused", "foreach"] if dtype == "float32" else ["fused"]
        for opt, clip, path in itertools.product(opts, ("noclip", "clip"), ("cpu", "gpu")):
            yield f"{dtype}-{opt}-{clip}-{path}"


@pytest.mark.parametrize("case", list(_cases()))
def test_a_flipped_bit_after_the_reduce_is_caught_at_that_step_on_every_rank(two, case):
    r0, r1 = (r["flips"] for r in two)
    keys = [k for k in r0 if k.startswith(case + "-bit")]
    dtype = case.split("-")[0]
    assert len(keys) == len(S.BITS[dtype])  # every listed bit was flipped
    for key in keys:
        for r in (r0, r1):
            got = r[key]
            assert got["mismatch_steps"] == [S.FLIP_STEP], key  # seen at that step, no other
            assert got["what"] == "gradients"
            assert got["named"] == [0, 1], key  # two replicas: both named
            assert got["skipped"][S.FLIP_STEP], key  # the update never landed
            assert not got["skipped"][S.FLIP_STEP + 1], key  # and the next step took
            assert got["ledger"]["replica_checks"] == S.STEPS
            assert got["ledger"]["replica_skipped"] == 1
        assert r0[key]["params"] == r1[key]["params"], key  # replicas bit-identical after


def test_four_ddp_ranks_name_exactly_the_flipped_one(four):
    for r in four:
        for key, got in r["ddp"].items():
            assert got["mismatch_steps"] == [S.FLIP_STEP], key
            assert got["named"] == [2], key
            assert got["skipped"][S.FLIP_STEP], key
    assert len({tuple(r["ddp"]["bit30"]["params"]) for r in four}) == 1


def test_hsdp_names_the_flipped_rank_and_its_replica(four):
    flipped = 3
    for r in four:
        for key, got in r["hsdp"].items():
            assert got["mismatch_steps"] == [S.FLIP_STEP], key
            assert got["skipped"][S.FLIP_STEP], key
            # replicate 2 x shard 2: rank 3's replica is rank 1; with two replicas both are named
            assert got["named"] == [1, flipped], key
            assert got["sets"] == [[1, 3]], key
    for key in four[0]["hsdp"]:  # each shard bit-identical on its two replicas
        assert four[0]["hsdp"][key]["params"] == four[2]["hsdp"][key]["params"]
        assert four[1]["hsdp"][key]["params"] == four[3]["hsdp"][key]["params"]


def test_three_replicas_name_the_one_that_differs(four):
    assert [r["odd"]["named"] for r in four[:3]] == [[None, [1], None]] * 3


def test_a_flipped_parameter_is_caught_at_the_next_parameter_check(two):
    for r in two:
        got = r["actions"]["param_flip"]
        # Flipped after update 3; checked at updates 2, 4, 6: caught at 4, and again at 6 (a
        # parameter divergence stays until the replicas are restored).
        assert [s["step"] for s in got["seen"]] == [3, 5]
        assert {s["what"] for s in got["seen"]} == {"parameters"}
        assert got["seen"][0]["ranks"] == [0, 1]
        assert got["ledger"]["replica_param_checks"] == 3


def test_raise_names_the_ranks_on_every_rank_before_anything_changes(two):
    for r in two:
        got = r["actions"]["raise"]
        assert got["raised"] and "rank(s) 0, 1" in got["raised"]
        assert got["ranks"] == [0, 1]
        assert got["unchanged"]  # parameters and optimizer state
        assert got["scale"] == 16.0  # no backoff: a mismatch is not an overflow


def test_a_callable_is_called_on_every_rank_and_the_step_skipped(two):
    for r in two:
        got = r["actions"]["callable"]
        assert got["calls"] == [[0, 1]]
        assert got["skipped"] and got["step_was_skipped"]


def test_no_false_positive_over_two_thousand_clean_steps(two):
    total = 0
    for name in two[0]["clean"]:
        got0, got1 = two[0]["clean"][name], two[1]["clean"][name]
        for got in (got0, got1):
            assert got["mismatches"] == 0, name
            assert got["checks"] == 500, name  # every update was checked (the CPU's default)
            assert got["param_checks"] == 2 * (250 // 7), name  # every 7th, counted anew on resume
        assert got0["params"] == got1["params"], name
        total += got0["checks"]
    assert total == 2000


def test_a_check_adds_one_read_pass_and_a_fixed_number_of_ops(two):
    ops = two[0]["ops"]
    tensors = ops["tensors"]
    # What a checked step adds, whatever the path: one integer sum per gradient tensor (the read
    # pass), stack, the cast to int64, remainder x2, mul, sum, the cast to float32 (the local
    # residues), the cat that appends them to the collective, the copy back (and where the
    # verdict was a MAX of flags, the clamp of its SUM); one host read (the verdict). The
    # all_reduce stays one.
    base = {
        "aten.sum.default": tensors,
        "aten.stack.default": 1,
        "aten.remainder.Tensor": 2,
        "aten.mul.Tensor": 1,
        "aten.sum.dim_IntList": 1,
        "aten._to_copy.default": 2,
        "aten.cat.default": 1,
        "aten.copy_.default": 1,
    }
    for path, clip in itertools.product(("cpu", "gpu"), ("noclip", "clip")):
        off, on = ops[f"{path}-{clip}-off"], ops[f"{path}-{clip}-on"]
        checked = [2] if path == "gpu" else [0, 1, 2]  # steps 2, 31, 32: the GPU's every 32
        expected = dict(base, **({"aten.clamp_.default": 1} if clip == "noclip" else {}))
        for i in range(3):
            extra = {k: on[i]["ops"].get(k, 0) - off[i]["ops"].get(k, 0)
                     for k in set(on[i]["ops"]) | set(off[i]["ops"])}  # fmt: skip
            extra = {k: v for k, v in extra.items() if v}
            if i in checked:
                assert extra == expected, (path, clip, i)
                assert on[i]["reads"] == off[i]["reads"] + 1
            else:  # a clean step between two checks pays nothing
                assert extra == {}, (path, clip, i)
                assert on[i]["reads"] == off[i]["reads"] == 0


def test_replica_mismatch_error_is_a_runtime_error_holding_the_mismatch():
    m = ReplicaMismatch(7, "gradients", (5,), (((4, 5), ((1, 2), (1, 3))),), "raise")
    e = ReplicaMismatchError(m)
    assert isinstance(e, RuntimeError) and e.mismatch is m
    assert "step 7: gradients of rank(s) 5" in str(e)
