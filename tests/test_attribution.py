"""Overflow attribution (``distscaler.attribution``, ``GradScaler.last_overflow``).

* In this process (world size 1): every inf check path names the tensors that held inf, -inf or NaN
  (clip, the fused check, the non-fused step, ``unscale_()`` before a fused step or before
  ``clip_grad_norm_``), with the user's names or ``param_groups[g][i]``; the record keeps the last
  skipped step of an interval; optimizers that did not overflow are not blamed; the log line.
* Spawned gloo ranks (tests/_overflow_scenarios.py), 2 ranks (DDP, FSDP2, PP, FSDP1 with and
  without ``use_orig_params``) and 4 ranks (HSDP, FSDP2 x TP, PP x DDP): faults written into named
  parameters on chosen ranks at chosen updates; the report is exact and the same on every rank,
  clean steps keep one all_reduce and no host read (fused), and a report adds one all_gather only
  when there is an overflow to attribute.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle

import _overflow_scenarios as S
import pytest
import torch
from _common import gpu_path
from _harness import HostReadSpy, spawn
from _models import make_model
from _torch_gaps import skip_if_torch_gap

import distscaler
from distscaler import OverflowEntry, OverflowReport


def _backward(scaler, model, faults=()):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    named = dict(model.named_parameters())
    for name, value in faults:
        named[name].grad.view(-1)[0] = value


def _train(scaler, model, opt, schedule, *, mode="clip"):
    """One update per entry of ``schedule`` (a list of faults: (name, value))."""
    for faults in schedule:
        opt.zero_grad()
        _backward(scaler, model, faults)
        if mode == "clip":
            scaler.clip_grad_norm_(opt, 1.0)
        elif mode == "unscale":
            scaler.unscale_(opt)
        elif mode == "unscale+clip":
            scaler.unscale_(opt)
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()


def _entries(report):
    return [(e.rank, e.param, e.kind) for e in report.entries]


@pytest.mark.parametrize(
    "opt_kind, mode",
    [
        ("fused", "clip"),
        ("fused", "step"),
        ("foreach", "clip"),
        ("foreach", "step"),
        ("for-loop", "step"),
        ("fused", "unscale"),
        ("foreach", "unscale+clip"),
    ],
)
def test_every_path_names_the_tensors_that_held_inf_or_nan(opt_kind, mode):
    model = make_model()
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags[opt_kind])
    scaler = distscaler.GradScaler("cpu", skip_log_interval=1).register_model(model)
    faults = [("2.weight", -math.inf), ("0.bias", math.nan), ("4.bias", math.inf)]
    _train(scaler, model, opt, [[], faults, []], mode=mode)
    report = scaler.last_overflow
    assert report is not None and report.step == 2
    assert report.scale == 2.0**16  # the scale the skipped step used (now halved)
    assert scaler.get_scale() == 2.0**15
    assert _entries(report) == [(0, "0.bias", "nan"), (0, "2.weight", "inf"), (0, "4.bias", "inf")]


def test_a_nan_next_to_an_inf_in_one_tensor_is_a_nan():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = distscaler.GradScaler("cpu", skip_log_interval=1).register_model(model)
    opt.zero_grad()
    _backward(scaler, model, [("2.weight", math.inf)])
    model[2].weight.grad.view(-1)[5] = math.nan
    scaler.step(opt)
    scaler.update()
    assert _entries(scaler.last_overflow) == [(0, "2.weight", "nan")]


def test_unregistered_parameters_are_named_by_their_place_in_the_optimizer():
    model = make_model()
    head = list(model[4].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = torch.optim.AdamW([{"params": body}, {"params": head}], lr=1e-3, fused=True)
    scaler = distscaler.GradScaler("cpu", skip_log_interval=1)
    _train(scaler, model, opt, [[("4.bias", math.inf)]], mode="step")
    assert _entries(scaler.last_overflow) == [(0, "param_groups[1][1]", "inf")]


def test_wrapper_attributes_are_not_part_of_the_name():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = make_model()
    model = torch.nn.Sequential(checkpoint_wrapper(inner))
    assert "0._checkpoint_wrapped_module.2.weight" in dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = distscaler.GradScaler("cpu", skip_log_interval=1).register_model(model)
    opt.zero_grad()
    _backward(scaler, inner, [("2.weight", math.inf)])
    scaler.step(opt)
    scaler.update()
    assert _entries(scaler.last_overflow) == [(0, "0.2.weight", "inf")]


def test_the_report_is_of_the_last_skipped_step_of_the_interval():
    # The path a GPU runs (no host read of the flag), so that the reads below are the report's.
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = gpu_path(distscaler.GradScaler("cpu", skip_log_interval=4).register_model(model))
    schedule = [[("0.weight", math.inf)], [], [("2.bias", math.nan)], []]
    _train(scaler, model, opt, schedule[:3], mode="clip")
    assert scaler.last_overflow is None  # not reported before the interval's end
    _train(scaler, model, opt, schedule[3:], mode="clip")
    report = scaler.last_overflow
    assert report.step == 3 and _entries(report) == [(0, "2.bias", "nan")]
    assert report.scale == 2.0**15  # the first skip halved it
    # A clean interval keeps the report (and costs no more host reads than the periodic one).
    spy = HostReadSpy()
    spy.exclude_optimizer(opt)
    with spy:
        _train(scaler, model, opt, [[]] * 4, mode="clip")
    assert scaler.last_overflow is report and len(spy.reads) == 1


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_parameters_without_a_gradient_this_step_are_clean(path):
    # On the GPU's path the subset's flags are scattered into the overflow flags' order, which the
    # inf check's elements of found_inf (one per flagged gradient) do not fit: they take the 0-dim
    # found_inf, in a lerp_ of their own.
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = distscaler.GradScaler("cpu", skip_log_interval=1).register_model(model)
    if path == "gpu":
        gpu_path(scaler)
    _train(scaler, model, opt, [[("0.weight", math.inf)]], mode="clip")
    opt.zero_grad()
    _backward(scaler, model, [("4.weight", math.nan)])
    model[2].weight.grad = None  # a subset of the grouped parameters this step
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    assert _entries(scaler.last_overflow) == [(0, "4.weight", "nan")]


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("second", ["foreach", "fused"])
def test_an_optimizer_that_held_nothing_is_not_blamed(path, second):
    # Two optimizers stepped: the agreed found_inf is their maximum, so neither check's elements of
    # its own found_inf weigh its flags (the GPU's path with two fused optimizers).
    model = make_model()
    first, rest = (
        list(model[0].parameters()),
        [p for m in (model[2], model[4]) for p in m.parameters()],
    )
    fused = torch.optim.AdamW(first, lr=1e-3, fused=True)
    plain = torch.optim.AdamW(rest, lr=1e-3, **{second: True})
    scaler = distscaler.GradScaler("cpu", skip_log_interval=1).register_model(model)
    if path == "gpu":
        gpu_path(scaler)

    def update(faults, optimizers):
        for opt in (fused, plain):
            opt.zero_grad()
        _backward(scaler, model, faults)
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()

    update([("2.weight", math.inf)], [fused, plain])  # a non-fused one codes after its read
    assert _entries(scaler.last_overflow) == [(0, "2.weight", "inf")]
    update([("0.bias", math.nan)], [fused, plain])  # plain's own step was clean: not blamed
    assert _entries(scaler.last_overflow) == [(0, "0.bias", "nan")]
    update([("2.bias", math.inf)], [plain])  # fused did not step: its old record is not reported
    assert _entries(scaler.last_overflow) == [(0, "2.bias", "inf")]
    update([("0.weight", math.inf)], [fused])  # and plain's is not either
    assert _entries(scaler.last_overflow) == [(0, "0.weight", "inf")]
    assert scaler.skip_totals.num_skipped == 4


def test_the_log_line_names_the_step_the_scale_and_a_few_entries(caplog):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = distscaler.GradScaler("cpu", init_scale=16.0, skip_log_interval=1)
    scaler.register_model(model)
    caplog.set_level(logging.WARNING, logger="distscaler")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 8)).float().sum()
    scaler.scale(loss).backward()
    for i in range(6):
        model[i].weight.grad[0, 0] = math.nan if i == 3 else math.inf
    scaler.step(opt)
    scaler.update()
    (record,) = caplog.records
    assert record.levelname == "WARNING" and record.name == "distscaler"
    assert record.getMessage() == (  # no "distscaler: " in it: a %(name)s format says it once
        "inf/NaN gradients at step 1 (loss scale 16): inf in `0.weight` on rank 0, "
        "inf in `1.weight` on rank 0, inf in `2.weight` on rank 0, nan in `3.weight` on rank 0, "
        "and 2 more"
    )
    assert len(scaler.last_overflow.entries) == 6


def test_more_offenders_than_a_rank_lists_are_counted():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = distscaler.GradScaler("cpu", init_scale=16.0, skip_log_interval=1)
    scaler.register_model(model)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4)).float().sum()
    scaler.scale(loss).backward()
    for p in model.parameters():
        p.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    report = scaler.last_overflow
    assert len(report.entries) == 8 and report.unlisted == 4
    assert report.entries[0] == OverflowEntry(0, "0.weight", "inf")  # names sorted as strings
    assert report.entries[1].param == "1.weight" and report.entries[2].param == "10.weight"


def test_the_report_survives_pickling_and_none_without_a_periodic_report():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = distscaler.GradScaler("cpu", skip_log_interval=1).register_model(model)
    _train(scaler, model, opt, [[("0.weight", math.inf)]], mode="step")
    for copied in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert copied.last_overflow == scaler.last_overflow
        assert isinstance(copied.last_overflow, OverflowReport)
    quiet = distscaler.GradScaler("cpu", skip_log_interval=0).register_model(model)
    _train(quiet, model, opt, [[("0.weight", math.inf)]], mode="step")
    assert quiet.last_overflow is None and quiet.skip_totals.num_skipped == 1


# ----------------------------------------------------------------- spawned ranks


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    cache: dict[int, list[dict]] = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            tmp = tmp_path_factory.mktemp(f"attribution{world_size}")
            cache[world_size] = spawn(S.attribution_cases, world_size, tmp)
        return cache[world_size]

    return get


_CASES = [
    (w, f"{layout}-{opt}-{'clip' if clip else 'noclip'}", opt)
    for w, cases in S.CASES.items()
    for layout, opt, clip in cases
]
_REPORT_UPDATES = {2, 4, 6}  # updates whose periodic report has a new overflow to attribute


def _clean(name: str) -> str:
    # FSDP1's own named_parameters() keeps its wrapper attribute; the report must not.
    return name.replace("_fsdp_wrapped_module.", "")


_PARAMS = [
    pytest.param(w, c, o, id=f"{w}ranks-{c}", marks=pytest.mark.xdist_group(f"attribution{w}"))
    for w, c, o in _CASES
]


def _runs(results: list[dict], case: str) -> list[dict]:
    for r in results:
        skip_if_torch_gap(r[case], r["torch_gaps"])
    return [r[case] for r in results]


@pytest.mark.parametrize("world_size, case, opt_kind", _PARAMS)
def test_report_is_exact_and_identical_on_every_rank(spawned, world_size, case, opt_kind):
    runs = _runs(spawned(world_size), case)
    expected = None
    for update in range(1, S.UPDATES + 1):
        injected = [[r, _clean(n), k] for r, n, k in runs[0]["all_injected"][update - 1]]
        if injected:
            # Guard: the faults were written on the ranks the scenario names.
            assert sorted({r for r, _, _ in injected}) == sorted(
                {r for r in range(world_size) if S.faults_at(update, r, world_size)}
            )
        if update in _REPORT_UPDATES:
            skipped = max(
                u for u in range(update - 1, update + 1) if runs[0]["all_injected"][u - 1]
            )
            expected = {
                "step": skipped,
                "scale": runs[0]["scales"][skipped - 1],
                "entries": sorted(
                    [r, _clean(n), k] for r, n, k in runs[0]["all_injected"][skipped - 1]
                ),
                "unlisted": 0,
            }
        for rank, run in enumerate(runs):
            assert run["reports"][update - 1] == expected, f"update {update}, rank {rank}"


@pytest.mark.parametrize("world_size, case, opt_kind", _PARAMS)
def test_clean_steps_cost_nothing_more_and_a_report_one_gather(spawned, world_size, case, opt_kind):
    runs = _runs(spawned(world_size), case)
    for run in runs:
        for update, comms in enumerate(run["comms"], start=1):
            gathers = 1 if update in _REPORT_UPDATES else 0
            expected = {"c10d.allreduce_": 1, **({"c10d._allgather_base_": 1} if gathers else {})}
            assert comms == expected, f"update {update}"
        if opt_kind == "fused":
            # Clean updates without a periodic report: no host read (the first update also reads
            # a device mesh's rank list once, see test_layouts); on the CPU's path, the flag, and
            # with clipping this rank's sum of squares first (its float32 norms are taken again
            # in float64 where it is not finite).
            flag = (2 if case.endswith("-clip") else 1) if "-cpuread-" in case else 0
            quiet = [run["reads"][u - 1] for u in (3, 5, 7)]
            assert quiet == [flag] * 3
            # The report of update 8 has nothing new: only its periodic read.
            assert run["reads"][7] == 1 + flag


def test_a_rebuilt_grouping_of_the_same_parameters_is_kept_without_a_scatter():
    from distscaler.attribution import TensorFlags, _KeptFlags

    params = tuple(torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    kept = _KeptFlags(params, torch.device("cpu"))
    codes = torch.tensor([1.0, -2.0, 3.0])
    rebuilt = tuple(list(params))  # a new tuple, as a rebuilt GradGrouping gives
    assert rebuilt is not params
    assert kept.dense(TensorFlags(rebuilt, codes)) is codes and kept.params is rebuilt
    # A subset (a parameter without a gradient this step) is scattered, the rest clean.
    subset = kept.dense(TensorFlags((params[2], params[0]), torch.tensor([-1.0, 5.0])))
    assert subset.tolist() == [5.0, 0.0, -1.0] and kept.scatter
    assert kept.dense(TensorFlags((torch.nn.Parameter(torch.zeros(1)),), codes[:1])) is None
