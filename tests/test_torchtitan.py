"""torchtitan integration (``distscaler.integrations.torchtitan``) against stock torchtitan 0.3.0.

In this process: the gradients a ``ChunkedLossWrapper`` leaves (stock: the scale never reaches
them; ours: it does), :func:`scaled_for_backward`, the config (``fp16``, the command line through
torchtitan's own ``ConfigManager``) and the trainer's argument checks.

One spawn of 2 gloo ranks (tests/_torchtitan_scenarios.py: the tiny llama3, the data, what "stock"
is; launch/common/torchtitan_cpu.py: the CPU shims, each with why): FSDP2 over both ranks
(references in fp32 and bf16, stock fp16, ours with fused and foreach AdamW, chunked and plain
cross-entropy), FSDP2 x TP (tp=2), pipeline parallel (pp=2), a checkpoint and its resume; an inf in
``norm.weight``'s gradient on the last rank at step 2.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan extra (Python >= 3.11)")

import _torchtitan_scenarios as S  # noqa: E402
from _common import REPO, torchrun_summary  # noqa: E402
from _harness import spawn  # noqa: E402

from common.torchtitan_cpu import apply_cpu_shims  # noqa: E402
from distscaler import GradScaler, ScalerConfig  # noqa: E402


@pytest.fixture(scope="module")
def T():
    """The integration module, imported by the first test that needs it rather than at collection
    (torchtitan's trainer takes seconds to import, in every xdist worker). The shims first:
    torchtitan 0.3.0 imports triton and takes "cuda" as its device type on a machine without GPUs
    (launch/common/torchtitan_cpu.py); the in-process tests run on the CPU on GPU machines too."""
    apply_cpu_shims(cpu=True)
    from distscaler.integrations import torchtitan

    return torchtitan


def _torchtitan() -> tuple:
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return ChunkedLossWrapper, CrossEntropyLoss, ConfigManager, llama3_debugmodel


SKIPS = [False, True, False, False]  # an inf at step 2 of 4
assert S.INJECT_STEP == 2 and S.STEPS == 4


# ----------------------------------------------------------------------- one process


def _chunked_grads(T, mode: str) -> tuple[float, torch.Tensor, torch.Tensor]:
    """A chunked loss over a tiny "decoder" and lm_head: loss, lm_head and decoder gradients."""
    ChunkedLossWrapper, CrossEntropyLoss, _, _ = _torchtitan()
    torch.manual_seed(0)
    head, body = torch.nn.Linear(16, 32), torch.nn.Linear(8, 16)
    x, y = torch.randn(2, 8, 8), torch.randint(0, 32, (2, 8))
    loss_fn = ChunkedLossWrapper(
        ChunkedLossWrapper.Config(num_chunks=4, loss_fn=CrossEntropyLoss.Config())
    )
    loss_fn.set_lm_head(head)
    scaler = GradScaler("cpu", init_scale=1024.0)
    if mode == "ours":
        assert T.scale_loss_fn(loss_fn, scaler) is loss_fn
    loss, _ = loss_fn(body(x), y, torch.tensor(16))
    (scaler.scale(loss) if mode == "stock-recipe" else loss).backward()
    return loss.item(), head.weight.grad.clone(), body.weight.grad.clone()


def test_chunked_loss_ignores_a_scaled_result_and_ours_scales_inside(T):
    loss, head, body = _chunked_grads(T, "reference")
    # torch's recipe, scaler.scale(loss).backward(): the output layer's backward already ran
    # inside the loss call, and the decoder's ignores the incoming gradient: nothing is scaled,
    # and unscaling would divide the gradients by 1024.
    naive = _chunked_grads(T, "stock-recipe")
    assert torch.equal(naive[1], head) and torch.equal(naive[2], body)
    ours = _chunked_grads(T, "ours")
    assert ours[0] == loss  # the value is the loss, bit for bit
    assert torch.allclose(ours[1], head * 1024, rtol=1e-6) and torch.allclose(
        ours[2], body * 1024, rtol=1e-6
    )


def test_scaled_for_backward_keeps_the_value_and_scales_the_gradient(T):
    scaler = GradScaler("cpu", init_scale=8.0)
    w = torch.tensor([2.0, math.inf], requires_grad=True)
    out = T.scaled_for_backward((w * 3).sum(), scaler)
    assert math.isinf(out.item())  # inf stays inf (x + (s - s) would make it NaN)
    x = torch.tensor(3.0, requires_grad=True)
    y = T.scaled_for_backward(x * x, scaler)
    assert y.item() == 9.0
    y.backward()
    assert x.grad.item() == 6.0 * 8.0
    assert T.scaled_for_backward(x * x, GradScaler("cpu", enabled=False)).grad_fn.name() == (
        "MulBackward0"
    )
    with torch.no_grad():
        z = x * x
    assert T.scaled_for_backward(z, scaler) is z


def test_scale_loss_fn_keeps_the_object_and_its_class(T):
    _, CrossEntropyLoss, _, _ = _torchtitan()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    first, second = GradScaler("cpu"), GradScaler("cpu", init_scale=4.0)
    T.scale_loss_fn(loss_fn, first)
    cls = type(loss_fn)
    assert isinstance(loss_fn, CrossEntropyLoss) and cls.__name__ == "ScaledCrossEntropyLoss"
    T.scale_loss_fn(loss_fn, second)  # a second call swaps the scaler, not the class again
    assert type(loss_fn) is cls and loss_fn._distscaler_scaler is second
    with pytest.raises(TypeError, match="loss_fn must be a torchtitan loss object, got: int"):
        T.scale_loss_fn(3, first)


def test_fp16_config_keeps_every_field_and_sets_float16(T):
    *_, llama3_debugmodel = _torchtitan()
    base = llama3_debugmodel()
    base.training.steps = 7
    config = T.fp16(base, ScalerConfig(init_scale=1024.0))
    assert type(config) is T.DistScalerTrainer.Config
    assert config.training.mixed_precision_param == "float16" and config.training.steps == 7
    assert config.model_spec is base.model_spec and config.loss is base.loss
    assert config.grad_scaler == ScalerConfig(init_scale=1024.0)
    assert T.fp16(config).grad_scaler == config.grad_scaler  # an fp16 config keeps its section
    with pytest.raises(TypeError, match="config must be a torchtitan Trainer.Config, got: dict"):
        T.fp16({})
    with pytest.raises(TypeError, match="scaler must be a ScalerConfig or None, got: dict"):
        T.fp16(base, {"init_scale": 2.0})  # type: ignore[arg-type]


def test_command_line_takes_any_model_config_and_every_scaler_field(T):
    _, _, ConfigManager, _ = _torchtitan()
    args = [
        "--module",
        "distscaler.integrations.torchtitan",
        "--config",
        "llama3.llama3_debugmodel",
    ]
    config = ConfigManager().parse_args(
        [*args, "--grad_scaler.init_scale", "1024", "--grad_scaler.policy", "deepspeed",
         "--grad_scaler.hysteresis", "2", "--grad_scaler.min_scale", "1", "--training.steps", "3"]
    )  # fmt: skip
    assert type(config) is T.DistScalerTrainer.Config
    assert config.grad_scaler == ScalerConfig(
        init_scale=1024.0, policy="deepspeed", hysteresis=2, min_scale=1.0
    )
    assert config.training.mixed_precision_param == "float16" and config.training.steps == 3
    bf16 = ConfigManager().parse_args([*args, "--training.mixed_precision_param", "bfloat16"])
    assert bf16.training.mixed_precision_param == "bfloat16"
    with pytest.raises(SystemExit):  # ScalerConfig's check, reported by the command line
        ConfigManager().parse_args([*args, "--grad_scaler.init_scale", "-1"])
    with pytest.raises(ValueError, match="'llama3.nope' not found"):
        ConfigManager().parse_args([*args[:3], "llama3.nope"])


def test_trainer_checks_its_arguments_before_building_anything(T):
    from torchtitan.trainer import Trainer

    *_, llama3_debugmodel = _torchtitan()
    config = T.fp16(llama3_debugmodel())
    with pytest.raises(
        TypeError,
        match=r"config must be a DistScalerTrainer.Config \(fp16\(config\) makes one\), got: Trainer.Config",
    ):
        T.DistScalerTrainer(llama3_debugmodel())
    config.training.max_norm = 0.0
    with pytest.raises(ValueError, match=r"training.max_norm must be > 0 .*got: 0.0"):
        T.DistScalerTrainer(config)
    config.training.max_norm = 1.0
    with pytest.raises(ValueError, match="scaler's device type must be torchtitan's device type"):
        T.DistScalerTrainer(config, scaler=GradScaler("cuda", enabled=False))
    with pytest.raises(TypeError, match="scaler must be None, a distscaler.GradScaler"):
        T.DistScalerTrainer(config, scaler=3)
    assert issubclass(T.DistScalerTrainer, Trainer)


# ----------------------------------------------------------------------- 2 gloo ranks


# Every test of the spawn on one xdist worker, so that the module fixture spawns once.
TWO_RANKS = pytest.mark.xdist_group("torchtitan2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchtitan")
    return spawn(functools.partial(S.everything, tmp=str(tmp / "work")), 2, tmp)


def _metric(run, key):
    return [m[key] for m in run["metrics"]]


def _records(run, key):
    return [r[key] for r in run["records"]]


@TWO_RANKS
@pytest.mark.parametrize("name", ["ours", "ours-foreach", "ours-ce", "ours-tp", "ours-pp"])
def test_inf_on_one_rank_is_skipped_on_every_rank_and_named_in_the_report(runs, name):
    # Guard: the inf was written on the last rank only, at step 2.
    assert runs[0][name]["injected"] == [] and runs[1][name]["injected"] == [S.INJECT_STEP]
    for run in (r[name] for r in runs):
        assert run["error"] is None
        assert _records(run, "skipped") == SKIPS
        assert _records(run, "scale") == [65536.0, 32768.0, 32768.0, 32768.0]
        params = _records(run, "params")
        assert params[1] == params[0] and params[2] != params[1]  # step 2 changed nothing
        norms = _metric(run, "grad_norm")
        assert not math.isfinite(norms[1]) and all(math.isfinite(n) for n in norms[::2])
        assert _metric(run, "distscaler/skipped") == [0, 1, 0, 0]
        assert [m.get("distscaler/overflow_step") for m in run["metrics"]] == [None, 2, 2, 2]
        report = run["report"]
        assert report["step"] == 2 and report["entries"] == [[1, S.INJECT_PARAM, "inf"]]
    # Same model everywhere, except the pipeline's stages, which hold different layers.
    for key in ("skipped", "scale") if name == "ours-pp" else ("skipped", "scale", "params"):
        assert _records(runs[0][name], key) == _records(runs[1][name], key), key
    assert runs[0][name]["report"] == runs[1][name]["report"]
    # The fused path wherever every optimizer takes grad_scale (AdamW, fused: torchtitan's default).
    assert runs[0][name]["fused_step"] is (name != "ours-foreach")


@TWO_RANKS
@pytest.mark.parametrize(
    ("name", "ours"), [("stock", "ours"), ("stock-tp", "ours-tp"), ("ours-disabled", "ours")]
)
def test_stock_fp16_turns_the_inf_into_nan_weights_and_stops(runs, name, ours):
    # ours-disabled: ScalerConfig(enabled=False) is stock torchtitan, stop included.
    for run in runs:
        stock = run[name]
        # The same first step as ours, the inf then goes through clipping into the weights and
        # the next loss is NaN: torchtitan stops the job.
        assert (
            stock["error"]
            == "Loss is not finite (global_avg_loss=nan) at step 3. Stopping training."
        )
        assert len(stock["metrics"]) == 2 and not math.isfinite(_metric(stock, "grad_norm")[1])
        assert _metric(stock, "loss_metrics/global_avg_loss")[0] == pytest.approx(
            _metric(run[ours], "loss_metrics/global_avg_loss")[0], rel=1e-6
        )
    if name == "stock-tp":  # replicated norm weights: the ranks no longer hold the same model
        assert _records(runs[0][name], "params")[1] != _records(runs[1][name], "params")[1]


@TWO_RANKS
def test_fp16_trains_like_bf16_and_fp32_with_the_same_seed(runs):
    for run in runs:
        assert run["ours-clean"]["compute_dtypes"] == ["torch.float16"]
        assert run["bf16"]["compute_dtypes"] == ["torch.bfloat16"]
        assert run["fp32"]["compute_dtypes"] == ["torch.float32"]
        ours, bf16, fp32 = (
            _metric(run[k], "loss_metrics/global_avg_loss") for k in ("ours-clean", "bf16", "fp32")
        )
        assert ours[-1] < ours[0] - 0.1  # it learns
        assert ours == pytest.approx(bf16, abs=5e-3) and ours == pytest.approx(fp32, abs=1e-3)
        assert _records(run["ours-clean"], "skipped") == [False] * 4


@TWO_RANKS
@pytest.mark.parametrize(("name", "reference"), [
    ("ours", "fp32"), ("ours-ce", "fp32"), ("ours-tp", "stock-tp"),
])  # fmt: skip
def test_the_scale_reaches_the_gradients(runs, name, reference):
    for run in runs:
        # The global norm of the gradients right after the first backward, before clipping.
        raw, ref = run[name]["raw_grad_norms"][0], run[reference]["raw_grad_norms"][0]
        assert raw == pytest.approx(65536 * ref, rel=2e-3)
        # Stock fp16: no scale at all.
        stock = run["stock"]["raw_grad_norms"][0]
        assert stock == pytest.approx(run["fp32"]["raw_grad_norms"][0], rel=2e-3)
        # What torchtitan logs is the unscaled norm.
        assert _metric(run[name], "grad_norm")[0] == pytest.approx(ref, rel=2e-3)


@TWO_RANKS
def test_checkpoint_carries_the_scaler_and_a_resume_continues_with_the_same_scale(runs):
    for run in runs:
        full, resumed = run["ours-full"], run["ours-resumed"]
        # Guard: at the step-2 checkpoint one step was skipped and the scale had moved.
        assert _records(full, "scale") == [2048.0, 1024.0, 2048.0, 4096.0]
        assert _records(full, "skipped") == SKIPS
        first = resumed["first_state"]  # right after torchtitan's checkpointer loaded step 2
        assert first["scale"] == 1024.0 and first["num_skipped_steps"] == 1
        assert first["num_updates"] == 2
        assert resumed["records"] == full["records"][2:]  # scale, skips and parameters
        assert resumed["scaler_state"] == full["scaler_state"]
        assert _metric(resumed, "distscaler/skipped") == [0, 0]
        assert _metric(resumed, "distscaler/skipped_total") == [1, 1]


@TWO_RANKS
def test_torchtitans_metrics_logger_gets_the_scaler_metrics(runs):
    for run in runs:
        metrics = run["ours"]["metrics"]
        assert [m["distscaler/scale"] for m in metrics] == _records(run["ours"], "scale")
        assert _metric(run["ours"], "distscaler/skipped_total") == [0, 1, 1, 1]
        assert "distscaler/overflow_step" not in metrics[0]
        assert metrics[1]["distscaler/overflow_tensors"] == 1
        assert "loss_metrics/global_avg_loss" in metrics[0]  # torchtitan's own, next to ours


# ----------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_train_torchtitan_runs_with_torchrun_on_two_cpu_processes(tmp_path):
    """launch/train_torchtitan.py through torchtitan's command line: an inf at step 3 is skipped on
    both ranks, and torchtitan's checkpoint holds the scaler (resumes: the spawn's tests)."""
    out = tmp_path / "run"

    def run(*extra: str) -> dict:
        return torchrun_summary(
            "train_torchtitan.py",
            *("--dataloader.dataset_path", str(REPO / "launch" / "train.py")),
            *("--training.local_batch_size", "2", "--checkpoint.enable", *extra),
            out=out,
        )

    summary = run("--inject-inf", "3", "--training.steps", "4", "--grad_scaler.init_scale", "1024")
    assert summary["ranks_consistent"] and summary["steps"] == 4 and summary["fused_step"]
    assert summary["skipped_steps"] == [3] and summary["scale"] == 512.0
    assert len(summary["losses"]) == 4 and all(math.isfinite(x) for x in summary["losses"])
    assert (out / "checkpoint" / "step-4").is_dir()  # the last step's, with train_state
