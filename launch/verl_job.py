"""What the verl job (launch/train_verl.py) and its tests (tests/_verl_scenarios.py) share: the tiny
model, verl's engine as its registry builds it, and RL batches in verl's format.

verl 0.9.1; on CPU processes, call :func:`common.verl_cpu.use_cpu_platform` first.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

VOCAB, PROMPT, RESPONSE = 256, 8, 8
#: Responses per prompt: a GRPO group, whose rewards are normalized into advantages.
GROUP = 2


def save_tiny_qwen2(path: str) -> str:
    """A 2-layer Qwen2 (hidden 64, vocab 256, untied embeddings), ``save_pretrained`` to ``path``."""
    from transformers import Qwen2Config

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
    return save_model(config, path)


def save_model(config: Any, path: str) -> str:
    """A causal LM with freshly initialized weights (seed 0) for a transformers ``config``,
    ``save_pretrained`` to ``path``; returns ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def shared_model_dir(save: Callable[[str], str] = save_tiny_qwen2) -> str:
    """Rank 0 saves a tiny model (``save(path)``) in a fresh directory; every rank gets its path."""
    box = [save(tempfile.mkdtemp(prefix="verl-model-")) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def build_engine(
    model_path: str,
    strategy: str,
    *,
    ours: bool,
    fused: bool = False,
    lr: float = 1e-3,
    warmup: int = 0,
    micro_batch: int = 2,
) -> Any:
    """verl's actor engine (``language_model``) as its registry builds it, fp16, initialized.

    ``ours``: with ``distscaler.integrations.verl`` in the registry (what the config line
    ``external_lib=distscaler.integrations.verl`` does), else verl's stock engine.
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    import distscaler.integrations.verl as ds_verl

    if ours:
        ds_verl.install()
    else:
        ds_verl.uninstall()
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=False,
        override_config={"attn_implementation": "sdpa"},  # verl's default, flash-attn, needs CUDA
    )
    engine_config = FSDPEngineConfig(
        forward_only=False,
        strategy=strategy,
        mixed_precision={"param_dtype": "fp16"},
        use_torch_compile=False,
        micro_batch_size_per_gpu=micro_batch,
        use_dynamic_bsz=False,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=lr,
        lr_warmup_steps=warmup,
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
    return engine


def grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO's advantage: each reward normalized within its group of ``GROUP`` responses to the
    same prompt. ``rewards``: (B,) float, B a multiple of ``GROUP``; returns (B,)."""
    grouped = rewards.view(-1, GROUP)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + 1e-6)).reshape(-1)


def rl_batch(
    prompts: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    micro_batch: int = 2,
) -> Any:
    """A training batch in verl's format (a TensorDict without padding) from (B, PROMPT) prompts,
    (B, RESPONSE) responses and their mask, (B,) advantages and (B, RESPONSE) old log-probs."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([torch.ones_like(prompts), response_mask], dim=1)
    data = DataProto.from_single_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "ref_log_prob": old_log_probs,
            "advantages": advantages[:, None] * response_mask,
        },
        meta_info={"temperature": 1.0},
    )
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td,
        global_batch_size=input_ids.shape[0] * dist.get_world_size(),
        use_remove_padding=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch,
        max_token_len_per_gpu=4096,
        use_fused_kernels=False,
    )
    return td


def ppo_loss(batch_size: int, micro_batch: int = 2, strategy: str = "fsdp") -> Any:
    """verl's PPO policy loss (``verl.workers.utils.losses.ppo_loss``), one mini-batch per step."""
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    config = ActorConfig(
        strategy=strategy,
        rollout_n=GROUP,
        ppo_micro_batch_size_per_gpu=micro_batch,
        ppo_mini_batch_size=batch_size,
    )
    return partial(verl_ppo_loss, config=config)


def synthetic_batch(step: int, rank: int, batch_size: int) -> Any:
    """A synthetic RL batch, the same for a (step, rank) on every run: random prompts and
    responses (right-padded), random rewards turned into GRPO advantages, old log-probs near
    uniform's (:func:`rl_batch`'s format)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    prompts = torch.randint(0, VOCAB, (batch_size, PROMPT), generator=g)
    responses = torch.randint(0, VOCAB, (batch_size, RESPONSE), generator=g)
    lengths = torch.randint(2, RESPONSE + 1, (batch_size,), generator=g)
    mask = (torch.arange(RESPONSE) < lengths[:, None]).long()
    advantages = grpo_advantages(torch.rand(batch_size, generator=g))
    old_log_probs = -5.0 - torch.rand(batch_size, RESPONSE, generator=g)
    return rl_batch(prompts, responses, mask, advantages, old_log_probs)


def poison_local_grad(params: Iterable[torch.Tensor]) -> None:
    """inf into one element of this rank's first non-empty gradient (its local shard: FSDP1's flat
    shard, FSDP2's DTensor ``to_local()``): an overflow only this rank sees."""
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if grad.numel():
                grad.view(-1)[0] = math.inf
                return
