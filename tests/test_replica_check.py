"""The replica check (distscaler.replica_check): silent data corruption caught at the step.

The arithmetic is checked in this process against exact integers (every single-bit flip of every
dtype changes the outcome; clean replicas never do, and the float32 sums are exact); the behaviour
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
from distscaler._replica.checksum import (
    PRIMES,
    Key,
    coefficient,
    layout_terms,
    limbs,
    mismatched,
    offsets,
    rank_slots,
    spacing,
    to_limbs,
    word_moments,
    word_weights,
    words,
)
from distscaler.replica_check import (
    MAX_WORLD_SIZE,
    SUSPECT_EVENTS,
    ReplicaLedger,
    ReplicaMismatch,
    ReplicaSet,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------- the arithmetic, exactly


@pytest.mark.parametrize("replicas", range(2, 12))
def test_coefficients_sum_to_zero_and_are_never_zero(replicas):
    coefs = [coefficient(i, replicas) for i in range(replicas)]
    assert sum(coefs) == 0
    assert all(c != 0 and abs(c) <= 2 for c in coefs)
    assert coefficient(0, 1) == 0


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 1000, 4096, 4097, 16384, MAX_WORLD_SIZE])
def test_limbs_keep_every_partial_sum_exact_in_float32_and_the_primes_fixed(world_size):
    p1, p2 = PRIMES
    assert p1 > p2 > 1 << 23 and p1 < 1 << 24
    for p in (p1, p2):
        assert all(p % f for f in range(2, int(p**0.5) + 1))
    count, bits = limbs(world_size)
    assert count * bits >= 24  # a residue fits its limbs
    assert world_size * ((1 << bits) - 1) <= 1 << 24  # their sum over the group is exact
    assert count == (2 if world_size <= 4096 else 3 if world_size <= 65536 else 4)
    residues = torch.tensor([0, 1, p1 - 1, p2 - 1, 12345, 1 << 23, 7, p1 - 2])
    limbs_t = to_limbs(residues, world_size)
    assert limbs_t.dtype == torch.float32 and limbs_t.numel() == 8 * count
    assert limbs_t.max() < 1 << bits
    with pytest.raises(ValueError, match="world_size"):
        limbs(1 << 19)


@pytest.mark.parametrize("replicas", [*range(2, 40), 1000, 1001, 1002, 1003, 4096, MAX_WORLD_SIZE])
def test_offsets_keep_a_clean_set_cancelling_and_are_distinct(replicas):
    v = offsets(replicas)
    coefs = [coefficient(i, replicas) for i in range(replicas)]
    assert sum(c * x for c, x in zip(coefs, v)) == 0
    assert len(v) == replicas and min(v) >= 0 and max(v) <= replicas + 1
    if replicas >= 3:
        assert len(set(v)) == replicas
    # positions k + D * v stay distinct modulo P1 * P2 for k below the spacing
    assert spacing(replicas) * (max(v) + 1) <= PRIMES[0] * PRIMES[1]
    assert spacing(replicas) >= 1 << 30  # words per rank: 2.1e9 at 131,072 replicas


def _exact(t: torch.Tensor, primes: tuple[int, int] = PRIMES) -> list[int]:
    # The checksum in Python's integers, from the bytes.
    w = t.contiguous().view(-1).view(torch.int16).tolist()
    a, b = sum(w), sum(k * x for k, x in enumerate(w))
    return [a % primes[0], a % primes[1], b % primes[0], b % primes[1]]


@settings(max_examples=60, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(sorted(DTYPES)), min_size=1, max_size=5),
    sizes=st.lists(st.integers(0, 700), min_size=5, max_size=5),
    scale=st.sampled_from([1.0, 1e4, 6e4, 1e-6]),
    secret=st.integers(0, 2**63 - 1),
)
def test_word_moments_are_exact_integers_and_the_dense_sums_equal_the_sparse_weights(
    dtypes, sizes, scale, secret
):
    """`word_moments()` against Python's integers; `rank_slots()` (one int8 matrix product over
    rows of bytes) against `word_weights()` word by word (the sparse form the guarantee tests
    use)."""
    tensors = [(torch.randn(n) * scale).to(DTYPES[d]) for d, n in zip(dtypes, sizes)]
    got = word_moments(tensors, torch.device("cpu"))
    assert got.tolist() == [_exact(t) for t in tensors]
    key, replica = Key(secret), ReplicaSet((1, 4, 6), 2)
    sets = [replica if i % 3 != 1 else None for i in range(len(tensors))]
    dense = rank_slots(tensors, sets, key, torch.device("cpu")).residues
    terms = layout_terms([t.numel() * t.element_size() // 2 for t in tensors], sets,
                         torch.device("cpu"))  # fmt: skip
    sparse = [0] * 8
    for t, owner, term in zip(tensors, sets, terms.tolist()):
        w = words(t)
        if owner is None or w is None or not w.numel():
            continue
        start = term[2]  # the tensor's padded offset in its set's stream (below both primes)
        weights = word_weights(torch.arange(w.numel()) + start, owner, key)  # (n, 8, 2)
        by = w.view(torch.int8).to(torch.int64).view(-1, 1, 2)  # each word's signed bytes
        total = (weights * by).sum((0, 2)).tolist()
        sparse = [acc + v for acc, v in zip(sparse, total)]
    assert dense.tolist() == [v % PRIMES[i % 2] for i, v in enumerate(sparse)]


def _slots(tensors: list[torch.Tensor], replica: ReplicaSet, world_size: int) -> torch.Tensor:
    taken = rank_slots(tensors, [replica] * len(tensors), Key(world_size), torch.device("cpu"))
    return to_limbs(taken.residues, world_size)


def _caught(replica_tensors: list[list[torch.Tensor]]) -> bool:
    """The check's reading for one list of tensors per replica, the all-reduce done in float32 in a
    random order, as a ring would."""
    n = len(replica_tensors)
    slots = [_slots(ts, ReplicaSet(tuple(range(n)), i), n) for i, ts in enumerate(replica_tensors)]
    order = list(range(n))
    random.Random(n).shuffle(order)
    total = torch.zeros(slots[0].numel(), dtype=torch.float32)
    exact = [0] * slots[0].numel()
    for i in order:
        total += slots[i]
        exact = [exact[j] + int(slots[i][j]) for j in range(len(exact))]
    assert total.tolist() == exact  # every partial sum exact in float32
    return mismatched(total.tolist(), n)


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    replicas=st.integers(2, 9),
    numel=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_every_single_bit_flip_is_caught(dtype, replicas, numel, seed, data):
    torch.manual_seed(seed)
    g = torch.randn(numel).to(DTYPES[dtype])
    width = g.element_size() * 8
    bit = data.draw(st.integers(0, width - 1), label="bit")
    index = data.draw(st.integers(0, numel - 1), label="index")
    bad = data.draw(st.integers(0, replicas - 1), label="bad replica")
    assert _caught([[g.clone()] for _ in range(replicas)]) is False  # agreeing replicas: never
    corrupted = [[g.clone()] for _ in range(replicas)]
    _flip(corrupted[bad][0], index, bit)
    assert _caught(corrupted) is True


def _flip(t: torch.Tensor, index: int, bit: int) -> None:
    ints = t.view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])
    width = ints.element_size() * 8
    ints[index] ^= -(1 << (width - 1)) if bit == width - 1 else 1 << bit


def _bit(t: torch.Tensor, index: int, bit: int) -> int:
    ints = t.view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])
    return (int(ints[index]) >> bit) & 1


def _constructed_pairs(base: list[torch.Tensor], replicas: int):
    """Every pair of flips of one bit position that cancels in a plain sum of bit patterns: opposite
    directions in one tensor, opposite directions across two tensors, and the same direction on
    two replicas (opposite coefficients), for each bit position and the first few elements."""
    width = base[0].element_size() * 8
    for bit in range(width):
        ones = [i for i in range(base[0].numel()) if _bit(base[0], i, bit)][:3]
        zeros = [i for i in range(base[0].numel()) if not _bit(base[0], i, bit)][:3]
        zeros1 = [i for i in range(base[1].numel()) if not _bit(base[1], i, bit)][:3]
        for i, j in itertools.product(ones, zeros):
            yield ("one tensor", bit, [(0, 0, i), (0, 0, j)])
        for i, j in itertools.product(ones, zeros1):
            yield ("two tensors", bit, [(0, 0, i), (0, 1, j)])
        for i, j in itertools.product(zeros, zeros):
            if i != j:  # same direction on two replicas of opposite coefficients (0 and 1 of 2)
                yield ("two replicas", bit, [(0, 0, i), (1, 0, j)])
        if replicas >= 3:  # ranks 0 and 1 share a coefficient: opposite directions, any distance
            for i, j in itertools.product(ones, zeros):
                yield ("two replicas, one coefficient", bit, [(0, 0, i), (1, 0, j)])
                yield ("two replicas, one coefficient, same place", bit, [(0, 0, i), (1, 0, i)])
            for i, j in itertools.product(zeros, zeros):  # ranks 0 and 3 of 4: +1 and -1
                if replicas >= 4 and i != j:
                    yield ("replicas 0 and 3", bit, [(0, 0, i), (3, 0, j)])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_constructed_cancelling_pairs_are_all_caught(dtype, replicas):
    torch.manual_seed(replicas)
    base = [torch.randn(24).to(DTYPES[dtype]) * 3, torch.randn(16).to(DTYPES[dtype])]
    missed, total = [], 0
    for kind, bit, flips in _constructed_pairs(base, replicas):
        copies = [[t.clone() for t in base] for _ in range(replicas)]
        for rank, tensor, index in flips:
            _flip(copies[rank][tensor], index, bit)
        if all(torch.equal(copies[0][k].view(torch.int16), copies[r][k].view(torch.int16))
               for r in range(replicas) for k in range(2)):  # fmt: skip
            continue  # replicas corrupted alike agree: nothing to catch
        total += 1
        if not _caught(copies):
            missed.append((kind, bit, flips))
    assert total > 50
    assert not missed, f"{len(missed)} of {total} constructed pairs missed: {missed[:5]}"


def test_ten_thousand_random_pairs_are_all_caught():
    """The measured rate behind the docs' claim: any two flipped bits, anywhere (one tensor, two
    tensors, two ranks; any dtype), are caught; 10,000 random pairs, none missed."""
    rng = random.Random(2026)
    bases = {d: [torch.randn(20).to(t), torch.randn(12).to(t)] for d, t in DTYPES.items()}
    missed, total = 0, 0
    while total < 10_000:
        dtype = rng.choice(sorted(DTYPES))
        base = bases[dtype]
        width = base[0].element_size() * 8
        flips = []
        for _ in range(2):
            k = rng.randrange(2)
            flips.append((rng.randrange(2), k, rng.randrange(base[k].numel()), rng.randrange(width)))
        if flips[0][0] != flips[1][0] and flips[0][1:] == flips[1][1:]:
            continue  # the same flip on both replicas: they agree
        if flips[0] == flips[1]:
            continue  # a bit flipped twice: no change
        copies = [[t.clone() for t in base] for _ in range(2)]
        for rank, k, index, bit in flips:
            _flip(copies[rank][k], index, bit)
        total += 1
        missed += not _caught(copies)
    assert missed == 0, f"{missed} of {total} random pairs missed"


def test_a_three_word_pattern_the_fixed_sums_miss_is_caught_by_the_keyed_sums():
    """The certainty of the fixed weights ends at two words: +d, -2d, +d on three consecutive
    words cancels ``A``, ``B`` and ``C`` (a second difference); the keyed ``R`` catches it."""
    g = torch.zeros(8, dtype=torch.float16)
    bad = g.clone()
    changed = bad.view(torch.int16)
    changed[2] += 1
    changed[3] -= 2
    changed[4] += 1
    device = torch.device("cpu")
    # A, B: the same (and C, a multiple of A): nothing the fixed weights sum differs
    fixed = [word_moments([t], device) for t in (g, bad)]
    assert torch.equal(fixed[0], fixed[1])
    assert _caught([[g], [bad]]) is True


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


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_a_mismatch_the_unscale_made_an_inf_of_is_a_skip_of_its_own_cause(two, kind):
    """A finite corruption of one rank's reduced gradient that the unscale takes past float32's
    range (a loss scale of 0.5): the replica check sees the mismatch and, where the gradients are
    unscaled in place (foreach), that rank's inf; the agreed ``found_inf`` is 0.0 (torch's kernel
    checks before it multiplies), so it is no overflow: the step is skipped and counted as a
    replica mismatch, and the scale and the growth tracker hold, on every rank alike (as a
    deferred reading decides). With foreach it was counted as a clean step: the skip uncounted,
    the growth tracker advanced."""
    runs = [r["past_float32"][kind] for r in two]
    for run in runs:
        # two replicas: both named; the foreach step's gradients were unscaled in place, so the
        # last rank's inf was seen (the fused step unscales inside the optimizer: none to see)
        assert run["mismatch"] == [1, [0, 1], [1] if kind == "foreach" else []]
        assert run["skipped"] == [True, False, False]
        assert run["causes"] == [1, 1]  # one skip, of the replica mismatch's cause
        assert run["scales"] == [0.5, 0.5, 1.0] and run["trackers"] == [0, 1, 0]
        assert run["params"][0] != run["params"][1]  # the clean steps stepped
    assert runs[0] == runs[1]  # every rank the same, parameters included


def test_no_false_positive_over_two_thousand_clean_steps(two):
    total = 0
    for name in two[0]["clean"]:
        got0, got1 = two[0]["clean"][name], two[1]["clean"][name]
        for got in (got0, got1):
            assert got["mismatches"] == 0, name
            assert got["checks"] == 500, name  # every update was checked (replica_check_interval=1)
            assert got["param_checks"] == 2 * (250 // 7), name  # every 7th, counted anew on resume
        assert got0["params"] == got1["params"], name
        total += got0["checks"]
    assert total == 2000


def test_a_check_adds_one_read_pass_and_a_fixed_number_of_ops(two):
    ops = two[0]["ops"]
    assert ops["tensors"] == 4
    # What a checked step adds, whatever the path (and where the flag was a MAX, the clamp of its
    # SUM); one host read (the reduced slots). The all_reduce stays one.
    # The checksum (distscaler._replica.checksum.rank_slots) over the model's 4 gradients, one
    # replica set: one cat of their bytes into rows (zero pads), one int8 matrix product (every
    # row's sums, the keyed ones included), int64 ops on the rows, the keyed sums of two
    # replicas' weights (drawn once), the limbs; then the collective's cat and copy_ back. A fixed
    # number whatever the tensor count (one cat per replica set).
    base = {
        "aten.zeros.default": 5,
        "aten.cat.default": 6,
        "aten._int_mm.default": 1,
        "aten._to_copy.default": 2,
        "aten.stack.default": 1,
        "aten.arange.default": 3,
        "aten.sum.default": 2,
        "aten.sum.dim_IntList": 6,
        "aten.mul.Tensor": 16,
        "aten.add.Tensor": 7,
        "aten.sub.Tensor": 1,
        "aten.remainder.Tensor": 15,
        "aten.new_zeros.default": 3,
        "aten.__lshift__.Tensor": 1,
        "aten.__rshift__.Tensor": 1,
        "aten.bitwise_and.Scalar": 1,
        "aten.copy_.default": 1,
    }
    for path, clip in itertools.product(("cpu", "gpu"), ("noclip", "clip")):
        off, on = ops[f"{path}-{clip}-off"], ops[f"{path}-{clip}-on"]
        expected = dict(base, **({"aten.clamp_.default": 1} if clip == "noclip" else {}))
        for i in range(3):  # updates 2 and 63: not due; 64: the run's second check
            extra = {k: on[i]["ops"].get(k, 0) - off[i]["ops"].get(k, 0)
                     for k in set(on[i]["ops"]) | set(off[i]["ops"])}  # fmt: skip
            extra = {k: v for k, v in extra.items() if v}
            if i == 2:
                assert extra == expected, (path, clip, i)
                assert on[i]["reads"] == off[i]["reads"] + 1
            else:  # a clean step between two checks pays nothing
                assert extra == {}, (path, clip, i)
                assert on[i]["reads"] == off[i]["reads"]


def test_replica_mismatch_error_is_a_runtime_error_holding_the_mismatch():
    m = ReplicaMismatch(7, "gradients", (5,), (((4, 5), ((1, 2), (1, 3))),), "raise")
    e = ReplicaMismatchError(m)
    assert isinstance(e, RuntimeError) and e.mismatch is m
    assert "step 7: gradients of rank(s) 5" in str(e)
