"""verl's Megatron engine (``backend="megatron"``) scenarios, run inside spawned gloo ranks
(tests/test_verl_megatron.py checks the results). Nothing here asserts.

The engine is verl 0.9.1's ``MegatronEngineWithLMHead`` as ``EngineRegistry.new`` builds it
(``use_mbridge=True, vanilla_mbridge=True``: the ``mbridge`` package, 0.15.1), fp16
(``dtype="float16"``), Megatron's distributed optimizer (verl's default), TP = PP = CP = 1, on 2
ranks: ``dense``, the tiny Qwen2 of launch/verl_job.py (DP = 2, one optimizer); ``moe``, a tiny
Qwen3-MoE (4 experts, top-2, EP = 2: Megatron's ``ChainedOptimizer`` of a dense and an expert
optimizer). verl's PPO loss on synthetic RL batches (launch/verl_job.py's format). "stock" is
what the registry builds after ``distscaler.integrations.verl.uninstall()``, "ours" after
``install()``. An inf is written into rank 1's main gradients (after the grad sync) at step 1.

CPU stand-ins: launch/common/verl_cpu.py (verl's platform) and launch/common/megatron_cpu.py
(megatron-core's CUDA calls), plus the ones below for mbridge and Transformer Engine, each with
why. One verl setting differs from verl's fp16 default: ``use_precision_aware_optimizer=False``
(verl turns it on in fp16; it needs TE's FusedAdam, and distscaler's Megatron integration
refuses it).
"""

from __future__ import annotations

import math
import re
import traceback
import types
from typing import Any

import torch
import torch.distributed as dist

from common.megatron_cpu import cpu_megatron, stub_gpu_only_imports
from common.verl_cpu import use_cpu_platform


def mbridge_on_megatron_019() -> None:
    """mbridge 0.15.1 (the newest) compares ``model_type == ModelType.encoder_and_decoder`` in
    ``mbridge/core/util.py::get_model``; megatron-core 0.19 removed that enum member
    (``megatron/core/enums.py`` keeps only ``encoder_or_decoder``), so every build raises
    ``AttributeError: encoder_and_decoder``. A namespace with the member kept and a sentinel
    that nothing equals for the removed one takes mbridge's decoder-only branch, as it would."""
    import mbridge.core.util as mb_util
    from megatron.core.enums import ModelType

    mb_util.ModelType = types.SimpleNamespace(
        encoder_or_decoder=ModelType.encoder_or_decoder, encoder_and_decoder=object()
    )


def local_layer_specs() -> None:
    """mbridge builds its layers with ``get_gpt_decoder_block_spec(config,
    use_transformer_engine=True)`` (``mbridge/core/llm_bridge.py::_get_transformer_layer_spec``),
    and Transformer Engine is CUDA-only (no CPU build; megatron leaves ``TESpecProvider`` None
    without it). Megatron's own local spec (its Linear, DotProductAttention, torch norms) is the
    CPU stand-in."""
    import mbridge.core.llm_bridge as llm_bridge

    stock = llm_bridge.get_gpt_decoder_block_spec
    if getattr(stock, "_local", False):
        return

    def local(config, use_transformer_engine=True, *args, **kwargs):  # noqa: ANN001, ANN202
        return stock(config, False, *args, **kwargs)

    local._local = True  # type: ignore[attr-defined]
    llm_bridge.get_gpt_decoder_block_spec = local

    # The local spec keeps the norms as modules of their own (``input_layernorm``,
    # ``pre_mlp_layernorm``) where TE fuses them into the next linear (``layer_norm_weight``);
    # mbridge's name maps (``mbridge/core/bridge.py::_weight_name_mapping_mcore_to_hf``) know
    # only TE's names: the local names are renamed to TE's before the lookup.
    from mbridge.core.bridge import Bridge

    to_hf = Bridge._weight_name_mapping_mcore_to_hf

    def local_to_hf(self, name):  # noqa: ANN001, ANN202
        name = name.replace(
            ".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"
        )
        if not any("pre_mlp_layernorm" in k for k in getattr(self, "_MLP_MAPPING", {})):
            name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
        # SequentialMLP's experts (local spec) are modules of their own, TEGroupedMLP's are
        # ``linear_fcK.weight{expert}`` of one module: the same renaming.
        # ``_weight_name_mapping_mcore_local_to_global`` makes only TE's expert ids global: here the
        # local id N of this expert-parallel rank becomes N + experts_per_rank * ep_rank.
        match = re.search(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$", name)
        if match:
            per_rank = self.config.num_moe_experts // self.mpu.ep_size
            expert = int(match.group(1)) + per_rank * self.mpu.ep_rank
            name = f"{name[: match.start()]}.mlp.experts.{match.group(2)}.weight{expert}"
        return to_hf(self, name)

    Bridge._weight_name_mapping_mcore_to_hf = local_to_hf

    # verl's padded (bshd) forward passes a [batch, seq] mask, True = a real token
    # (verl/models/mcore/util.py::preprocess_bshd_engine), which TE's attention takes as a
    # padding mask; Megatron's local DotProductAttention
    # (megatron/core/transformer/dot_product_attention.py::forward) masks with [batch, 1, sq, sk],
    # True = masked: the same mask (causal and padding) in the local layout.
    from megatron.core.transformer import dot_product_attention as dpa

    forward = dpa.DotProductAttention.forward

    def local_mask_forward(self, query, key, value, attention_mask, *args, **kwargs):  # noqa: ANN001, ANN202
        if attention_mask is not None and attention_mask.dim() == 2:
            valid = attention_mask.bool()
            s = valid.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool).triu(1)
            attention_mask = causal[None, None] | ~valid[:, None, None, :]
        return forward(self, query, key, value, attention_mask, *args, **kwargs)

    dpa.DotProductAttention.forward = local_mask_forward


#: mbridge's Qwen3-MoE config (``mbridge/models/qwen3moe.py::_build_config``) asks for TE's and
#: grouped-GEMM kernels: ``persist_layer_norm`` (torch's norm, the local spec's, asserts it off),
#: ``moe_grouped_gemm`` (TEGroupedMLP / the grouped_gemm package, CUDA only; off: SequentialMLP),
#: the bias fusions (CUDA kernels). verl's own ``override_transformer_config`` turns them off.
CPU_KERNELS = {
    "persist_layer_norm": False,
    "moe_grouped_gemm": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
}


def build_engine(
    model_path: str, *, ours: bool, lr: float = 1e-3, warmup: int = 8, ep: int = 1
) -> Any:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    import distscaler.integrations.verl as ds_verl

    if ours:
        ds_verl.install()
    else:
        ds_verl.uninstall()
    model_config = HFModelConfig(path=model_path, load_tokenizer=False, use_remove_padding=False)
    # The tiny model is saved without a tokenizer (the batches are token ids); verl's Megatron
    # forward reads only ``tokenizer.pad_token_id`` (transformer_impl.py, forward_step).
    object.__setattr__(model_config, "tokenizer", types.SimpleNamespace(pad_token_id=0))
    engine_config = McoreEngineConfig(
        forward_only=False,
        use_mbridge=True,
        vanilla_mbridge=True,
        dtype="float16",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=ep,
        micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
        use_remove_padding=False,
        override_transformer_config=dict(CPU_KERNELS),
    )
    # verl's fp16 optimizer config turns on Megatron's precision-aware optimizer
    # (verl/utils/megatron/optimizer.py::init_megatron_optim_config), which needs
    # Transformer Engine's FusedAdam (CUDA only); verl's own override turns it off.
    optimizer_config = McoreOptimizerConfig(
        lr=lr,
        lr_warmup_steps=warmup,
        clip_grad=1.0,
        lr_decay_steps=100,
        # hysteresis 1 (Megatron's default is 2): the skipped step halves the scale, so the
        # scales after it show whether every sub-optimizer backed off together.
        override_optimizer_config={"use_precision_aware_optimizer": False, "hysteresis": 1},
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


BATCH = 4
INF_RANK = 1


def batch(step: int, rank: int) -> Any:
    from verl_job import synthetic_batch

    return synthetic_batch(step, rank, BATCH)


def ppo_loss() -> Any:
    from verl_job import ppo_loss as verl_job_ppo_loss

    return verl_job_ppo_loss(BATCH, strategy="megatron")


def subs(engine: Any) -> list[Any]:
    return list(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]))


def scales(engine: Any) -> list[float]:
    return [float(o.get_loss_scale().item()) for o in subs(engine)]


def params_digest(engine: Any) -> float:
    return float(
        sum(p.detach().double().abs().sum() for m in engine.module for p in m.parameters())
    )


def _poison(engine: Any) -> None:
    """inf into the first element of every main gradient of this rank (after the grad sync)."""
    for m in engine.module:
        for p in m.parameters():
            g = getattr(p, "main_grad", None)
            if g is not None and g.numel():
                g.view(-1)[0] = math.inf


def train(engine: Any, steps: range, inf_steps: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    loss = ppo_loss()
    original = engine.optimizer_step

    def optimizer_step() -> float:
        if step in inf_steps and rank == INF_RANK:
            _poison(engine)
        return original()

    engine.optimizer_step = optimizer_step
    records = []
    try:
        with engine.train_mode():
            for step in steps:
                before = params_digest(engine)
                rec: dict[str, Any] = {"step": step}
                try:
                    out = engine.train_batch(batch(step, rank), loss_function=loss)
                except Exception as e:  # noqa: BLE001 - stock's error is the result
                    rec["error"] = f"{type(e).__name__}: {e}"
                    rec["trace"] = traceback.format_exc()[-2500:]
                    records.append(rec)
                    break
                rec["lr"] = float(engine.lr_scheduler_step())
                metrics = out["metrics"]
                rec["grad_norm"] = float(metrics["grad_norm"])
                rec["metrics"] = {k: float(v) for k, v in metrics.items() if "distscaler" in k}
                rec["scales"] = scales(engine)
                rec["changed"] = params_digest(engine) != before
                records.append(rec)
    finally:
        engine.optimizer_step = original
    return records


def save_tiny_qwen3_moe(path: str) -> str:
    """A 2-layer Qwen3-MoE (hidden 64, vocab 256, 4 experts, top-2, every layer MoE)."""
    from transformers import Qwen3MoeConfig
    from verl_job import VOCAB, save_model

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return save_model(config, path)


def everything(rank: int, world_size: int, kind: str = "dense") -> dict[str, Any]:
    stub_gpu_only_imports()
    use_cpu_platform()
    mbridge_on_megatron_019()
    local_layer_specs()
    from verl_job import save_tiny_qwen2, shared_model_dir

    model = shared_model_dir(save_tiny_qwen2 if kind == "dense" else save_tiny_qwen3_moe)
    out: dict[str, Any] = {}
    with cpu_megatron():
        for name, ours in (("stock", False), ("ours", True)):
            # MoE: experts split over the 2 ranks (EP = 2), so Megatron builds a dense and an
            # expert optimizer (with EP = 1 the experts are data-parallel, one optimizer).
            engine = build_engine(model, ours=ours, ep=1 if kind == "dense" else world_size)
            out[f"{name}_engine"] = type(engine).__module__
            out[f"{name}_subs"] = len(subs(engine))
            out[name] = train(engine, range(4), inf_steps=(1,))
            del engine
            dist.barrier()
    return out


def dense(rank: int, world_size: int) -> dict[str, Any]:
    return everything(rank, world_size, "dense")


def moe(rank: int, world_size: int) -> dict[str, Any]:
    return everything(rank, world_size, "moe")
