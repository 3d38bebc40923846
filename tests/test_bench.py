"""launch/bench.py: the contenders do the same work, and ``--quick`` runs end to end.

The timings themselves are not asserted (speed targets live in the benchmark's report, not in
timed tests); what is asserted is that the benchmark measures what it says it measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _torch_gaps import skip_if_gap_in
from benchkit.cases import Case, make_optimizer, measure, plain_params, split_sizes
from benchkit.contenders import CONTENDERS, ON_REQUEST, build_contender, noop_step

from common.distributed import destroy_process_group
from common.probes import count_per_step

REPO = Path(__file__).resolve().parents[1]
#: distscaler-graph needs a CUDA device (its own test below); distscaler-compiled runs when asked
#: for by name (its own test below: a compile costs seconds).
CPU_CONTENDERS = [c for c in CONTENDERS if c != "distscaler-graph" and c not in ON_REQUEST]


@pytest.fixture
def world_of_one():
    """ShardedGradScaler needs a process group, even of one rank (a private store: no port)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_process_group()


def test_split_sizes_and_bad_input():
    assert split_sizes(10, 3) == [4, 3, 3]
    assert sum(split_sizes(38_000_000, 144)) == 38_000_000
    with pytest.raises(ValueError, match="tensors"):
        split_sizes(5, 10)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer("sgd", [torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="contender must be one of"):
        build_contender(
            "apex",
            params=[],
            make_optimizer=lambda: None,
            optimizer=None,
            clip=None,
            device=torch.device("cpu"),
        )


@pytest.mark.parametrize("clip", [1.0, None])
def test_contenders_leave_the_same_gradients(world_of_one, clip):
    """With a non-fused optimizer every contender's phase leaves the gradients unscaled (and
    clipped): the same values whichever contender ran, so the times compare the same work."""
    case = Case(params=3000, tensors=7)
    params = plain_params(case, torch.device("cpu"))
    saved = [p.grad.clone() for p in params]
    results = {}
    for name in CPU_CONTENDERS:
        c = build_contender(
            name,
            params=params,
            make_optimizer=lambda: make_optimizer("foreach", params),
            optimizer=make_optimizer("foreach", params),
            clip=clip,
            device=torch.device("cpu"),
        )
        assert c.error is None, (name, c.error)
        for p, g in zip(params, saved):
            p.grad.copy_(g)
        c.phase()
        results[name] = [p.grad.clone() for p in params]
    # The reference: unscale, then clip_grad_norm_ exactly as torch does it.
    for p, g in zip(params, saved):
        p.grad.copy_(g / 2.0**16)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    want = [p.grad for p in params]
    assert not all(torch.equal(w, g) for w, g in zip(want, saved))  # the phase did change them
    for name, got in results.items():
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=0, msg=name)


def test_counts_distinguish_the_contenders(world_of_one):
    """Host reads and collectives are counted per contender: DeepSpeed's check reads each gradient's
    found_inf on the host, ShardedGradScaler.unscale_ all-reduces found_inf (and with a fused
    optimizer and no unscale_ it issues none: torch's inherited _check_inf_per_device), distscaler
    with a fused optimizer neither reads nor (at world size 1) communicates."""
    case = Case(params=2000, tensors=5)
    params = plain_params(case, torch.device("cpu"))
    counts = {}
    for kind in ("fused", "foreach"):
        for name in CPU_CONTENDERS:
            c = build_contender(
                name,
                params=params,
                make_optimizer=lambda kind=kind: make_optimizer(kind, params),
                optimizer=make_optimizer(kind, params),
                clip=None,
                device=torch.device("cpu"),
            )
            counts[name, kind] = count_per_step(c.phase)
    assert counts["distscaler", "fused"] == {
        "collectives": 0,
        "collective_bytes": 0,
        "host_reads": 1,  # on the CPU the flag is read (no sync there); a GPU's step reads none
        "ops": 5,  # torch's check kernel, the record's counts, the read, the record, the policy
    }
    assert counts["torch", "fused"]["ops"] == 8  # torch 2.13: the same step, counted the same way
    assert counts["distscaler", "foreach"]["host_reads"] == 1
    assert counts["deepspeed", "fused"]["host_reads"] >= case.tensors
    assert counts["torch-sharded", "foreach"]["collectives"] == 1
    assert counts["torch-sharded", "fused"]["collectives"] == 0


def test_noop_step_keeps_fused_scaling_visible():
    p = torch.nn.Parameter(torch.ones(3))
    opt = noop_step(make_optimizer("fused", [p]))
    assert opt._step_supports_amp_scaling
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))  # no update happened


def test_measure_reports_every_field(world_of_one):
    case = Case(params=4000, tensors=4, clip=True)
    record = measure(
        case,
        params=plain_params(case, torch.device("cpu")),
        device=torch.device("cpu"),
        contenders=CPU_CONTENDERS,
        rounds=2,
        warmup=0,
    )
    assert record["grad_bytes"] == 4000 * 4
    for key in ("optimizer_ms", "floor_read_ms", "floor_read_write_ms", "floor_read_dot_ms"):
        assert record[key] > 0, key
    assert set(record["phase_ms"]) | set(record["errors"]) == set(CPU_CONTENDERS)
    for name, ms in record["phase_ms"].items():
        assert ms > 0 and record["step_ms"][name] > 0
        assert record["counts"][name]["host_reads"] >= 0


def test_graph_contender_says_why_it_cannot_run_on_cpu():
    params = plain_params(Case(params=200, tensors=2), torch.device("cpu"))
    c = build_contender(
        "distscaler-graph",
        params=params,
        make_optimizer=lambda: make_optimizer("fused", params),
        optimizer=make_optimizer("fused", params),
        clip=1.0,
        device=torch.device("cpu"),
    )
    assert c.phase is None and c.error == "CUDA graphs need a CUDA device"


def test_compiled_contender_steps_and_says_when_it_cannot(world_of_one):
    """distscaler-compiled (asked for by name) compiles the phase and the step whole: built with a
    fused AdamW its step moves the parameters as the eager distscaler's does; with another
    optimizer it says why it does not run."""
    from distscaler._traced_step import TRACES_WHOLE_PHASE

    case = Case(params=600, tensors=3)
    moved = {}
    for name in ("distscaler-noreport", "distscaler-compiled"):
        params = plain_params(case, torch.device("cpu"))
        start = [p.detach().clone() for p in params]
        c = build_contender(
            name,
            params=params,
            make_optimizer=lambda params=params: make_optimizer("fused", params),
            optimizer=make_optimizer("fused", params),
            clip=1.0,
            device=torch.device("cpu"),
        )
        if name == "distscaler-compiled" and not TRACES_WHOLE_PHASE:
            assert c.error is not None and "from 2.12" in c.error
            return
        assert c.error is None and c.phase is not None and c.step is not None, (name, c.error)
        c.phase()
        # Built compiled, its step already ran twice (traced, then warm): three steps each. The
        # gradients stay as they are (a fused step unscales and clips inside its kernel).
        for _ in range(3 if name == "distscaler-noreport" else 1):
            c.step()
        moved[name] = [p.detach() - s for p, s in zip(params, start)]
    assert c.countable is False  # a dispatch-mode counter cannot see into a compiled graph
    for eager, compiled in zip(moved["distscaler-noreport"], moved["distscaler-compiled"]):
        assert eager.abs().sum() > 0
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)
    foreach = make_optimizer("foreach", params)
    c = build_contender(
        "distscaler-compiled",
        params=params,
        make_optimizer=lambda: foreach,
        optimizer=foreach,
        clip=1.0,
        device=torch.device("cpu"),
    )
    assert c.phase is None and c.error is not None and "fused optimizer" in c.error


# A whole job launched (about 50 CPU-seconds on 2 cores, 2026-11-28): CI's slow stage runs it.
@pytest.mark.slow
@pytest.mark.xdist_group("bench_quick")
def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "bench.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:  # its world sweep shards with FSDP2, which an old torch's CPU fails
        skip_if_gap_in(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    assert {r["sweep"] for r in records} == {
        "bytes", "tensors", "dtype", "optimizer", "launch", "world"
    }  # fmt: skip
    launch = [r for r in records if r["sweep"] == "launch"]
    records = [r for r in records if r["sweep"] != "launch"]
    # The launch-bound case: host time and device ops per step, side by side with torch.
    assert {(r["tensors"], r["clip"]) for r in launch} == {
        (10, True),
        (10, False),
        (144, True),
        (144, False),
    }
    for r in launch:
        assert r["host_us"]["distscaler"] > 0 and r["host_us"]["torch"] > 0, r
        assert r["ops"]["distscaler"] == (12 if r["clip"] else 5), r
        # The overflow report on: fewer than torch's with clipping, no more without.
        assert r["ops"]["distscaler"] <= r["ops"]["torch"] - (1 if r["clip"] else 0), r
        # DeepSpeed's rule as from_deepspeed gives it: the torch rule's + 2, + 2 for its minimum
        # (clamp) and its raise at the minimum (one read of the flag, exhaustion and scale).
        assert r["ops"]["distscaler-deepspeed"] == r["ops"]["distscaler"] + 4, r
        assert r["ops"]["distscaler-megatron"] == r["ops"]["distscaler"] + 3, r
    for r in records:
        assert r["phase_ms"]["distscaler"] > 0, r
        assert r["counts"]["distscaler"]["ops"] > 0, r
        ours = r["counts"]["distscaler"]
        assert ours["collectives"] == (1 if r["world_size"] > 1 else 0), r
        # The flag (fused: on the CPU only, where it is free), with clipping after this rank's
        # norm (its float32 norms are taken again in float64 where it is not finite); the replica
        # check's reading at more than one DDP rank runs every 32nd update by default (none in
        # these rounds).
        checked = r.get("layout") == "ddp" and r["world_size"] > 1
        reads = 2 if r.get("clip", True) else 1
        assert ours["host_reads"] == reads, r
        if checked:
            assert r["counts"]["distscaler-nocheck"]["host_reads"] == reads, r
    worlds = {
        (r["layout"], r["world_size"], r["optimizer"]) for r in records if r["sweep"] == "world"
    }
    assert worlds == {
        (layout, w, kind)
        for layout in ("ddp", "fsdp2")
        for w in (1, 2)
        for kind in ("fused", "foreach")
    }
    # torch's FSDP2 recipe with clipping: ShardedGradScaler.unscale_'s all_reduce + the DTensor norm's.
    (sharded,) = [
        r for r in records
        if (r["sweep"], r["layout"], r["world_size"], r["optimizer"]) == ("world", "fsdp2", 2, "foreach")
    ]  # fmt: skip
    assert sharded["counts"]["torch-sharded"]["collectives"] >= 2
    assert {s["world_size"] for s in results["simulation"]} == {8, 64}
    assert all(s["ours"]["total"] == 1 for s in results["simulation"])
    report = (out / "results.md").read_text()
    assert "## Targets" in report and "## Sweep: world" in report and "## Sweep: launch" in report
    for png in ("phase_vs_bytes.png", "phase_vs_tensors.png", "phase_vs_world_size.png"):
        assert (out / png).stat().st_size > 10_000, png
    names = {t["target"] for t in results["targets"]}
    assert any("collectives per step" in n for n in names)
    assert any("device ops per step with clipping" in n for n in names)

    # --from-json renders the same report again without measuring anything.
    again = tmp_path / "again"
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "bench.py"), "--from-json",
         str(out / "results.json"), "--out", str(again)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (again / "results.md").read_text() == report
    assert "single-process cases" not in proc.stderr  # nothing was measured


def test_host_cost_times_the_triton_path_with_its_launches_stubbed(tmp_path):
    """launch/host_cost.py end to end (its own process: it replaces the Triton pass's kernels):
    distscaler's phase really took the Triton path (its two launches at one rank counted, not
    run), torch's recipe beside it, every field reported."""
    out = tmp_path / "host.json"
    subprocess.run(
        [sys.executable, str(REPO / "launch" / "host_cost.py"), "--tensors", "12",
         "--rounds", "1", "--calls", "5", "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    records = json.loads(out.read_text())["records"]
    assert [(r["tensors"], r["clip"]) for r in records] == [(12, True), (12, False)]
    for r in records:
        assert r["ops"]["distscaler"]["triton_launches"] == 2  # read + reduce (one rank)
        assert r["ops"]["torch"]["triton_launches"] == 0
        assert r["ops"]["distscaler"]["torch_ops"] > 0 and r["ops"]["torch"]["torch_ops"] > 0
        for key in ("hot_us", "alternating_us"):
            assert set(r[key]) == {"distscaler", "torch"} and min(r[key].values()) > 0


def test_host_cost_with_real_launches_runs_the_kernels_and_counts_them(tmp_path):
    """``--launches real`` (a GPU's host time with the launches in it): the kernels are launched
    for real, here in Triton's interpreter, and still counted; the stubs' own mode refuses CUDA."""
    pytest.importorskip("triton")
    out = tmp_path / "host.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "host_cost.py"), "--tensors", "6", "--rounds", "1",
         "--calls", "2", "--launches", "real", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Triton launches real" in proc.stdout
    records = json.loads(out.read_text())["records"]
    assert [r["ops"]["distscaler"]["triton_launches"] for r in records] == [2, 2]
    assert {r["launches"] for r in records} == {"real"}
    refused = subprocess.run(
        [sys.executable, str(REPO / "launch" / "host_cost.py"), "--device", "cuda", "--launches",
         "stubbed"], capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert refused.returncode == 2 and "--launches stubbed runs on --device cpu" in refused.stderr


def test_kernel_bench_times_te_and_apex_norms_where_they_are_installed(monkeypatch):
    """launch/kernel_bench.py's Transformer Engine and Apex recipes, on the CPU with an applier
    standing in for theirs (neither installs here): called as theirs are (``applier(op,
    noop_flag, [tensors], inv_scale, per_tensor)`` for TE's unscale + norm, without ``inv_scale``
    for Apex's norm), one call per dtype group, the groups' norms combined into torch's total
    norm (the sum of squares in two levels: to float32 rounding). Without either, no such recipe
    and ``meta`` says why."""
    sys.path.insert(0, str(REPO / "launch"))
    import kernel_bench

    found, seen = kernel_bench.foreign_norms()
    assert set(seen) == {"transformer_engine", "apex"}
    calls: list[tuple] = []

    def applier(op, noop, lists, *extra):  # what their appliers return: (norm (1,), per_tensor)
        calls.append((op, noop.dtype, len(lists), extra))
        norms = torch._foreach_norm(lists[0], 2.0, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None

    stand_in = {"te-unscale-l2norm": (applier, "te", True), "apex-l2norm": (applier, "apex", False)}
    monkeypatch.setattr(kernel_bench, "foreign_norms", lambda: (stand_in, seen))
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).to(dt) for n, dt in
             [(100, torch.float32), (7, torch.bfloat16), (33, torch.float32)]]  # fmt: skip
    recipes, _ = kernel_bench.make_recipes(grads)
    expected = recipes["torch-norm"]()
    for name, op, extra in (("te-unscale-l2norm", "te", 2), ("apex-l2norm", "apex", 1)):
        calls.clear()
        torch.testing.assert_close(recipes[name](), expected, rtol=1e-6, atol=0)  # 2 levels
        assert [(c[0], c[1], c[2], len(c[3])) for c in calls] == [(op, torch.int32, 1, extra)] * 2
    if not found:  # this machine: neither installed, so no recipe of theirs
        monkeypatch.undo()
        assert not {"te-unscale-l2norm", "apex-l2norm"} & set(kernel_bench.make_recipes(grads)[0])
