"""ROLL scenarios run inside spawned gloo ranks (tests/test_roll.py checks the results).

ROLL's own ``FSDP2TrainStrategy`` (``initialize``, ``train_step``, ``save_checkpoint``,
``load_checkpoint``) where its source imports, else tests/_roll_standin.py (``ROLL`` says which);
a tiny Llama (2 layers, hidden 32, vocab 64, saved with a word-level tokenizer for ROLL's
providers), ``strategy_config.param_dtype: fp16``, AdamW, a linear LR schedule, one optimizer step
per ``train_step``. Stock (ROLL's ``ShardedGradScaler``) and ours (``install``) run the same data:
an inf in rank 1's loss at `INF_STEP`, a checkpoint after `SAVE_AFTER`, and a resume from it.
Nothing here asserts: every rank runs the same collectives whatever it sees.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("ROLL_LOG_DIR", os.path.join(tempfile.gettempdir(), "distscaler-roll-logs"))

try:
    from roll.distributed.scheduler.protocol import DataProto
    from roll.distributed.strategy.fsdp2_strategy import FSDP2TrainStrategy

    ROLL: str | None = "roll.distributed.strategy.fsdp2_strategy.FSDP2TrainStrategy"

    def _local_path(model_name_or_path: str, local_dir: str | None = None) -> str:
        """ROLL's ``download_model`` for a local directory, without its Ray cache: ROLL wraps it in
        ``model_path_cache`` (roll/utils/checkpoint_manager.py), which creates a Ray actor
        (``SharedStorage``) to cache download paths, even for a path that is already a local
        directory (returned as is beneath). Nothing of the optimizer path."""
        assert os.path.isdir(model_name_or_path), model_name_or_path
        return model_name_or_path

    import roll.distributed.strategy.fsdp2_strategy as _fsdp2
    import roll.models.model_providers as _providers

    _fsdp2.download_model = _providers.download_model = _local_path
    # ROLL's checkpoint saves the device RNG state through current_platform.get_rng_state, which its
    # CPU platform does not have (None: "'NoneType' object is not callable" in save_checkpoint).
    from roll.platforms import current_platform as _platform

    if _platform.device_type == "cpu":
        _platform.get_rng_state = torch.get_rng_state
        _platform.set_rng_state = torch.set_rng_state
except ImportError:
    import _roll_standin as standin

    FSDP2TrainStrategy = standin.FSDP2TrainStrategy  # type: ignore[misc,assignment]
    DataProto = None
    ROLL = None

STEPS = 6
INF_STEP = 1
SAVE_AFTER = 2
BATCH, SEQ, VOCAB = 4, 8, 64
LR = 1e-3


def model_dir() -> str:
    """The tiny model's config and tokenizer, saved once per run by rank 0."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    path = [tempfile.mkdtemp(prefix="roll-model-") if dist.get_rank() == 0 else ""]
    if dist.get_rank() == 0:
        vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<unk>": VOCAB - 1}
        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
            pad_token="<pad>",
            unk_token="<unk>",
        )
        tok.save_pretrained(path[0])
        config().save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def provider(tokenizer: Any = None, model_args: Any = None, is_trainable: bool = True) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config()).float()


def worker(path: str, dtype: str = "fp16") -> Any:
    """What ROLL's strategy reads of its worker (``ActorWorker``), without Ray."""
    training_args = SimpleNamespace(
        max_steps=2 * STEPS,  # ROLL divides it by the data-parallel size
        learning_rate=LR,
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.0,
        lr_scheduler_type="linear",
        get_warmup_steps=lambda max_steps: 0,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
    )
    worker_config = SimpleNamespace(
        name="actor_train",
        offload_nccl=False,
        apply_loss_scale=False,
        checkpoint_config=None,
        strategy_args=SimpleNamespace(
            strategy_name="fsdp2_train",
            strategy_config={
                "param_dtype": dtype,
                "reduce_dtype": "fp32",
                "fsdp_size": dist.get_world_size(),
            },
        ),
        model_args=SimpleNamespace(
            model_name_or_path=path,
            ulysses_size=1,
            lora_target=None,
            model_config_kwargs={},
            compute_dtype=None,
        ),
        training_args=training_args,
    )
    return SimpleNamespace(
        worker_config=worker_config,
        rank_info=SimpleNamespace(dp_rank=0, dp_size=1, cp_rank=0, cp_size=1),
        pipeline_config=SimpleNamespace(seed=0, max_grad_norm=1.0),
        rank=dist.get_rank(),
    )


def build(path: str, *, ours: bool, before_init: bool = True) -> Any:
    from distscaler.integrations.roll import install

    strategy = FSDP2TrainStrategy(worker(path))
    if ours and before_init:
        install(strategy)
    strategy.initialize(model_provider=provider)
    if ours and not before_init:
        install(strategy)
    if not ours:
        strategy.built_scaler_enabled = strategy.scaler._enabled
        if not strategy.scaler._enabled:
            # ROLL builds ShardedGradScaler(growth_interval=400) with torch's default device,
            # "cuda": on the CPU torch disables it (no scaling at all). This is that scaler as ROLL
            # builds it on a CUDA device, made for the CPU, the GPU behaviour under measurement.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            strategy.scaler = ShardedGradScaler(device="cpu", growth_interval=400)
    return strategy


def batch(step: int) -> Any:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    ids = torch.randint(0, VOCAB - 2, (BATCH, SEQ), generator=g)
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).clone(),
    }
    meta = {"loss_mask_keys": []}
    if DataProto is None:
        return standin.Batch(tensors, meta)
    return DataProto.from_dict(tensors=tensors, meta_info=meta)


def loss_func(inf: bool) -> Any:
    def f(data: Any, logits: torch.Tensor) -> Any:
        ids = data.batch["input_ids"]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )
        if inf:
            loss = loss * float("inf")
        return loss, {"loss": float(loss.detach())}

    return f


def shards(strategy: Any) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in strategy.model.parameters()]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.float().numpy().tobytes())
    return h.hexdigest()[:16]


def scale(strategy: Any) -> float:
    return float(strategy.scaler.get_scale())


def adam_steps(strategy: Any) -> int:
    first = strategy.optimizer.state.get(next(iter(strategy.model.parameters())))
    return 0 if not first else int(first["step"])


def grads_left(strategy: Any) -> float | None:
    """The norm of the local gradient shards left after a step (None: all set to None)."""
    gs = [p.grad for p in strategy.model.parameters() if p.grad is not None]
    if not gs:
        return None
    return float(torch.stack([g.to_local().float().norm() for g in gs]).norm())


def train(strategy: Any, steps: range) -> list[dict[str, Any]]:
    records = []
    for step in steps:
        before = shards(strategy)
        inf = step == INF_STEP and dist.get_rank() == 1
        metrics = strategy.train_step(batch=batch(step), loss_func=loss_func(inf))
        after = shards(strategy)
        records.append(
            {
                "step": step,
                "grad_norm": metrics.get("actor_train/grad_norm"),
                "scale": scale(strategy),
                "lr": strategy.scheduler.get_last_lr()[0],
                "sched": strategy.scheduler.last_epoch,
                "adam": adam_steps(strategy),
                "changed": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                "grads_left": grads_left(strategy),
                "skipped_metric": metrics.get("distscaler/skipped"),
                "scale_metric": metrics.get("distscaler/scale"),
            }
        )
    return records


def unscale_twice(strategy: Any) -> dict[str, Any]:
    """One scaled backward, then ROLL's ``scaler.unscale_`` twice: the second is refused?"""
    out: dict[str, Any] = {}
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        data = batch(100)
        logits = strategy.model(
            input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"]
        ).logits
        loss, _ = loss_func(False)(data, logits)
        strategy.scaler.scale(loss).backward()
    strategy.scaler.unscale_(strategy.optimizer)
    try:
        strategy.scaler.unscale_(strategy.optimizer)
        out["second"] = "applied"
    except RuntimeError as e:
        out["second"] = f"{type(e).__name__}: {e}"
    strategy.optimizer.zero_grad(set_to_none=True)
    return out


def everything(rank: int, world_size: int) -> dict[str, Any]:
    """Every scenario, on every rank."""
    path = model_dir()
    root = [tempfile.mkdtemp(prefix="roll-ckpt-") if rank == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    out: dict[str, Any] = {"roll": ROLL, "world_size": world_size}
    for name, ours in (("stock", False), ("ours", True)):
        strategy = build(path, ours=ours)
        out[f"{name}_class"] = f"{type(strategy).__module__}.{type(strategy).__qualname__}"
        out[f"{name}_scaler"] = type(strategy.scaler).__name__
        out[f"{name}_built_scaler_enabled"] = getattr(strategy, "built_scaler_enabled", None)
        first = train(strategy, range(SAVE_AFTER + 1))
        ckpt = os.path.join(root[0], name)
        strategy.save_checkpoint(ckpt, global_step=SAVE_AFTER, ckpt_id=name, is_last_step=True)
        out[f"{name}_saved_scale"] = scale(strategy)
        out[f"{name}_listing"] = sorted(os.listdir(ckpt))
        out[name] = first + train(strategy, range(SAVE_AFTER + 1, STEPS))
        out[f"{name}_final"] = digest(shards(strategy))
        out[f"{name}_unscale_twice"] = unscale_twice(strategy)
        del strategy
        resumed = build(path, ours=ours, before_init=False)
        resumed.load_checkpoint(ckpt)
        out[f"{name}_resumed_scale"] = scale(resumed)
        out[f"{name}_resumed_sched"] = resumed.scheduler.last_epoch
        if ours:
            out["ours_resumed"] = train(resumed, range(SAVE_AFTER + 1, STEPS))
            out["ours_resumed_final"] = digest(shards(resumed))
        del resumed
    # Ours loading stock's checkpoint: a warning, the initial scale.
    import logging

    from distscaler.integrations.roll import logger

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        from_stock = build(path, ours=True)
        from_stock.load_checkpoint(os.path.join(root[0], "stock"))
        out["ours_from_stock_scale"] = scale(from_stock)
        out["ours_from_stock_warnings"] = [r for r in records if "no distscaler state" in r]
    finally:
        logger.removeHandler(handler)
    dist.barrier()
    return out
