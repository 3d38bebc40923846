"""What the replica checksum guarantees (docs/silent-data-corruption.md), case by case.

The guarantee: (1) every change confined to at most K (>= 2) 16-bit words of the replicated
gradients is caught with certainty, at every world size up to `MAX_WORLD_SIZE` and every model size
up to a stated number of words per rank, across ranks and across replica sets; (2) every other
change pattern, structured ones included, is missed with probability at most 2**-40 over a per-run
or per-step secret; (3) a change on a rank of one replica set never cancels a change in another.

Each case below is one that a checksum of two position-weighted sums whose weights depend only on
a replica's place in its set (the same weights in every set, primes shrinking with the world size)
misses; the controls guard the adapter against answering always the same.

- On 4 gloo ranks, one spawn: FSDP2 HSDP on a 2 x 2 mesh and DDP over {0, 2} and {1, 3}, two
  flips on two ranks of two replica sets that cancel (end to end: the step is taken, the replicas
  diverge), and one flip alone (caught).
- In this process, through the library's functions (`caught()`, the one adapter): the 64-rank
  large-model pair (and 48 and 32 ranks), the second difference on one rank and split over two,
  a change of P1 * P2 at 131,072 ranks, and the measured miss rates of a faulty memory line, of 3
  random bit flips and (a control) of 3 random word values, each over a stated sample size.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import _checksum_scenarios as S
import pytest
import torch
from _harness import spawn
from _torch_gaps import guarded

from distscaler._replica.checksum import (
    PRIMES,
    Key,
    mismatched,
    slot_numel,
    to_limbs,
    word_weights,
)
from distscaler.replica_check import MAX_WORLD_SIZE, ReplicaSet

#: A miss rate the guarantee allows for a pattern beyond K words: at most this, per sample.
MISS_BOUND = 2.0**-40

# ---------------------------------------------------------------------- the adapter

#: One changed 16-bit word on a rank: (its position among the rank's checked words, the word
#: before, the word after), the words as signed 16-bit integers.
Change = tuple[int, int, int]


def caught(
    changes: Mapping[int, Sequence[Change]],
    sets: Sequence[Sequence[int]],
    world_size: int,
    *,
    words: int,
    secret: int = 0,
) -> bool:
    """Whether the replica check reads a mismatch at a step where, from a clean state (every
    replica set's ranks holding the same words), ``changes`` were made after the reduce.

    The only place in this module that knows the checksum's functions: a new checksum replaces
    this function and nothing else.

    Args:
        changes: per global rank, the words it changed (positions distinct, below ``words``).
        sets: the replica sets, each its global ranks in replica order (a rank in none holds
            nothing replicated).
        world_size: the ranks of the scaler's group, whose collective sums every rank's slots.
        words: the 16-bit words of replicated gradients each rank checks (the model size).
        secret: the key of the keyed weights (a miss rate is a probability over it).

    The checksum is linear in the words: each rank's residues are those of its changes alone
    plus those of the clean state, and the clean state's sum over the group is 0 modulo each
    prime. So each changed rank's residues are its changes (of each word's two signed bytes) times
    `word_weights()` at their positions (the rank's checked words as one tensor), as limbs (`to_limbs()`), summed over the
    ranks in float32 as the collective sums them, and read (`mismatched()`). Nothing of size
    ``words`` is allocated.
    """
    key = Key(secret)
    place = {r: (j, i) for j, s in enumerate(sets) for i, r in enumerate(s)}
    reduced = torch.zeros(slot_numel(world_size), dtype=torch.float32)
    for rank, rank_changes in changes.items():
        if not rank_changes or rank not in place:
            continue
        assert len({c[0] for c in rank_changes}) == len(rank_changes)
        assert max(c[0] for c in rank_changes) < words
        j, i = place[rank]
        positions = torch.tensor([c[0] for c in rank_changes], dtype=torch.int64)
        delta = _bytes([c[2] for c in rank_changes]) - _bytes([c[1] for c in rank_changes])
        weights = word_weights(positions, ReplicaSet(tuple(sets[j]), i), key)  # (n, 8, 2)
        residues = (weights * delta.unsqueeze(1)).sum((0, 2)).remainder(_MODULI)
        reduced += to_limbs(residues, world_size)
    return mismatched(reduced.tolist(), world_size)


_MODULI = torch.tensor([PRIMES[i % 2] for i in range(8)])


def _bytes(values: list[int]) -> torch.Tensor:
    """Signed 16-bit words as their (low, high) signed bytes, int64 ``(n, 2)``."""
    return torch.tensor(values, dtype=torch.int16).view(torch.int8).to(torch.int64).view(-1, 2)


# ---------------------------------------------------------------------- helpers of the cases


def _flipped(word: int, bit: int) -> int:
    """``word`` (signed 16-bit) with ``bit`` flipped, signed."""
    value = (word & 0xFFFF) ^ (1 << bit)
    return value - (1 << 16) if value >= 1 << 15 else value


def _pairs(world_size: int) -> list[tuple[int, int]]:
    """HSDP's replica sets with replicate 2: rank i and rank i + world_size / 2."""
    half = world_size // 2
    return [(i, i + half) for i in range(half)]


def _changes(base: list[list[int]], now: list[list[int]]) -> dict[int, list[Change]]:
    return {r: [(k, b, w) for k, (b, w) in enumerate(zip(base[r], now[r])) if b != w]
            for r in range(len(now))}  # fmt: skip


# ---------------------------------------------------------------------- the adapter's controls


@pytest.mark.parametrize(
    ("world_size", "sets", "words"),
    [
        (2, [(0, 1)], 4),
        (4, [(0, 2), (1, 3)], 1 << 20),
        (64, [tuple(range(64))], 10 + 365_506_821 + 1),
        (MAX_WORLD_SIZE, _pairs(MAX_WORLD_SIZE), 1 << 30),
    ],
    ids=["2", "4-hsdp", "64-large", "131072-hsdp"],
)
def test_the_adapter_reads_a_clean_step_as_clean_and_one_flip_as_a_mismatch(
    world_size, sets, words
):
    """Guards the cases below against an adapter that always answers the same: no change, and
    the same change on every replica of a set (the replicas agree), are clean; one flipped bit
    on one rank, anywhere, is a mismatch."""
    assert caught({}, sets, world_size, words=words) is False
    same = {r: [(words - 1, 0x1234, _flipped(0x1234, 3))] for r in sets[0]}
    assert caught(same, sets, world_size, words=words) is False
    for rank, position, bit in [(sets[0][0], 0, 0), (sets[-1][-1], words - 1, 15),
                                (sets[0][-1], words // 3, 9)]:  # fmt: skip
        assert caught({rank: [(position, 100, _flipped(100, bit))]}, sets, world_size,
                      words=words) is True  # fmt: skip


# ---------------------------------------------------------------------- certainty: K words


#: (world size, D): distances in words at which two flips on ranks 0 and 1 of one set of every rank
#: cancel where two replicas' positions are D words apart (a shift spacing from primes that shrink
#: with the world size); here a rank checks 10 + D + 1 words (D / 2 float32 gradient values: 183M,
#: 436M, 1.49B).
LARGE = [(64, 365_506_821), (48, 872_566_693), (32, 2_987_689_360)]


@pytest.mark.parametrize(("world_size", "distance"), LARGE, ids=[str(w) for w, _ in LARGE])
def test_two_flips_on_two_ranks_of_a_large_model_are_caught(world_size, distance):
    """One replica set of every rank (DDP), each rank checking 10 + D + 1 words: rank 1 flips bit
    7 of word 10 and rank 0 the same bit, the same way (0 to 1), at word 10 + D. A change of two
    words: certain to be caught."""
    words = 10 + distance + 1
    sets = [tuple(range(world_size))]
    pair = {1: [(10, 0, 128)], 0: [(10 + distance, 0, 128)]}
    assert caught(pair, sets, world_size, words=words)


@pytest.mark.parametrize(("world_size", "distance"), LARGE, ids=[str(w) for w, _ in LARGE])
def test_each_flip_of_the_large_model_pair_alone_is_caught(world_size, distance):
    """The control of the case above: either flip alone, and the pair one word nearer, are
    caught."""
    words = 10 + distance + 1
    sets = [tuple(range(world_size))]
    assert caught({1: [(10, 0, 128)]}, sets, world_size, words=words)
    assert caught({0: [(10 + distance, 0, 128)]}, sets, world_size, words=words)
    nearer = {1: [(10, 0, 128)], 0: [(9 + distance, 0, 128)]}
    assert caught(nearer, sets, world_size, words=words)


@pytest.mark.parametrize("position", [0, 10, 12_345])
def test_one_word_changed_by_p1_p2_at_the_largest_world_is_caught(position):
    """131,072 ranks (HSDP, replicate 2), one fp16 word of one rank changed by +14,351
    (-7,000 to 7,351): a change of one word, certain to be caught at every supported size."""
    sets = _pairs(MAX_WORLD_SIZE)
    assert caught({5: [(position, -7_000, 7_351)]}, sets, MAX_WORLD_SIZE, words=1 << 20)


def test_one_word_changed_by_less_than_p1_p2_at_the_largest_world_is_caught():
    """The control of the case above: +14,350 and +1 are caught."""
    sets = _pairs(MAX_WORLD_SIZE)
    for after in (7_350, -6_999):
        assert caught({5: [(10, -7_000, after)]}, sets, MAX_WORLD_SIZE, words=1 << 20)


#: Cross-set pairs at 4 and 6 ranks that weights shared by the sets cancel: the same place in two sets of the
#: same size has the same weight (opposite changes cancel), places 0 and 1 of two sets of 2 have
#: opposite weights (equal changes cancel). (world size, sets, rank a, rank b, same change?)
CROSS_SETS = [
    (4, [(0, 2), (1, 3)], 0, 3, True),  # HSDP 2 x 2: ranks 0 and 3, the same change
    (4, [(0, 2), (1, 3)], 0, 1, False),  # the same place in both sets, opposite changes
    (6, [(0, 2, 4), (1, 3, 5)], 4, 5, False),  # 3 replicas each: the last place of both
    (4, [(0, 1), (2, 3)], 1, 2, True),  # pipeline stages {0, 1} and {2, 3}
]


@pytest.mark.parametrize(("world_size", "sets", "a", "b", "same"), CROSS_SETS,
                         ids=["hsdp-0-3", "hsdp-0-1", "three-4-5", "stages-1-2"])  # fmt: skip
def test_a_change_in_one_replica_set_never_cancels_one_in_another(world_size, sets, a, b, same):
    """Bit 9 of word 21 flipped on rank ``a`` and on rank ``b`` of another replica set, the bit
    the same (same) or opposite on the two (data differ across sets). Two words: certain."""
    before_a = 0x0123
    before_b = before_a if same else before_a ^ (1 << 9)
    pair = {a: [(21, before_a, _flipped(before_a, 9))], b: [(21, before_b, _flipped(before_b, 9))]}
    assert caught(pair, sets, world_size, words=4096)


# ---------------------------------------------------------------------- structured patterns


#: (world size, replica sets, the rank holding the pattern) for the second difference.
LAYOUTS = [
    (2, [(0, 1)], 1),
    (8, _pairs(8), 6),
    (64, [tuple(range(64))], 37),
    (4096, _pairs(4096), 4095),
]


def test_a_second_difference_on_one_rank_is_caught():
    """+2**b at words k - 1 and k + 1, -2**(b + 1) at word k, on one rank: every bit b of 0..13
    (the words 0 to 2**b and 2**(b + 1) to 0), k at the start, middle and end of 8,192 words, 4
    layouts, a fresh secret each: 168 patterns, each must be caught (at most 2**-40 each)."""
    rng = random.Random(53)
    words, missed, total = 8192, 0, 0
    for (world_size, sets, rank), bit, k in _second_differences(words):
        d = 1 << bit
        pattern = [(k - 1, 0, d), (k, 2 * d, 0), (k + 1, 0, d)]
        total += 1
        missed += not caught({rank: pattern}, sets, world_size, words=words,
                             secret=rng.getrandbits(64))  # fmt: skip
    assert total == 168
    assert missed == 0, f"{missed} of {total} second differences on one rank missed"


def test_a_second_difference_split_over_two_replicas_is_caught():
    """The replicas' difference is the second difference: rank a of a 2-replica set changes words
    k - 1 and k + 1 by +2**b, its replica word k by +2**(b + 1). Every bit of 0..13, 3 places, 3
    layouts of sets of 2 (126 patterns, a fresh secret each), each must be caught."""
    rng = random.Random(54)
    words, missed, total = 8192, 0, 0
    for (world_size, sets, rank), bit, k in _second_differences(words):
        if len(sets[0]) != 2:
            continue
        replica = next(s[1 - s.index(rank)] for s in sets if rank in s)
        d = 1 << bit
        changes = {rank: [(k - 1, 0, d), (k + 1, 0, d)], replica: [(k, 0, 2 * d)]}
        total += 1
        missed += not caught(changes, sets, world_size, words=words, secret=rng.getrandbits(64))
    assert total == 126
    assert missed == 0, f"{missed} of {total} second differences over two replicas missed"


def _second_differences(words: int):
    for layout in LAYOUTS:
        for bit in range(14):
            for k in (1, words // 2, words - 2):
                yield layout, bit, k


# ---------------------------------------------------------------------- measured miss rates


def test_a_faulty_memory_line_4000_samples_none_missed():
    """One bit (uniform over 0..15) flipped in 4 words at a stride of 7 (k, k + 7, k + 14,
    k + 21; k uniform) of uniformly random 16-bit data, on one replica of two (either), 4,096
    words per rank, a fresh secret per sample. N = 4,000 samples; at a miss rate of at most
    2**-40 the expected misses are below 4e-9, so none may be missed (a checksum of two
    position-weighted sums missed 502 of 4,000)."""
    rng = random.Random(2053)
    n, missed = 4_000, 0
    for _ in range(n):
        bit, k, rank = rng.randrange(16), rng.randrange(4096 - 21), rng.randrange(2)
        data = [rng.randrange(-(1 << 15), 1 << 15) for _ in range(4)]
        line = [(k + 7 * i, w, _flipped(w, bit)) for i, w in enumerate(data)]
        missed += not caught({rank: line}, [(0, 1)], 2, words=4096, secret=rng.getrandbits(64))
    assert missed <= n * MISS_BOUND, f"{missed} of {n} faulty memory lines missed"


def _three_changes(rng: random.Random, change) -> dict[int, list[Change]] | None:
    """A 4-word fp16 gradient of uniformly random words on two replicas, 3 changes each on a
    random replica and word (``change(word, rng)`` gives the new word); None where the replicas
    still agree (nothing to catch)."""
    data = [rng.randrange(-(1 << 15), 1 << 15) for _ in range(4)]
    now = [list(data), list(data)]
    for _ in range(3):
        r, k = rng.randrange(2), rng.randrange(4)
        now[r][k] = change(now[r][k], rng)
    if now[0] == now[1]:
        return None
    return _changes([data, data], now)


def _rate(seed: int, n: int, change) -> int:
    rng = random.Random(seed)
    missed = drawn = 0
    while drawn < n:
        changes = _three_changes(rng, change)
        if changes is None:
            continue
        drawn += 1
        missed += not caught(changes, [(0, 1)], 2, words=4, secret=rng.getrandbits(64))
    return missed


def test_three_random_bit_flips_in_a_4_word_gradient_20000_samples_none_missed():
    """3 bit flips (each on a uniform replica of two, word of 4 and bit of 16) in a 4-word fp16
    gradient of uniformly random words; samples where the replicas still agree are drawn again.
    N = 20,000 samples, a fresh secret each; at most 2**-40 per sample: expected misses below
    2e-8, so none may be missed (two position-weighted sums missed 3 of 20,000, about 1.7e-4 a
    sample: two flips of bit b on words k1 and k3 and one of bit b + 1 on their middle word, in
    the directions that cancel)."""
    n = 20_000
    missed = _rate(3053, n, lambda w, rng: _flipped(w, rng.randrange(16)))
    assert missed <= n * MISS_BOUND, f"{missed} of {n} triples of bit flips missed"


def test_three_random_word_values_in_a_4_word_gradient_3000_samples_none_missed():
    """The control of the case above: 3 changes that write a uniformly random 16-bit value into a
    uniform word of a uniform replica. N = 3,000 samples; at most 2**-40 per sample: none may be missed
    (two position-weighted sums missed none either)."""
    n = 3_000
    missed = _rate(4053, n, lambda w, rng: rng.randrange(-(1 << 15), 1 << 15))
    assert missed <= n * MISS_BOUND, f"{missed} of {n} triples of random words missed"


def test_a_faulty_row_and_neighbouring_words_2000_samples_none_missed():
    """Structured patterns the fixed sums are blind to by design, on random 16-bit data, one
    replica of two, a fresh secret each: the same bit flipped in all 32 words of a row (a faulty
    row), and 8 neighbouring words changed by +1, -1 alternately (neighbouring cells). N = 1,000
    of each; at most 2**-40 per sample: none may be missed."""
    rng = random.Random(5301)
    n, missed = 1_000, 0
    for _ in range(n):
        bit, start, rank = rng.randrange(16), 32 * rng.randrange(100), rng.randrange(2)
        row = [(start + j, w, _flipped(w, bit))
               for j, w in enumerate(rng.randrange(-(1 << 15), 1 << 15) for _ in range(32))]  # fmt: skip
        missed += not caught({rank: row}, [(0, 1)], 2, words=4096, secret=rng.getrandbits(64))
        k = rng.randrange(4096 - 8)
        cells = [(k + j, 100, 100 + (1 if j % 2 == 0 else -1)) for j in range(8)]
        missed += not caught({rank: cells}, [(0, 1)], 2, words=4096, secret=rng.getrandbits(64))
    assert missed <= 2 * n * MISS_BOUND, f"{missed} of {2 * n} structured patterns missed"


def test_random_changes_on_two_ranks_of_two_replica_sets_1000_samples_none_missed():
    """HSDP at 8 ranks (replicate 2): 2 to 6 words changed to random values on a rank of one
    replica set and as many at the same positions on a rank of another (the same new words: the
    pattern a shared weighting cancels), a fresh secret each. N = 1,000: none may be missed."""
    rng = random.Random(5302)
    sets = _pairs(8)
    n, missed = 1_000, 0
    for _ in range(n):
        a, b = rng.sample(range(8), 2)
        if any(a in s and b in s for s in sets):
            b = (a + 1) % 8 if (a + 1) % 8 not in next(s for s in sets if a in s) else (a + 2) % 8
        positions = rng.sample(range(1 << 16), rng.randrange(2, 7))
        new = {k: rng.randrange(-(1 << 15), 1 << 15) for k in positions}
        changes = {a: [(k, 0, new[k]) for k in positions], b: [(k, 0, new[k]) for k in positions]}
        missed += not caught(changes, sets, 8, words=1 << 16, secret=rng.getrandbits(64))
    assert missed <= n * MISS_BOUND, f"{missed} of {n} cross-set patterns missed"


def test_two_words_at_the_words_limit_of_the_largest_set_are_caught():
    """One replica set of 131,072 ranks (the largest world), a rank checking `words_limit()`
    words (2.1e9): two flips as far apart as positions go, on two ranks whose offsets are
    neighbours, and on one rank, each the same change: certain (a fixed secret: the fixed sums
    alone catch them)."""
    from distscaler._replica.checksum import offsets, words_limit

    world = MAX_WORLD_SIZE
    limit = words_limit(world)
    v = offsets(world)
    sets = [tuple(range(world))]
    near = [sorted(range(world), key=lambda i: v[i])[j] for j in (0, 1)]  # offsets v, v + 1
    for first, second in [(near[0], near[1]), (near[1], near[0]), (0, 0)]:
        if first == second:
            changes = {first: [(0, 0, 1), (limit - 1, 1, 0)]}
        else:
            changes = {first: [(limit - 1, 0, 1)], second: [(0, 0, 1)]}
        assert caught(changes, sets, world, words=limit, secret=0), (first, second)


# ---------------------------------------------------------------------- on gloo


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    # HSDP's results skip where torch's own fully_shard fails (torch 2.6 on CPUs: _torch_gaps).
    return guarded(spawn(S.everything_4, 4, tmp_path_factory.mktemp("checksum4")))


#: The replica sets of both layouts: HSDP 2 x 2 (replicate x shard), DDP over {0, 2} and {1, 3}.
REPLICAS = [(0, 2), (1, 3)]


#: (layout, case, ranks that flipped, whether their bits held the same value).
PAIRS = [("hsdp", "pair", (0, 3), True), ("ddp", "pair-same", (0, 3), True),
         ("ddp", "pair-opposite", (0, 1), False)]  # fmt: skip
PAIR_IDS = ["hsdp-0-3", "ddp-0-3", "ddp-0-1"]


@pytest.mark.parametrize(("layout", "case", "flipped", "same"), PAIRS, ids=PAIR_IDS)
def test_the_pairs_flip_one_bit_of_the_same_word_on_two_replica_sets(four, layout, case, flipped,
                                                                      same):  # fmt: skip
    """The guard of the pairs: the flips really happened, on the chosen ranks only (one in each
    replica set), one bit of the same word, the bit holding the same value on both (the same
    change) or opposite values, as asked; the step before was checked and clean."""
    runs = [r[layout][case] for r in four]
    word = runs[0]["flip"]["word"]
    for rank, run in enumerate(runs):
        flip = run["flip"]
        assert flip["word"] == word  # every rank chose the same word
        changed = flip["before"] ^ flip["after"]
        assert changed == (1 << S.BIT if rank in flipped else 0), (rank, flip)
        assert run["checks"] == S.STEPS and not run["skipped"][0]
    a, b = (runs[r]["flip"]["before"] >> S.BIT & 1 for r in flipped)
    assert (a == b) == same
    assert [sum(r in s for r in flipped) for s in REPLICAS] == [1, 1]  # one in each set


@pytest.mark.parametrize("layout", ["hsdp", "ddp"])
def test_one_flip_on_one_rank_is_skipped_on_every_rank(four, layout):
    """The control of the pairs: the same flip on rank 0 alone is caught at that step, skipped on
    every rank, and the replicas stay identical."""
    runs = [r[layout]["one"] for r in four]
    assert runs[0]["flip"]["before"] != runs[0]["flip"]["after"]  # it was flipped
    for run in runs:
        assert run["skipped"] == [False, True]
        assert run["mismatches"] == 1 and run["replica_skipped"] == 1
    for x, y in REPLICAS:
        assert runs[x]["params"] == runs[y]["params"]


@pytest.mark.parametrize(("layout", "case", "flipped", "same"), PAIRS, ids=PAIR_IDS)
def test_two_flips_on_two_replica_sets_are_skipped_on_every_rank(four, layout, case, flipped,
                                                                 same):  # fmt: skip
    """HSDP 2 x 2 with clipping and DDP over {0, 2} and {1, 3}: the flips of the guard above (the
    sign of one gradient element on each of two ranks of two replica sets) are caught at that
    step: skipped on every rank, one mismatch counted, every replica set's ranks holding the same
    parameters after (with weights shared by the sets, the step is taken and the replicas
    diverge)."""
    runs = [r[layout][case] for r in four]
    for run in runs:
        assert run["skipped"][S.FLIP_STEP], run["skipped"]
        assert run["mismatches"] == 1 and run["replica_skipped"] == 1
    for x, y in REPLICAS:
        assert runs[x]["params"] == runs[y]["params"]


def test_a_change_the_unscale_erases_is_not_reported_and_loses_nothing(four):
    """The silent-data-corruption page's words: a change that leaves the optimizer's gradients
    bit-identical is not reported and loses nothing. Rank 1's flipped lowest bit of a 0.0
    gradient (1.4e-45) is unscaled back to 0.0 before the checksum reads it (foreach: no
    mismatch, every replica steps to the same parameters); where the checksum reads the scaled
    gradients (a fused step), the same flip is a mismatch and the step is skipped."""
    runs = [r["erased"] for r in four]
    assert runs[1]["foreach"]["flipped"] > 0.0 and runs[0]["foreach"]["flipped"] == 0.0  # guard
    for r in runs:
        assert not r["foreach"]["skipped"] and r["foreach"]["mismatches"] == 0
        assert r["foreach"]["grad_after"] == 0.0  # what the optimizer read: 0.0 on every rank
        assert r["foreach"]["params"] == runs[0]["foreach"]["params"]  # nothing lost
        assert r["fused"]["skipped"] and r["fused"]["mismatches"] == 1
