"""What the AReaL job (launch/train_areal.py) and its tests (tests/_areal_scenarios.py) share: the
tiny model, AReaL's PPO actor engine as AReaL builds it, and RL batches in AReaL's format.

AReaL 1.0.4, its FSDP engine (``areal.engine.fsdp_engine.FSDPPPOActor``), in the process that
trains (as in AReaL's SPMD mode). On CPU processes AReaL picks its own CPU platform (gloo); call
:func:`common.areal_cpu.prepare` first.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

VOCAB, PROMPT, RESPONSE = 256, 8, 8
#: Responses per prompt: a GRPO group, whose rewards are normalized into advantages.
GROUP = 2


def save_tiny_qwen2(path: str) -> str:
    """A 2-layer Qwen2 (hidden 64, vocab 256, untied embeddings) and a word-level tokenizer of
    the same vocabulary, ``save_pretrained`` to ``path`` (AReaL's engine loads both from it);
    returns ``path``. Nothing is downloaded."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=VOCAB - 1,
        pad_token_id=VOCAB - 2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    words = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    backend = Tokenizer(WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    ).save_pretrained(path)
    return path


def shared_model_dir(save: Callable[[str], str] = save_tiny_qwen2) -> str:
    """Rank 0 saves a tiny model (``save(path)``) in a fresh directory; every rank gets its path."""
    box = [save(tempfile.mkdtemp(prefix="areal-model-")) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def actor_config(
    model_path: str,
    *,
    dtype: str = "float16",
    lr: float = 1e-3,
    lr_scheduler: str = "constant",
    warmup: float = 0.0,
    optimizer: str = "adam",
    minibatches: int = 1,
    name: str = "distscaler",
) -> Any:
    """AReaL's ``PPOActorConfig`` for the tiny model: GRPO (group-normalized advantages, no KL,
    no critic), ``dtype`` compute, fp32 master weights, ``minibatches`` optimizer steps per
    update, ``backend="fsdp:d{world size}"``."""
    from areal.api.cli_args import MicroBatchSpec, NormConfig, OptimizerConfig, PPOActorConfig

    return PPOActorConfig(
        experiment_name=name,
        trial_name="t0",
        path=model_path,
        init_from_scratch=False,
        attn_impl="sdpa",
        dtype=dtype,
        backend=f"fsdp:d{dist.get_world_size()}",
        mb_spec=MicroBatchSpec(n_mbs=1),
        optimizer=OptimizerConfig(
            type=optimizer,
            lr=lr,
            weight_decay=0.0,
            lr_scheduler_type=lr_scheduler,
            warmup_steps_proportion=warmup,
            gradient_clipping=1.0,
        ),
        ppo_n_minibatches=minibatches,
        recompute_logprob=True,
        use_decoupled_loss=False,
        kl_ctl=0.0,
        adv_norm=NormConfig(mean_level="group", std_level="group", group_size=GROUP),
        disable_dropout=True,
    )


def build_engine(
    config: Any, *, total_steps: int = 100, install: Callable[[Any], Any] | None = None
) -> Any:
    """AReaL's ``FSDPPPOActor`` for ``config``, its process group created and initialized as
    AReaL's trainer does (``total_steps`` for the LR schedule). ``install(engine)`` runs between
    construction and ``initialize`` when given."""
    from areal.api import FinetuneSpec
    from areal.engine import FSDPPPOActor

    engine = FSDPPPOActor(config=config)
    engine.create_process_group()
    if install is not None:
        install(engine)
    engine.initialize(
        None, FinetuneSpec(total_train_epochs=1, dataset_size=total_steps, train_batch_size=1)
    )
    return engine


def trajectory(
    prompt: torch.Tensor, response: torch.Tensor, logprobs: torch.Tensor, reward: float
) -> dict[str, Any]:
    """One trajectory in AReaL's rollout format (what its workflows return): ``input_ids`` of the
    prompt and the response, the loss mask on the response, the sampling log-probs aligned with
    the tokens (0 on the prompt), the reward, the policy version."""
    length = prompt.numel() + response.numel()
    input_ids = torch.cat([prompt, response]).view(1, length)
    loss_mask = torch.cat([torch.zeros_like(prompt), torch.ones_like(response)]).view(1, length)
    logp = torch.cat([torch.zeros(prompt.numel()), logprobs.float()]).view(1, length)
    return {
        "input_ids": input_ids.long(),
        "attention_mask": torch.ones(1, length, dtype=torch.bool),
        "loss_mask": loss_mask.long(),
        "logprobs": logp,
        "versions": torch.zeros(1, length, dtype=torch.long),
        "rewards": torch.tensor([reward], dtype=torch.float32),
    }


def synthetic_batch(
    step: int, rank: int, prompts: int = 2, scale: float = 1.0
) -> list[dict[str, Any]]:
    """A synthetic rollout batch, the same for a (step, rank) on every run: ``prompts`` random
    prompts, ``GROUP`` random responses each, random rewards times ``scale``, sampling log-probs
    near uniform's."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(prompts):
        prompt = torch.randint(0, VOCAB - 2, (PROMPT,), generator=g)
        for _ in range(GROUP):
            response = torch.randint(0, VOCAB - 2, (RESPONSE,), generator=g)
            logprobs = -math.log(VOCAB) - 0.1 * torch.rand(RESPONSE, generator=g)
            reward = scale * float(torch.rand((), generator=g))
            out.append(trajectory(prompt, response, logprobs, reward))
    return out


def rl_step(engine: Any, batch: list[dict[str, Any]], advantage_scale: float = 1.0) -> None:
    """One RL step as AReaL's ``PPOTrainer`` runs it on the actor: recompute the log-probs
    (``compute_logp``), GRPO advantages (``compute_advantages``), times ``advantage_scale``
    (tiny advantages: tiny gradients), ``ppo_update`` (one ``train_batch`` per minibatch),
    ``step_lr_scheduler``."""
    for traj, logp in zip(batch, engine.compute_logp(batch)):
        traj["prox_logp"] = logp
    advantaged = engine.compute_advantages(batch)
    if advantage_scale != 1.0:
        for traj in advantaged:
            traj["advantages"] = traj["advantages"] * advantage_scale
    engine.ppo_update(advantaged)
    engine.step_lr_scheduler()


def local_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's gradient shards (FSDP2's DTensor ``to_local()``), None left out."""
    out = []
    for p in params:
        if p.grad is not None:
            g = p.grad
            out.append(g.to_local() if hasattr(g, "to_local") else g)
    return out


def poison_local_grad(params: Iterable[torch.Tensor]) -> None:
    """inf into one element of this rank's first non-empty gradient shard: an overflow only this
    rank sees."""
    for grad in local_grads(params):
        if grad.numel():
            grad.view(-1)[0] = math.inf
            return
