"""verl scenarios run inside spawned gloo ranks (tests/test_verl.py checks the results).

Nothing here asserts: every rank runs the same collectives whatever it sees.

The engine is verl's own (``EngineRegistry.new(model_type="language_model", backend=...)``) on a
tiny Qwen2 (2 layers, hidden 64, vocab 256, saved locally, sdpa attention, padded batches), fp16
(``mixed_precision.param_dtype: fp16``), verl's PPO loss on a synthetic batch with GRPO-style
advantages, 2 CPU ranks. "stock" is what verl's registry builds without distscaler, its
``ShardedGradScaler(growth_interval=400)`` rebuilt for the device ``"cpu"``: verl builds it for
torch's default ``"cuda"``, which torch disables on a CPU (fp16 with no scale and no inf check);
built for the CPU it runs what a GPU runs. "ours" is what the registry builds after importing
``distscaler.integrations.verl``. The CPU stand-ins are in launch/common/verl_cpu.py, each with
its reason.

An inf is written into one element of rank 1's gradient shard, after the backward, at chosen steps.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from common.probes import CollectiveLog, HostReadSpy
from common.verl_cpu import use_cpu_platform

VOCAB, BATCH, SEQ, RESPONSE = 256, 4, 16, 8
LR = 1e-3
#: A warmup long enough that the LR changes at every scheduler step of a scenario.
WARMUP = 8
INF_RANK = 1


def save_tiny_qwen2(path: str) -> str:
    """A 2-layer Qwen2 (hidden 64, vocab 256), saved with ``save_pretrained`` into ``path``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def shared_model_dir() -> str:
    """Rank 0 saves the tiny model in a fresh directory; every rank gets its path."""
    box = [save_tiny_qwen2(tempfile.mkdtemp(prefix="verl-qwen2-")) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def build_engine(
    model_path: str,
    strategy: str,
    *,
    ours: bool,
    fused: bool = False,
    checkpoint_dir: str | None = None,
) -> Any:
    """verl's actor engine as its registry builds it, initialized, in train mode's placement."""
    import distscaler.integrations.verl as ds_verl
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    if ours:
        ds_verl.install()
    else:
        ds_verl.uninstall()
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=False,
        override_config={"attn_implementation": "sdpa"},  # no flash-attn on a CPU
    )
    engine_config = FSDPEngineConfig(
        forward_only=False,
        strategy=strategy,
        mixed_precision={"param_dtype": "fp16"},
        use_torch_compile=False,
        micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=LR,
        lr_warmup_steps=WARMUP,
        clip_grad=1.0,
        override_optimizer_config={"fused": True} if fused else None,
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    if not ours:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # verl's own settings, on the device the engine runs on (see the module doc).
        engine.scaler = ShardedGradScaler("cpu", growth_interval=400)
    return engine


def batch(step: int, rank: int) -> Any:
    """A synthetic RL batch in verl's format: prompts + responses, old/ref log-probs, and GRPO-style
    advantages (rewards normalized within groups of responses to the same prompt)."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask

    g = torch.Generator().manual_seed(1000 * step + rank)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    lengths = torch.randint(SEQ - RESPONSE + 2, SEQ + 1, (BATCH,), generator=g)
    attention_mask[torch.arange(SEQ) >= lengths[:, None]] = 0  # right padding of the responses
    rewards = torch.rand(BATCH, generator=g).view(-1, 2)  # 2 responses per prompt
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6))
    response_mask = attention_mask[:, SEQ - RESPONSE :]
    data = DataProto.from_single_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "prompts": input_ids[:, : SEQ - RESPONSE],
            "responses": input_ids[:, SEQ - RESPONSE :],
            "response_mask": response_mask,
            "old_log_probs": -5.0 - torch.rand(BATCH, RESPONSE, generator=g),
            "ref_log_prob": -5.0 - torch.rand(BATCH, RESPONSE, generator=g),
            "advantages": advantages.reshape(-1, 1).expand(BATCH, RESPONSE) * response_mask,
        },
        meta_info={"temperature": 1.0},
    )
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td,
        global_batch_size=BATCH * dist.get_world_size(),
        use_remove_padding=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        max_token_len_per_gpu=1024,
        use_fused_kernels=False,
    )
    return td


def ppo_loss() -> Any:
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    config = ActorConfig(
        strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=BATCH
    )
    return partial(verl_ppo_loss, config=config)


def local_shards(engine: Any) -> list[torch.Tensor]:
    out = []
    for p in engine.module.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out.append(t.detach().clone())
    return out


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _poison_rank_shard(engine: Any) -> None:
    """inf into one element of this rank's gradient shard (FSDP1 flat shard, FSDP2 DTensor)."""
    for p in engine.module.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if grad.numel():
                grad.view(-1)[0] = math.inf
                return


def scale_of(engine: Any) -> float:
    return float(engine.scaler.get_scale())


def train(engine: Any, steps: range, *, inf_steps: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """verl's worker step (``train_batch``, then ``lr_scheduler_step``), per step: what it
    reported, the scale after, whether the shards changed, the scaler phase's counts."""
    rank = dist.get_rank()
    loss = ppo_loss()
    original = engine.optimizer_step
    counts: dict[str, int] = {}

    def optimizer_step() -> float:
        if step in inf_steps and rank == INF_RANK:
            _poison_rank_shard(engine)
        optimizer = engine.optimizer
        own_step = optimizer.__dict__.get("step")  # the LR scheduler's wrapper, if any
        spy = HostReadSpy()
        spy.exclude_optimizer(optimizer)  # not the optimizer's own reads (foreach AdamW's steps)
        try:
            with spy, CollectiveLog() as log:
                norm = original()
        finally:
            if own_step is None:
                del optimizer.step
            else:
                optimizer.step = own_step
        counts.update(collectives=len(log.calls), host_reads=len(spy.reads))
        counts["kinds"] = sorted({name for name, _ in log.calls})  # type: ignore[assignment]
        return norm

    engine.optimizer_step = optimizer_step
    records = []
    try:
        with engine.train_mode():
            for step in steps:
                before = digest(local_shards(engine))
                output = engine.train_batch(batch(step, rank), loss_function=loss)
                lr = engine.lr_scheduler_step()
                metrics = output["metrics"]
                records.append(
                    {
                        "step": step,
                        "grad_norm": float(metrics["grad_norm"]),
                        "scale": scale_of(engine),
                        "changed": digest(local_shards(engine)) != before,
                        "lr": float(lr),
                        "metrics": {k: float(v) for k, v in metrics.items() if "distscaler" in k},
                        **counts,
                    }
                )
    finally:
        engine.optimizer_step = original
    return records


def _release(engine: Any) -> None:
    del engine
    dist.barrier()


def everything(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    """Every scenario for one FSDP version (``"fsdp"``: FSDP1, ``"fsdp2"``), on every rank."""
    use_cpu_platform()
    import distscaler.integrations.verl as ds_verl

    model = shared_model_dir()
    ckpt_root = [tempfile.mkdtemp(prefix="verl-ckpt-") if rank == 0 else ""]
    dist.broadcast_object_list(ckpt_root, src=0)
    out: dict[str, Any] = {}

    # (a) an inf on rank 1 at step 1; (d) a checkpoint after step 2, then 2 more steps.
    for name, ours in (("stock", False), ("ours", True)):
        engine = build_engine(model, strategy, ours=ours)
        out[f"{name}_engine"] = type(engine).__module__
        path = os.path.join(ckpt_root[0], name)
        first = train(engine, range(3), inf_steps=(1,))
        engine.save_checkpoint(path, global_step=3)
        rest = train(engine, range(3, 5))
        out[name] = first + rest
        out[f"{name}_final"] = digest(local_shards(engine))
        _release(engine)
        resumed = build_engine(model, strategy, ours=ours)
        resumed.load_checkpoint(path)
        out[f"{name}_resumed_scale"] = scale_of(resumed)
        out[f"{name}_resumed"] = train(resumed, range(3, 5))
        out[f"{name}_resumed_final"] = digest(local_shards(resumed))
        _release(resumed)

    # (b) fused AdamW: stock crashes at the first step (torch issue 140514), ours runs.
    engine = build_engine(model, strategy, ours=False, fused=True)
    try:
        train(engine, range(1))
        out["stock_fused_error"] = None
    except Exception as e:  # noqa: BLE001 - what the stock path raises is the result
        out["stock_fused_error"] = f"{type(e).__name__}: {e}"
    _release(engine)
    engine = build_engine(model, strategy, ours=True, fused=True)
    out["ours_fused_is_fused"] = bool(engine.optimizer.defaults.get("fused"))
    out["ours_fused"] = train(engine, range(3), inf_steps=(1,))
    _release(engine)

    # lr_on_skip="step": verl's stock schedule, kept on request.
    ds_verl.configure(lr_on_skip="step")
    try:
        engine = build_engine(model, strategy, ours=True)
        out["ours_lr_step"] = train(engine, range(3), inf_steps=(1,))
        _release(engine)
    finally:
        ds_verl._options = None
    return out


def fsdp1(rank: int, world_size: int) -> dict[str, Any]:
    return everything(rank, world_size, "fsdp")


def fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    return everything(rank, world_size, "fsdp2")
