"""distscaler under torchft, stock torch.amp.GradScaler side by side (issue 35).

Each scenario of :mod:`_torchft_scenarios` runs twice at once, against its own in-process
lighthouse: the groups wired with :func:`distscaler.integrations.torchft.install` ("ours") and with
``torch.amp.GradScaler`` + torchft's ``OptimizerWrapper`` as a new user writes it ("stock"). Ours
must apply exactly the true update at every step it steps (ratio 1.0), end with the same parameters
(difference 0) and the same scale in every group, and call ``should_commit()`` exactly once per
step; the stock run shows the failure the issue measured. The tests outside torchft check the
core's side: a group passed without ``init_process_group``, a group whose membership changes.
"""

from __future__ import annotations

import math
import threading
from importlib import metadata
from typing import Any

import pytest

try:
    FOUND: str | None = metadata.version("torchft")
except metadata.PackageNotFoundError:
    FOUND = None
#: The torchft release the integration is pinned to (pyproject.toml: the torchft extra).
TESTED = "0.2.0"

needs_torchft = pytest.mark.skipif(FOUND is None, reason="torchft is not installed")


def _both(name: str, tmp_path: Any, **overrides: Any) -> dict[str, dict[str, Any]]:
    """Run scenario ``name`` with our wiring and the stock one at the same time."""
    import _torchft_scenarios as S

    results: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def go(wiring: str) -> None:
        try:
            spec = dict(S.SCENARIOS[name], wiring=wiring, **overrides)
            results[wiring] = S.run(spec, str(tmp_path / wiring), timeout=100)
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=(w,)) for w in ("ours", "stock")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _assert_ours_exact(result: dict[str, Any], *, min_steps: int) -> dict[str, Any]:
    """Ratio 1.0 at every step taken, the same parameters and scale everywhere, should_commit once
    per step; returns the summary."""
    import _torchft_scenarios as S

    assert not result["timed_out"], result["exits"]
    s = S.summary(result)
    for g, group in s["groups"].items():
        assert group["step"] is not None and group["step"] >= min_steps, (g, group["step"])
        assert group["ratios"], g
        assert all(abs(r - 1.0) < 1e-6 for r in group["ratios"]), (g, group["ratios"])
        assert set(group["commit_calls"]) == {1}, (g, group["commit_calls"])
    assert s["dparam"] == 0.0, s["dparam"]
    scales = {group["scale"] for group in s["groups"].values()}
    assert len(scales) == 1, scales
    return s


def _first_after_heal(records: list[dict]) -> dict:
    import _torchft_scenarios as S

    return next(d for d in S.steps_of(records) if d["attempt"] == 1 or d["healed"])


# ---------------------------------------------------------------------- the five scenarios


@needs_torchft
def test_inf_after_the_average_on_one_group_skips_on_every_group(tmp_path):
    """An inf written into group 0's gradients after the cross-replica average: every group skips and
    backs off (the cross-replica found_inf), the report names group 0, and clipping through torchft's
    DDP (its one-rank dummy group) counts each value once. Stock: group 0 skips alone, is healed
    without its scale, its next step applies 2x the true update, the scales stay split."""
    import _torchft_scenarios as S

    both = _both("inf_after_average", tmp_path)
    s = _assert_ours_exact(both["ours"], min_steps=8)
    assert all(g["skips"] == 1 for g in s["groups"].values())  # the injected inf was seen
    assert s["groups"][0]["scale"] == S.INIT_SCALE / 2
    for g, records in both["ours"]["records"].items():
        steps = S.steps_of(records)
        hit = next(d for d in steps if d["step"] == 3)
        assert not hit["stepped"] and hit["committed"] is True
        assert hit["lone"] == [3, 0, g == 0]  # replica rank 0 went non-finite alone
        for d in steps:  # the norm of the averaged, unscaled gradients, each value once
            if d["stepped"]:
                assert d["norm"] == pytest.approx(d["true_norm"], rel=1e-5)

    stock = S.summary(both["stock"])
    ratios0 = stock["groups"][0]["ratios"]
    assert any(abs(r - 2.0) < 1e-6 for r in ratios0), ratios0  # the heal step, unscaled by 512
    assert stock["groups"][0]["scale"] != stock["groups"][1]["scale"]
    assert stock["dparam"] is not None and stock["dparam"] > 1e-3


@needs_torchft
@pytest.mark.parametrize("quorum", ["rejoin_async", "rejoin_sync"])
def test_a_group_that_dies_and_rejoins_takes_the_scale_before_its_first_unscale(tmp_path, quorum):
    """Group 1 dies at step 4 (scale 256 after two agreed overflows) and is restarted: it heals from
    group 0 with the scaler's state, in place before it unscales (async quorum: torchft would apply
    it only inside should_commit). Stock: the restarted group keeps init_scale 1024 for good."""
    import _torchft_scenarios as S

    both = _both(quorum, tmp_path)
    s = _assert_ours_exact(both["ours"], min_steps=5)
    assert s["groups"][0]["scale"] == 256.0
    rejoined = [d for d in S.steps_of(both["ours"]["records"][1]) if d["attempt"] == 1]
    assert rejoined and rejoined[0]["healed"] and rejoined[0]["ratio"] == pytest.approx(1.0)
    assert rejoined[0]["scale_after"] == 256.0

    stock = S.summary(both["stock"])
    assert (stock["groups"][0]["scale"], stock["groups"][1]["scale"]) == (256.0, 1024.0)
    stock_rejoined = [d for d in S.steps_of(both["stock"]["records"][1]) if d["attempt"] == 1]
    off = [d["ratio"] for d in stock_rejoined if d["ratio"] is not None]
    assert any(abs(r - 1.0) > 0.1 for r in off), off


@needs_torchft
def test_an_overflow_in_the_heal_step_keeps_the_heal(tmp_path):
    """An overflow (before the average) in the very step group 1 heals in, async quorum: ours skips
    it on both groups but still calls should_commit, so torchft applies the heal. Stock: the skip
    bypasses should_commit, the staged state is dropped, and since the manager step already moved
    the group is never healed: it trains on from its fresh initial weights."""
    import _torchft_scenarios as S

    both = _both("skip_in_heal_step", tmp_path)
    s = _assert_ours_exact(both["ours"], min_steps=5)
    heal = _first_after_heal([d for d in both["ours"]["records"][1] if d.get("attempt") == 1])
    assert heal["healed"] and not heal["stepped"] and heal["commit_calls"] == 1
    assert s["groups"][0]["scale"] == 128.0  # 1024 -> 512 -> 256, then the heal step's overflow

    stock_rejoined = [d for d in S.steps_of(both["stock"]["records"][1]) if d["attempt"] == 1]
    assert stock_rejoined and not any(d["healed"] for d in stock_rejoined)  # the heal was dropped
    stock = S.summary(both["stock"])
    assert stock["dparam"] is not None and stock["dparam"] > 0.05


@needs_torchft
def test_a_late_group_joins_with_the_running_scale(tmp_path):
    """Group 1 starts after group 0 has backed off twice (scale 256); then an inf after the average on group 0.
    Stock: the joiner keeps 1024, the scales stay split and the updates differ."""
    import _torchft_scenarios as S

    both = _both("late_join", tmp_path)
    s = _assert_ours_exact(both["ours"], min_steps=5)
    assert s["groups"][1]["heals"] >= 1
    assert s["groups"][0]["scale"] == 128.0  # 256, then the inf after the average, on both

    stock = S.summary(both["stock"])
    assert stock["groups"][0]["scale"] != stock["groups"][1]["scale"]
    assert stock["dparam"] is not None and stock["dparam"] > 1e-3


@needs_torchft
def test_two_groups_of_two_ranks_with_sharded_gradients_agree_inside_and_across(tmp_path):
    """2 groups x 2 ranks, gradients sharded inside a group: an inf in rank 0's shard before the
    average (it reaches the other group's rank 0 only), later one after the average on group 1's
    rank 1 only: all four ranks skip together both times. Stock: the two ranks of a group disagree,
    and should_commit (a barrier of the group's ranks) fails."""
    import _torchft_scenarios as S

    both = _both("two_by_two", tmp_path)
    ours = both["ours"]
    _assert_ours_exact(ours, min_steps=7)
    for rank in (0, 1):  # each rank's shard equal across the groups, steps skipped together
        a, b = (S.steps_of(ours["records_by_rank"][(g, rank)]) for g in (0, 1))
        assert a[-1]["params"] == b[-1]["params"]
        assert [d["stepped"] for d in a] == [d["stepped"] for d in b]
        assert [d["step"] for d in a if not d["stepped"]] == [2, 4]
        assert a[-1]["scale_after"] == S.INIT_SCALE / 4

    stock = both["stock"]["records_by_rank"]
    r0, r1 = (S.steps_of(stock[(0, rank)]) for rank in (0, 1))
    at2 = [(d["stepped"], d["commit_calls"]) for d in (r0 + r1) if d["step"] == 2]
    assert (False, 0) in at2 or len(r0) < 3  # rank 0 skipped without should_commit...
    finished = all(
        S.steps_of(recs) and S.steps_of(recs)[-1]["step_after"] >= 7 for recs in stock.values()
    )
    assert not finished or len({d["scale_after"] for d in (r0[-1], r1[-1])}) > 1


@needs_torchft
def test_report_lone_replica_drops_only_the_corrupted_group(tmp_path):
    """report_lone_replica=True: the group that alone went non-finite after the average reports it
    to torchft, does not commit (its scale update discarded) and heals from its peer at the next
    quorum; the other group steps normally. No backoff anywhere."""
    import _torchft_scenarios as S

    result = _both("report_lone_replica", tmp_path)["ours"]
    s = S.summary(result)
    assert s["dparam"] == 0.0
    assert {g["scale"] for g in s["groups"].values()} == {S.INIT_SCALE}
    for g, records in result["records"].items():
        steps = S.steps_of(records)
        assert all(d["commit_calls"] == 1 for d in steps)
        assert all(abs(d["ratio"] - 1.0) < 1e-6 for d in steps if d["ratio"] is not None)
        hit = next(d for d in steps if d["step"] == 3)
        assert hit["committed"] is (g != 0) and hit["stepped"] is (g != 0)
        assert hit["lone"] == [3, 0, g == 0]
    assert s["groups"][0]["heals"] == 1  # healed from group 1 at the next quorum


# ---------------------------------------------------------------------- issue 41: heals verified

HEAL_CHECKS = ("bad_heal_lr", "bad_heal_param_bit", "heal_and_flip")


@pytest.fixture(scope="module")
def heal_checks(tmp_path_factory):
    """The heal-check scenarios of :mod:`_torchft_scenarios` with distscaler's wiring, at once."""
    import _torchft_scenarios as S

    root = tmp_path_factory.mktemp("heal_checks")
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def go(name: str) -> None:
        try:
            # A ceiling, not the run's length (about 30 s each on 2 cores, side by side).
            results[name] = S.run(dict(S.SCENARIOS[name], wiring="ours"), str(root / name),
                                  timeout=200)  # fmt: skip
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=(name,)) for name in HEAL_CHECKS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@needs_torchft
@pytest.mark.parametrize(
    ("name", "parts"),
    [("bad_heal_lr", ["parameters", "optimizer"]), ("bad_heal_param_bit", ["parameters"])],
)
def test_a_bad_heal_is_found_at_the_first_step_after_it_and_healed_again(heal_checks, name, parts):
    """Group 1 dies at step 4 and is restarted; its first heal loads a stale learning rate
    (torchtitan #4598) or a parameter with one flipped bit. At its first step after the heal its
    state is compared with group 0's on the step's exchange: the difference is found there, named
    (group 1, the parts that differ) on both groups, group 1 does not commit (a skip of cause
    replica_mismatch, its scale unchanged) and heals again at the next quorum; that heal is
    verified, and the groups end with the same parameters and scale, every step taken exact."""
    import _torchft_scenarios as S

    result = heal_checks[name]
    s = _assert_ours_exact(result, min_steps=5)
    rejoiner = [d for d in S.steps_of(result["records"][1]) if d["attempt"] == 1]
    heals = [i for i, d in enumerate(rejoiner) if d["healed"]]
    assert len(heals) == 2, [(d["step"], d["healed"]) for d in rejoiner]  # healed, then again
    check = rejoiner[heals[0] + 1]  # the first step after the (bad) heal
    assert check["divergence"] == [check["step"], "healed state", [1], True, parts, True]
    assert check["committed"] is False and not check["stepped"]
    assert check["step_after"] == check["step"] and check["scale_after"] == check["scale_before"]
    assert check["skip_causes"]["replica_mismatch"] == 1
    assert check["ledger"]["replica_mismatches"] == 1 and check["ledger"]["replica_skipped"] == 1
    assert heals[1] == heals[0] + 2  # healed again at the next quorum
    verified = rejoiner[heals[1] + 1]  # the check after the second heal passed
    assert verified["ledger"]["replica_param_checks"] == check["ledger"]["replica_param_checks"] + 1
    assert all(d["divergence"] == check["divergence"] for d in rejoiner[heals[0] + 1 :])
    assert verified["stepped"] and verified["committed"]
    survivor = S.steps_of(result["records"][0])
    at = next(d for d in survivor if d["step"] == check["step"])
    assert at["stepped"] and at["committed"]  # the reference group stepped on
    assert at["divergence"] == [check["step"], "healed state", [1], False, parts, True]
    assert s["groups"][1]["skips"] == 0  # the uncommitted step is no skip of the scale


@needs_torchft
def test_a_good_heal_is_verified_and_a_flip_after_it_is_found_across_groups(heal_checks):
    """One run: group 1 dies and rejoins with a good heal (verified at its first step after it,
    nothing reported), then one finite bit flipped in group 0's gradients after the average. The
    replica check across the participating groups finds it: with two groups neither is the
    majority, so both are named, neither commits (a skip of cause replica_mismatch, the scale
    unchanged) and the step is retried; the groups end equal, every step taken exact."""
    import _torchft_scenarios as S

    result = heal_checks["heal_and_flip"]
    _assert_ours_exact(result, min_steps=5)
    rejoiner = [d for d in S.steps_of(result["records"][1]) if d["attempt"] == 1]
    heal = next(i for i, d in enumerate(rejoiner) if d["healed"])
    verified = rejoiner[heal + 1]
    assert verified["ledger"]["replica_param_checks"] >= 1 and verified["divergence"] is None
    assert verified["stepped"] and sum(d["healed"] for d in rejoiner) == 1
    flipped = next(d for d in S.steps_of(result["records"][0]) if d["inject"] == ["flip"])
    step = flipped["step"]
    for g, records in result["records"].items():
        at = [d for d in S.steps_of(records) if d["step"] == step]
        hit, retry = at[0], at[1]
        assert hit["divergence"] == [step, "gradients", [0, 1], True, [], True], g
        assert hit["committed"] is False and not hit["stepped"]
        assert hit["scale_after"] == hit["scale_before"]
        assert hit["skip_causes"]["replica_mismatch"] == 1
        assert retry["stepped"] and retry["step_after"] == step + 1  # the step retried
        last = S.steps_of(records)[-1]
        assert last["ledger"]["replica_mismatches"] == 1
        assert last["ledger"]["replica_checks"] >= 3  # gradients compared at every step (CPU)


def test_the_state_checksum_catches_one_flip_and_a_cancelling_pair():
    """The heal check's checksum (the replica check's exact moments over one stream of
    words): one flipped bit anywhere, and two flips of the same bit in opposite directions (which
    a plain sum of words cancels), in one tensor or across two, change it."""
    import torch

    from distscaler.integrations.torchft import _checksum

    cpu = torch.device("cpu")
    a = torch.linspace(-3, 3, 300)
    b = torch.linspace(1, 2, 77, dtype=torch.float64)
    base = _checksum([a, b], cpu, 7)

    def flipped(t: torch.Tensor, i: int, bit: int) -> torch.Tensor:
        t = t.clone()
        words = t.view(torch.int16)
        words[i] ^= 1 << bit
        return t

    for i, bit in [(0, 0), (17, 15), (599, 7)]:
        assert not torch.equal(_checksum([flipped(a, i, bit), b], cpu, 7), base)
    # Same bit, opposite directions: word 2 has bit 3 clear, word 40 has it set (constructed).
    c = a.clone()
    w = c.view(torch.int16)
    w[2] &= ~(1 << 3)
    w[40] |= 1 << 3
    ref = _checksum([c, b], cpu, 7)
    d = c.clone()
    d.view(torch.int16)[2] |= 1 << 3
    d.view(torch.int16)[40] &= ~(1 << 3)
    assert int(d.view(torch.int16).sum()) == int(c.view(torch.int16).sum())  # a plain sum cancels
    assert not torch.equal(_checksum([d, b], cpu, 7), ref)
    e = b.clone()
    e.view(torch.int16)[5] ^= 1 << 3
    assert not torch.equal(_checksum([flipped(c, 2, 3), e], cpu, 7), ref)
    # A second difference (+1, -2, +1 on neighbouring words: plain and position sums cancel) is
    # seen by the keyed sum, keyed by the step: at each of 20 steps, with that step's own key
    # (the same in every group), and the keys differ from step to step.
    f = c.clone()
    f.view(torch.int16)[100:103] += torch.tensor([1, -2, 1], dtype=torch.int16)
    for step in range(20):
        ours, theirs = _checksum([f, b], cpu, step), _checksum([c, b], cpu, step)
        assert torch.equal(ours[:4], theirs[:4]) and not torch.equal(ours[4:], theirs[4:]), step
    assert not torch.equal(_checksum([c, b], cpu, 1), _checksum([c, b], cpu, 2))


# ---------------------------------------------------------------------- the core, outside torchft


def _plain_group_rank(rank: int, store_path: str, queue: Any, dynamic: bool) -> None:
    try:
        _plain_group_run(rank, store_path, queue, dynamic)
    except BaseException as e:
        queue.put((rank, repr(e)))
        raise


def _plain_group_run(rank: int, store_path: str, queue: Any, dynamic: bool) -> None:
    import torch
    import torch.distributed as dist

    from distscaler import GradScaler

    store = dist.FileStore(store_path, 2)
    # No init_process_group: a group built as torchft builds its own.
    plain = dist.ProcessGroup(store, rank, 2)
    backend = dist.ProcessGroupGloo(store, rank, 2)
    plain._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    plain._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group: dist.ProcessGroup = plain
    if dynamic:  # a Python group that says its membership may change (torchft's are so)

        class Dynamic(dist.ProcessGroup):
            dynamic_membership = True

            def size(self) -> int:  # type: ignore[override]
                return plain.size()

            def allreduce(self, tensors: Any, opts: Any) -> Any:  # type: ignore[override]
                return plain.allreduce(tensors, opts)

        group = Dynamic(rank, 2)
    assert not dist.is_initialized()
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0, process_group=group, grad_layout="replicated")
    out = []
    for step in range(3):
        (scaler.scale(p.sum())).backward()
        if step == 1 and rank == 1:
            p.grad[0] = math.inf
        norm = scaler.clip_grad_norm_(opt, max_norm=math.inf)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append((bool(scaler.step_was_skipped), scaler.get_scale(), float(norm)))
    queue.put((rank, out, p.detach().tolist(), scaler.state_dict()["scale"]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_gloo_group_passed_without_init_process_group_is_used(tmp_path, dynamic):
    """A ProcessGroup built on a FileStore (its gloo backend registered, no init_process_group) is
    the scaler's process group: an inf on rank 1 only skips the step on both ranks; the norm is global."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_plain_group_rank, args=(r, str(tmp_path / "store"), queue, dynamic))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    got = dict((r, rest) for r, *rest in (queue.get(timeout=150) for _ in procs))
    assert all(len(v) == 3 for v in got.values()), got  # a rank's error otherwise
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert got[0] == got[1]
    steps = got[0][0]
    assert [s[0] for s in steps] == [False, True, False]
    assert [s[1] for s in steps] == [8.0, 4.0, 4.0]
    assert steps[0][2] == pytest.approx(2.0)  # replicated: |ones(4)| counted once over 2 ranks


def test_a_group_whose_membership_changes_is_all_reduced_at_every_step(monkeypatch):
    """At a size of 1 a plain group needs no collective; one marked ``dynamic_membership`` (or any
    torchft group) gets it at every step, since its size is a snapshot of a changing quorum."""
    import torch
    import torch.distributed as dist

    from distscaler import GradScaler
    from distscaler._process_group import has_dynamic_membership, needs_collective

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: calls.append(group))

    class Managed(dist.ProcessGroup):
        dynamic_membership = True

        def size(self) -> int:  # type: ignore[override]
            return 1

    managed = Managed(0, 1)
    assert has_dynamic_membership(managed) and needs_collective(managed, 1)
    assert not needs_collective(None, 1)
    for group, expected in ((None, 0), (managed, 1)):
        calls.clear()
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = GradScaler("cpu", process_group=group)
        scaler.scale(p.sum()).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        assert len(calls) == expected, (group, calls)


def test_host_reads_never_ask_the_group():
    """state_dict/get_scale never call the group (torchft calls state_dict on its quorum thread,
    where asking a managed group for its size waits for that very thread)."""
    import torch
    import torch.distributed as dist

    from distscaler import GradScaler

    class Busy(dist.ProcessGroup):
        dynamic_membership = True

        def size(self) -> int:  # type: ignore[override]
            raise AssertionError("a host read asked the group for its size")

    scaler = GradScaler("cpu", process_group=Busy(0, 1))
    scaler.scale(torch.ones(()))
    assert scaler.state_dict()["scale"] == 2.0**16
    assert scaler.get_scale() == 2.0**16
