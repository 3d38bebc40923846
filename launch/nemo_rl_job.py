"""What the NeMo-RL job (launch/train_nemo_rl.py) and tests (tests/_nemo_rl_scenarios.py) share:
NeMo-RL's policy worker in fp16, its GRPO loss, a GRPO batch as NeMo-RL's ``train`` takes it, an inf
written into one rank's gradient shard, the shards' digest.

The worker is NeMo-RL's ``DTensorPolicyWorkerV2Impl`` (stock) or distscaler's
(``distscaler.integrations.nemo_rl.DTensorPolicyWorkerV2Impl``), each built by its own
``__init__`` in this process; on a CPU process with the stand-ins of
``launch/common/nemo_rl_cpu.py`` (each says why).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch

from common.nemo_rl_cpu import VOCAB, build_worker, on_cpu, policy_config, shared_model_dir

__all__ = [
    "VOCAB",
    "build_worker",
    "digest",
    "grpo_batch",
    "local_shards",
    "on_cpu",
    "pg_loss",
    "poison_on",
    "policy_config",
    "shared_model_dir",
    "train",
]


def pg_loss(kl_penalty: float = 0.0) -> Any:
    """NeMo-RL's GRPO loss (``ClippedPGLossFn``, its default settings; no KL term by default, so
    that a batch's advantages alone set the gradients' size)."""
    from nemo_rl.algorithms.loss import ClippedPGLossFn
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig

    return ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=kl_penalty))


def grpo_batch(
    step: int,
    rank: int,
    *,
    samples: int = 4,
    seq: int = 16,
    advantage_scale: float = 1.0,
    input_ids: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    prev_logprobs: torch.Tensor | None = None,
) -> Any:
    """One rank's share of a GRPO batch, with the keys NeMo-RL's GRPO gives ``policy.train``
    (random tokens, advantages and log-probs unless given; the first token is the prompt)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(1000 * step + rank)
    if input_ids is None:
        input_ids = torch.randint(2, VOCAB, (samples, seq), generator=g)
    samples, seq = input_ids.shape
    if advantages is None:
        advantages = torch.randn(samples, 1, generator=g).expand(samples, seq).clone()
    if prev_logprobs is None:
        prev_logprobs = -torch.rand(samples, seq, generator=g) - 5.0
    token_mask = torch.ones(samples, seq)
    token_mask[:, 0] = 0  # the prompt
    return BatchedDataDict(
        {
            "input_ids": input_ids,
            "input_lengths": torch.full((samples,), seq, dtype=torch.int32),
            "token_mask": token_mask,
            "sample_mask": torch.ones(samples),
            "advantages": advantages * advantage_scale,
            "prev_logprobs": prev_logprobs,
            "generation_logprobs": prev_logprobs,
            "reference_policy_logprobs": prev_logprobs,
        }
    )


def local_shards(worker: Any) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in worker.model.parameters()]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def finite(worker: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in local_shards(worker))


def poison_on(worker: Any, when: Callable[[], bool]) -> Any:
    """Write an inf into element 0 of this rank's shard of the first parameter's gradient (the
    embedding's), right after FSDP2's reduce-scatter writes it, whenever ``when()`` says so: a
    post-accumulate-grad hook, which FSDP2 runs on the sharded parameter. Returns the hook's handle."""
    param = next(iter(worker.model.parameters()))

    def hook(p: Any) -> None:
        if when():
            p.grad.to_local().view(-1)[0] = math.inf

    return param.register_post_accumulate_grad_hook(hook)


def train(worker: Any, batch: Any, loss: Any) -> dict[str, Any]:
    """NeMo-RL's ``worker.train(batch, loss)`` (on the CPU: :func:`on_cpu`); its metrics, the LR
    after its scheduler step."""
    with on_cpu():
        metrics = worker.train(batch, loss)
    metrics["lr_after"] = float(worker.optimizer.param_groups[0]["lr"])
    return metrics
