"""Transformers Trainer / TRL scenarios run inside spawned gloo ranks (tests/test_transformers.py
checks the results). Nothing here asserts: every rank runs the same collectives whatever it sees.

Each run builds a ``Trainer`` (or TRL ``SFTTrainer``) around a tiny GPT-2 built from a config, fp16,
``use_cpu=True`` (MULTI_CPU: DDP on gloo), and either

* "stock": Accelerate's fp16 as it is on GPUs (Accelerate creates no scaler on the CPU, so the run
  puts a ``torch.amp.GradScaler`` in ``trainer.accelerator.scaler`` and switches ``native_amp`` on
  before ``train()``, which is what ``Accelerator(mixed_precision="fp16")`` does on a GPU, for
  DDP and for FSDP2 alike: ``get_grad_scaler`` / ``get_fsdp2_grad_scaler``), or
* "ours": ``distscaler.integrations.transformers.install(trainer)``.

An inf is written into one gradient on the last rank only, after the backward of the last
micro-batch of optimizer step ``INJECT_STEP`` (after DDP's all-reduce, so only that rank sees it).

FSDP2 on the CPU: ``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2, ...})``
gives Accelerate an FSDP plugin, but Accelerate only enables FSDP on accelerator devices: on the CPU
the state stays MULTI_CPU and its ``fsdp_plugin`` None, so the Trainer would run DDP. The FSDP2 run
therefore sets, after building the Trainer and before ``train()``, ``distributed_type = FSDP`` on
Accelerate's shared state and ``fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)``
(the plugin the Trainer built its Accelerator with) and ``trainer.is_fsdp_enabled = True`` (what the
Trainer derives from it in ``create_accelerator_and_postprocess``). From there the Trainer's and
Accelerate's real FSDP2 code runs (``fully_shard`` per ``GPT2Block`` in ``prepare``, DTensor
gradients, Trainer's FSDP checkpoint code is not exercised).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import set_rank_env
from _torch_gaps import GAPS, run_case, torch_gaps

from common.tensors import local_tensor, params_digest

NUM_STEPS = 4
INJECT_STEP = 1  # optimizer step (0-based) whose gradients get an inf on the last rank
VOCAB = 64
SEQ = 16


def _model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _lm_data(n: int = 64) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(2, VOCAB, (SEQ,), generator=gen) for _ in range(n)]
    return [{"input_ids": r, "labels": r} for r in rows]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a collective for DTensors


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _classes() -> tuple[type, type, type]:
    from transformers import Trainer, TrainerCallback

    class Recorder(TrainerCallback):  # type: ignore[misc]
        """Per optimizer step: the Trainer's skip flag, scale, scheduler position, parameters."""

        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer
            self.steps: list[dict[str, Any]] = []
            self.first_state: dict[str, Any] | None = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.first_state is None and self.trainer.accelerator.scaler is not None:
                self.first_state = dict(self.trainer.accelerator.scaler.state_dict())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            t = self.trainer
            sched = getattr(t.lr_scheduler, "scheduler", t.lr_scheduler)
            self.steps.append({
                "skipped": bool(t.accelerator.optimizer_step_was_skipped),
                "scale": t.accelerator.scaler.get_scale(),
                "sched": sched.last_epoch,
                "params": params_digest(_full(p) for p in t.model.parameters()),
            })  # fmt: skip

    class InjectInf:
        """Writes an inf into this rank's first non-empty gradient (shard) after the backward."""

        inject_rank = -1
        injected: list[int]

        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]
            t: Any = self
            if (
                t.accelerator.sync_gradients
                and t.state.global_step == INJECT_STEP
                and dist.get_rank() == self.inject_rank
            ):
                grad = next(
                    local_tensor(p.grad)
                    for p in model.parameters()
                    if p.grad is not None and local_tensor(p.grad).numel()
                )
                grad.view(-1)[0] = math.inf
                self.injected.append(t.state.global_step)
            return loss

    class InjectTrainer(InjectInf, Trainer):  # type: ignore[misc]
        pass

    return Recorder, InjectInf, InjectTrainer


def _run(
    kind: str,
    out_dir: str,
    *,
    max_grad_norm: float = 1.0,
    accumulation: int = 1,
    fsdp2: bool = False,
    sft: bool = False,
    scaler: Any = None,
    save_steps: int = 0,
    resume: str | None = None,
) -> dict[str, Any]:
    """One Trainer run of NUM_STEPS optimizer steps; returns what the parent compares."""
    from transformers import TrainingArguments

    Recorder, InjectInf, InjectTrainer = _classes()
    _reset_accelerate()
    common: dict[str, Any] = dict(
        output_dir=out_dir, fp16=True, use_cpu=True, optim="adamw_torch_fused",
        learning_rate=1e-3, lr_scheduler_type="linear", max_steps=NUM_STEPS,
        per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
        max_grad_norm=max_grad_norm, logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    if fsdp2:
        common.update(
            fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        )
    if sft:
        from trl import SFTConfig, SFTTrainer

        class InjectSFT(InjectInf, SFTTrainer):  # type: ignore[misc]
            pass

        tokenizer, dataset = _sft_data()
        trainer: Any = InjectSFT(
            model=_model(),
            args=SFTConfig(max_length=SEQ, **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    else:
        trainer = InjectTrainer(
            model=_model(), args=TrainingArguments(**common), train_dataset=_lm_data()
        )
    trainer.inject_rank = dist.get_world_size() - 1
    trainer.injected = []
    if fsdp2:
        _enable_fsdp2_on_cpu(trainer)
    if kind == "stock":
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", **(scaler or {}))
        trainer.accelerator.native_amp = True
    else:
        from distscaler import GradScaler
        from distscaler.integrations.transformers import install

        install(trainer, GradScaler("cpu", **scaler) if scaler else None)
    recorder = Recorder(trainer)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    history = [h for h in trainer.state.log_history if "loss" in h]
    final = trainer.state.log_history[-1]
    res: dict[str, Any] = {
        "steps": recorder.steps,
        "injected": trainer.injected,
        "first_state": recorder.first_state,
        "grad_norms": [float(h["grad_norm"]) for h in history],
        "metrics": [{k: v for k, v in h.items() if k.startswith("distscaler/")} for h in history],
        "final_metrics": {k: v for k, v in final.items() if k.startswith("distscaler/")},
        "distributed_type": str(trainer.accelerator.distributed_type),
        "grad_type": type(next(trainer.model.parameters())).__name__,
        "scaler_state": trainer.accelerator.scaler.state_dict(),
    }
    ckpts = sorted(Path(out_dir).glob("checkpoint-*"))
    res["checkpoints"] = {c.name: sorted(p.name for p in c.iterdir()) for c in ckpts}
    trainer.accelerator.free_memory()
    return res


def _enable_fsdp2_on_cpu(trainer: Any) -> None:
    """See the module docstring: what Accelerate would set up on an accelerator device."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState().distributed_type = DistributedType.FSDP
    trainer.accelerator.state.distributed_type = DistributedType.FSDP
    trainer.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        **trainer.args.fsdp_plugin_args
    )
    trainer.is_fsdp_enabled = True
    assert trainer.accelerator.is_fsdp2


def _sft_data() -> tuple[Any, Any]:
    """A character-level tokenizer built in memory and an in-memory text dataset (no download)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 32 + VOCAB - 3)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    texts = [f"def f{i}(x): return x * {i} + 1" for i in range(32)]
    return tokenizer, Dataset.from_dict({"text": texts})


def everything(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    set_rank_env(rank, world_size)
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    # A crash (torch's own, on an old torch) fails its run only (tests/_torch_gaps.py).
    out: dict[str, Any] = {GAPS: torch_gaps(world_size)}
    run = lambda name, kind, **kw: out.__setitem__(  # noqa: E731
        name, run_case(lambda: _run(kind, os.path.join(tmp, name), **kw))
    )
    run("stock", "stock")
    run("ours", "ours")
    run("ours-norm0", "ours", max_grad_norm=0.0)
    run("stock-accum", "stock", accumulation=2)
    run("ours-accum", "ours", accumulation=2)
    # Resume: checkpoint after step 2 (one skip and a grown scale in it), then resume from it.
    scaler = {"init_scale": 1024.0, "growth_interval": 1}
    run("ours-full", "ours", scaler=scaler, save_steps=2)
    run(
        "ours-resumed",
        "ours",
        scaler=scaler,
        resume=os.path.join(tmp, "ours-full", "checkpoint-2"),
    )
    run("stock-fsdp2", "stock", fsdp2=True)
    run("ours-fsdp2", "ours", fsdp2=True)
    try:
        import trl  # noqa: F401
    except ImportError:
        out["sft"] = None
    else:
        run("stock-sft", "stock", sft=True)
        run("ours-sft", "ours", sft=True)
    return out
