"""Lightning integration (``distscaler.integrations.lightning``) against Lightning 2.6.

Two kinds of runs:

* In this process, one CPU device: what stock Lightning refuses or changes (``ModelParallelStrategy``
  with ``"16-mixed"``, fused AdamW with ``gradient_clip_val``, CPU ``"16-mixed"`` becoming bf16, in
  the Trainer and in Fabric) next to the plugin doing it; clipping against torch's; the plugin's
  argument checks; DeepSpeed configs; a stock checkpoint resumed by the plugin; Fabric.
* One spawn of 2 gloo ranks (tests/_lightning_scenarios.py) running ``Trainer.fit`` with DDP (stock
  and ours, then a resume), ``ModelParallelStrategy`` as FSDP2 (and a resume from its distributed
  checkpoint) and as tensor parallel, fp16, fused AdamW, ``gradient_clip_val=1.0``, an inf on the
  last rank at one step.
"""

from __future__ import annotations

import functools
import json
import math
import pickle

import _lightning_scenarios as S
import pytest
import torch
from _common import mlp
from _harness import spawn
from _torch_gaps import guarded
from torch.utils.data import DataLoader, TensorDataset

from common.distributed import destroy_process_group

pl = pytest.importorskip("lightning.pytorch")  # a test extra; CI installs it

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins import MixedPrecision as FabricMixedPrecision  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from distscaler import GradScaler, ScalerConfig  # noqa: E402
from distscaler.integrations.lightning import PRECISIONS, DistScalerPrecision  # noqa: E402

STEPS = 4


class _Tiny(pl.LightningModule):
    def __init__(self, fused: bool, inject: int | None = None) -> None:
        super().__init__()
        self.net = mlp(0)
        self.fused = fused
        self.inject = inject
        self.batch = -1
        self.dtypes: list[torch.dtype] = []
        self.net[0].register_forward_hook(lambda m, i, o: self.dtypes.append(o.dtype))

    def training_step(self, batch, batch_idx):
        self.batch = batch_idx
        self.input_dtypes = [*getattr(self, "input_dtypes", []), batch[0].dtype]
        return self.net(batch[0]).float().pow(2).mean() * S.LOSS_FACTOR

    def on_after_backward(self):
        if self.batch == self.inject:
            self.net[0].weight.grad.view(-1)[0] = math.inf

    def configure_optimizers(self):
        fused = self.fused
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=fused, foreach=not fused)


def _trainer(plugin=None, **kwargs) -> pl.Trainer:
    kwargs.setdefault("max_steps", STEPS)
    return pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        plugins=[plugin] if plugin is not None else None, **kwargs,
    )  # fmt: skip


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(3))))


def _ours(**scaler_kwargs) -> DistScalerPrecision:
    return DistScalerPrecision(
        "16-mixed", "cpu", GradScaler("cpu", init_scale=1024.0, **scaler_kwargs)
    )


# ----------------------------------------------------------------------- stock Lightning refuses


def test_model_parallel_strategy_refuses_16_mixed_but_takes_the_plugin():
    with pytest.raises(ValueError, match="ModelParallelStrategy.*does not support.*'16-mixed'"):
        pl.Trainer(accelerator="cpu", strategy=ModelParallelStrategy(), precision="16-mixed")
    plugin = DistScalerPrecision("16-mixed", "cpu")
    trainer = pl.Trainer(accelerator="cpu", strategy=ModelParallelStrategy(), plugins=[plugin])
    assert trainer.precision_plugin is plugin and trainer.precision == "16-mixed"


def test_cpu_16_mixed_becomes_bf16_in_stock_lightning_and_is_fp16_with_the_plugin():
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead"):
        stock = _trainer(precision="16-mixed")
    assert stock.precision == "bf16-mixed"
    model = _Tiny(fused=True)
    stock.fit(model, _data())
    assert set(model.dtypes) == {torch.bfloat16}

    model = _Tiny(fused=True)
    ours = _trainer(_ours())
    ours.fit(model, _data())
    assert set(model.dtypes) == {torch.float16}  # fp16 autocast on the CPU
    assert ours.precision_plugin.scaler.skip_totals.num_updates == STEPS  # the scaler ran


def test_fused_adamw_with_gradient_clip_val_raises_in_stock_lightning_and_clips_with_the_plugin():
    stock = _trainer(MixedPrecision("16-mixed", "cpu"), gradient_clip_val=1.0)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        stock.fit(_Tiny(fused=True), _data())

    # Reference: stock Lightning where it works (foreach AdamW: unscale_ + torch's clip_grad_norm_).
    ref_model = _Tiny(fused=False)
    ref = _trainer(MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", 1024.0)),
                   gradient_clip_val=1.0)  # fmt: skip
    ref.fit(ref_model, _data())
    for fused in (True, False):
        model = _Tiny(fused=fused)
        plugin = _ours()
        calls = []
        clip = plugin.scaler.clip_grad_norm_

        def spy(*a, _clip=clip, _calls=calls, **k):  # test-only spy: what clipping called
            _calls.append(a[1])
            return _clip(*a, **k)

        plugin.scaler.clip_grad_norm_ = spy
        _trainer(plugin, gradient_clip_val=1.0).fit(model, _data())
        assert calls == [1.0] * STEPS  # gradient_clip_val went to the scaler, every step
        norm = plugin.grad_norm(model.trainer.optimizers[0])
        assert norm is not None and float(norm) > 1.0  # clipping really scaled
        # The same clipped updates as torch's (fp32 rounding apart: a fused kernel gets
        # grad_scale = scale / clip_coef instead of clipped gradients).
        for p, r in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_fabric_cpu_fp16_and_clipping_with_a_fused_optimizer():
    stock = Fabric(accelerator="cpu", devices=1, precision="16-mixed")
    assert stock._precision.precision == "bf16-mixed"  # Fabric's CPU fallback, as the Trainer's

    plugin = _ours()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = mlp(0)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), fused=True))
    skipped, scales = [], []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        out = model(x)
        assert out.dtype == torch.float32  # fp16 inside autocast, fp32 out (convert_output)
        fabric.backward(out.pow(2).mean())
        if step == 1:
            next(model.parameters()).grad.view(-1)[0] = math.inf
        # Stock Fabric raises NotImplementedError here for a fused optimizer.
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(plugin.step_was_skipped(optimizer))
        scales.append(plugin.scaler.get_scale())
    assert skipped == [False, True, False]
    assert scales == [1024.0, 512.0, 512.0]
    with fabric.autocast():
        assert (
            torch.nn.functional.linear(torch.randn(2, 8), torch.randn(3, 8)).dtype == torch.float16
        )


def test_fabric_casts_floating_inputs_to_fp16_as_its_mixed_precision_and_the_trainer_does_not():
    seen = {}
    for kind in ("stock", "ours"):
        if kind == "stock":  # Fabric's own fp16 plugin, with a scaler built for the CPU
            plugin = FabricMixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        else:
            plugin = _ours()
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = fabric.setup(mlp(0))
        inputs: list = []
        model.module[0].register_forward_pre_hook(
            lambda m, args, inputs=inputs: inputs.append(args[0].dtype)
        )
        out = model(torch.randn(2, 8))
        ints = plugin.convert_input((torch.arange(3), torch.ones(2, dtype=torch.bool)))
        seen[kind] = (inputs[0], out.dtype, ints[0].dtype, ints[1].dtype)
    assert seen["stock"] == (torch.float16, torch.float32, torch.int64, torch.bool)
    assert seen["ours"] == seen["stock"]

    # The Trainer's MixedPrecision leaves the batch as it is (autocast casts inside): so does ours.
    batches = {}
    for kind in ("stock", "ours"):
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        model = _Tiny(fused=False)
        _trainer(plugin if kind == "stock" else _ours(), max_steps=2).fit(model, _data())
        batches[kind] = set(model.input_dtypes)
    assert batches["stock"] == {torch.float32}
    assert batches["ours"] == batches["stock"]


def test_the_plugin_pickles_as_lightnings_and_a_copy_starts_clean():
    stock = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    assert type(pickle.loads(pickle.dumps(stock))) is MixedPrecision
    # Ours, after a Fabric run that filled its per-run records (weak references).
    plugin = _ours(growth_interval=7)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = mlp(0)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), fused=True))
    fabric.backward(model(torch.randn(4, 8)).pow(2).mean())
    next(model.parameters()).grad.view(-1)[0] = math.inf
    optimizer.step()
    assert plugin.step_was_skipped(optimizer) and len(plugin._found_inf) == 1
    copy = pickle.loads(pickle.dumps(plugin))
    assert type(copy) is DistScalerPrecision and copy is not plugin
    assert (copy.precision, copy.device, copy.log_metrics) == ("16-mixed", "cpu", True)
    assert copy.scaler.state_dict() == plugin.scaler.state_dict()  # scale 512, skip counts
    assert copy.scaler.get_scale() == 512.0 and copy.scaler.get_growth_interval() == 7
    assert len(copy._found_inf) == 0 and copy._registered is None and copy._guarded == []
    assert copy.convert_input(torch.ones(1)).dtype == torch.float16  # not a Trainer's yet


class _SpawnTiny(pl.LightningModule):
    """Picklable (no hooks), for ``ddp_spawn``: an inf on rank 1 only, at batch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(0)

    def training_step(self, batch, batch_idx):
        self.batch = batch_idx
        return self.net(batch[0]).float().pow(2).mean()

    def on_after_backward(self):
        if self.batch == 1 and self.global_rank == 1:
            self.net[0].weight.grad.view(-1)[0] = math.inf

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    def teardown(self, stage):
        # ddp_spawn's children never destroy their gloo group (Lightning does at exit for NCCL
        # only), and one left to interpreter exit can abort a finished run ("terminate called
        # without an active exception", seen once on CI). The strategy has unwrapped DDP by now
        # (its teardown runs before this hook): free it and destroy the group, in order.
        destroy_process_group()


@pytest.mark.xdist_group("lightning_spawn")
def test_ddp_spawn_fits_on_two_cpu_ranks_with_an_inf_on_one(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)  # Lightning picks a free port
    plugin = _ours()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=[plugin], max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    model = _SpawnTiny()
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, _data())  # stock launch: pickles the trainer, plugin included
    assert trainer.state.finished
    # Rank 0's metrics, sent back by Lightning's launcher: rank 0 skipped the step of rank 1's
    # inf (the only skip), and its scale backed off once.
    metrics = trainer.callback_metrics
    assert float(metrics["distscaler/skipped_epoch"]) == 1.0
    assert float(metrics["distscaler/scale"]) == 512.0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # trained
    assert plugin.scaler.get_scale() == 1024.0  # this process's plugin: the launch copied it


# ----------------------------------------------------------------------- one process, the plugin


def test_scheduler_does_not_step_on_a_skipped_step_and_teardown_restores_its_class():
    class WithScheduler(_Tiny):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            self.sched = sched
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_batch_end(self, *args):
            self.epochs = [*getattr(self, "epochs", []), self.sched.last_epoch]
            self.classes = [*getattr(self, "classes", []), type(self.sched)]

    model = WithScheduler(fused=True, inject=1)
    _trainer(_ours(), gradient_clip_val=1.0).fit(model, _data())
    assert model.epochs == [1, 1, 2, 3]  # no step after the skipped step 1
    assert model.trainer.precision_plugin.scaler.skip_totals.num_skipped == 1
    assert type(model.sched) is torch.optim.lr_scheduler.StepLR  # given back after fit
    assert model.classes[0] is not torch.optim.lr_scheduler.StepLR  # guarded during fit
    assert isinstance(model.sched, torch.optim.lr_scheduler.StepLR)


def test_a_stock_mixed_precision_checkpoint_resumes_with_its_scale(tmp_path):
    stock = _trainer(MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", 1024.0)),
                     max_steps=2)  # fmt: skip
    model = _Tiny(fused=False, inject=0)
    stock.fit(model, _data())
    stock.save_checkpoint(tmp_path / "stock.ckpt")
    saved = stock.precision_plugin.scaler.state_dict()
    assert saved["scale"] == 512.0  # backed off once: not the default

    class Probe(_Tiny):
        def on_train_start(self):
            self.start = self.trainer.precision_plugin.scaler.state_dict()

    resumed = Probe(fused=False)  # the optimizer state restores the stock run's foreach flags
    plugin = DistScalerPrecision("16-mixed", "cpu")
    _trainer(plugin, max_steps=3).fit(resumed, _data(), ckpt_path=tmp_path / "stock.ckpt")
    assert {k: resumed.start[k] for k in saved} == saved


def test_arguments_are_checked_before_anything_is_set():
    with pytest.raises(ValueError, match=r"precision must be one of \('16-mixed',\).*'bf16-mixed'"):
        DistScalerPrecision("bf16-mixed", "cpu")
    assert PRECISIONS == ("16-mixed",)
    with pytest.raises(TypeError, match="device must be a device type string.*got: 0"):
        DistScalerPrecision("16-mixed", 0)
    with pytest.raises(ValueError, match="device must be a device type with autocast.*'nope'"):
        DistScalerPrecision("16-mixed", "nope")
    with pytest.raises(TypeError, match="scaler must be None, a distscaler.GradScaler.*torch.amp"):
        DistScalerPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="scaler's device type must be the plugin's device"):
        DistScalerPrecision("16-mixed", "cpu", GradScaler("cuda", enabled=False))
    with pytest.raises(TypeError, match="log_metrics must be a bool"):
        DistScalerPrecision("16-mixed", "cpu", log_metrics="yes")
    # A plugin for another device than the Trainer's: refused at setup, before the first step.
    plugin = DistScalerPrecision("16-mixed", "cpu")
    plugin.device = "cuda"
    model = _Tiny(fused=True)
    with pytest.raises(ValueError, match=r"device='cuda'\) must match the Trainer's device type"):
        _trainer(plugin).fit(model, _data())
    assert plugin.scaler.skip_totals.num_updates == 0


@pytest.mark.parametrize("given", ["config", "dict", "section", "json_path"])
def test_deepspeed_fp16_config_in_the_constructor(given, tmp_path):
    ds_config = {"fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 2}}
    arg = {
        "config": ScalerConfig.from_deepspeed(ds_config),
        "dict": ds_config,
        "section": ds_config["fp16"],
        "json_path": str(tmp_path / "ds.json"),
    }[given]
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    plugin = DistScalerPrecision("16-mixed", "cpu", arg)
    assert plugin.scaler.get_scale() == 1024.0
    assert plugin.scaler.config.policy == "deepspeed" and plugin.scaler.config.hysteresis == 2
    model = _Tiny(fused=True, inject=1)
    _trainer(plugin, max_steps=3).fit(model, _data())
    # DeepSpeed's hysteresis absorbs the first overflow (no backoff), yet the step is skipped.
    assert plugin.scaler.get_scale() == 1024.0
    assert plugin.scaler.skip_totals.num_skipped == 1


def test_importing_without_lightning_names_the_install_command(monkeypatch):
    import importlib
    import sys

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "distscaler.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'distscaler\[lightning\]'"):
        importlib.import_module("distscaler.integrations.lightning")
    monkeypatch.undo()
    assert importlib.import_module("distscaler.integrations.lightning").DistScalerPrecision


# ----------------------------------------------------------------------- two gloo ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning2")
    return guarded(spawn(functools.partial(S.everything, tmp=str(tmp)), 2, tmp))


def _both(results, scenario, run):
    return [r[scenario][run] for r in results]


@pytest.mark.xdist_group("lightning2")
def test_ddp_stock_diverges_on_an_inf_on_one_rank(two_ranks):
    stock = _both(two_ranks, "ddp", "stock")
    step = S.INJECT_STEP
    assert [r["strategy"] for r in stock] == ["DDPStrategy"] * 2
    assert [r["seen"][step] for r in stock] == [False, True]  # only the last rank saw the inf
    # torch's scaler: rank 1 skipped and backed off, rank 0 stepped; the replicas differ since.
    assert [r["scale"][step] for r in stock] == [S.INIT_SCALE, S.INIT_SCALE / 2]
    assert stock[0]["digest"][step] != stock[0]["digest"][step - 1]
    assert stock[1]["digest"][step] == stock[1]["digest"][step - 1]
    assert stock[0]["digest"][-1] != stock[1]["digest"][-1]
    # And Lightning stepped the scheduler on the skipped step.
    assert [r["last_epoch"][-1] for r in stock] == [S.NUM_STEPS] * 2


@pytest.mark.xdist_group("lightning2")
@pytest.mark.parametrize("scenario", ["ddp", "fsdp2", "tp"])
def test_an_inf_on_one_rank_is_a_skip_on_every_rank(two_ranks, scenario):
    ours = _both(two_ranks, scenario, "ours")
    step, n = S.INJECT_STEP, S.NUM_STEPS
    expected_strategy = "DDPStrategy" if scenario == "ddp" else "ModelParallelStrategy"
    assert [r["strategy"] for r in ours] == [expected_strategy] * 2
    assert [r["grad_type"] for r in ours] == ["Parameter" if scenario == "ddp" else "DTensor"] * 2
    assert [r["precision_flag"] for r in ours] == ["16-mixed"] * 2
    # Guard: only the last rank's gradients held the inf.
    assert [r["seen"][step] for r in ours] == [False, True]
    skipped = [i == step for i in range(n)]
    for r in ours:
        assert r["skipped"] == skipped
        assert r["skip_totals"] == [n, 1, step + 1]  # the scaler counted it (1-based step)
        assert r["scale"][step] == S.INIT_SCALE / 2
        assert r["digest"][step] == r["digest"][step - 1]  # not stepped
        assert len(set(r["digest"])) == n - 1  # every other step changed the parameters
        # The step scheduler did not step on the skipped step.
        assert r["last_epoch"] == [i + 1 - (i >= step) for i in range(n)]
        # The norm is the one torch computes on the gathered, unscaled gradients.
        for i, (norm, ref) in enumerate(zip(r["norm"], r["ref_norm"])):
            if i == step:
                assert norm == math.inf
            else:
                assert norm > S.MAX_NORM  # clipping really scaled
                assert norm == pytest.approx(ref, rel=1e-5)
    assert ours[0]["digest"] == ours[1]["digest"]  # identical replicas at every step
    assert ours[0]["scale"] == ours[1]["scale"]


@pytest.mark.xdist_group("lightning2")
@pytest.mark.parametrize("scenario", ["ddp", "fsdp2", "tp"])
def test_skips_scale_and_norm_are_logged_through_lightning(two_ranks, scenario):
    for r in _both(two_ranks, scenario, "ours"):
        steps, epoch = r["metrics"][:-1], r["metrics"][-1]
        assert [m["distscaler/skipped_step"] for m in steps] == [float(x) for x in r["skipped"]]
        assert [m["distscaler/scale"] for m in steps] == r["scale"]
        assert [m["distscaler/grad_norm"] for m in steps] == r["norm"]
        assert epoch == {"distscaler/skipped_epoch": 1.0}


@pytest.mark.xdist_group("lightning2")
@pytest.mark.parametrize("scenario", ["ddp", "fsdp2"])
def test_a_checkpoint_resume_continues_with_the_same_scale(two_ranks, scenario):
    for first, resumed in zip(
        _both(two_ranks, scenario, "ours"), _both(two_ranks, scenario, "resumed")
    ):
        saved = first["final_state"]
        assert saved["scale"] == S.INIT_SCALE / 2 and saved["num_skipped_steps"] == 1  # non-trivial
        if scenario == "ddp":
            assert first["checkpoint_state"] == saved  # under the plugin's key in the file
        assert resumed["start_state"] == saved  # restored before the first resumed step
        # It continues the trajectory: the tracker reaches the growth interval and the scale grows.
        assert saved["_growth_tracker"] == S.GROWTH_INTERVAL - 1
        assert resumed["scale"] == [S.INIT_SCALE] * S.RESUME_STEPS
        assert resumed["skip_totals"][:2] == [S.NUM_STEPS + S.RESUME_STEPS, 1]
        assert resumed["last_epoch"] == [S.NUM_STEPS, S.NUM_STEPS + 1]  # scheduler restored too
