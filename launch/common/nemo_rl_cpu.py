"""Build and run NeMo-RL's DTensor policy worker (v2) in CPU processes (gloo), for the tests and
the NeMo-RL job.

NeMo-RL's worker is a Ray actor on a GPU: its ``__init__`` asks Ray for its GPU, starts NCCL,
builds its device meshes for ``"cuda"`` and has NeMo-Automodel build the model on
``torch.cuda.current_device()``; its ``train()`` moves the batch ``.to("cuda")``. None of that is
what distscaler's integration is about, so each gets a stand-in here, in the test and launch code
only; ``distscaler.integrations.nemo_rl`` patches nothing. The worker's own ``__init__``,
``train``, ``save_checkpoint`` and ``load_checkpoint`` run as NeMo-RL writes them (and NeMo-RL's
``validate_and_prepare_config``, ``setup_distributed``, ``setup_model_and_optimizer``,
Automodel's FSDP2 parallelizer and checkpointer, NeMo-RL's loss functions). Every stand-in, and
why (NeMo-RL at ``distscaler.integrations.nemo_rl.TESTED_COMMIT``):

* ``ray.get_gpu_ids()`` returns ``[rank]`` and ``NRL_DISABLE_NUMA_BINDING=1``: ``__init__`` pins
  itself to its GPU's NUMA node (``bind_to_gpu_numa(int(ray.get_gpu_ids()[0]))``), and there is no
  Ray actor nor GPU here.
* ``torch.distributed.init_process_group`` does nothing when the process group exists:
  ``setup_distributed`` starts NCCL itself; the test harness has started gloo.
* ``create_device_mesh`` (Automodel's, called by ``setup_distributed``) gets the FSDP2 config with
  ``backend="gloo"``: NeMo-RL writes ``"nccl"``, which builds the meshes on ``"cuda"``.
* the model class ``setup_model_and_optimizer`` calls ``from_pretrained`` on
  (``resolve_model_class``'s ``NeMoAutoModelForCausalLM``) is :class:`CpuAutoModel`: Transformers'
  ``AutoModelForCausalLM.from_pretrained`` in fp32 (NeMo-RL's master weights) and Automodel's own
  ``fsdp2_strategy_parallelize`` with NeMo-RL's mixed-precision policy (``param_dtype`` the
  precision, ``reduce_dtype``/``output_dtype`` float32). Automodel's ``from_pretrained`` builds on
  ``torch.device("cuda", torch.cuda.current_device())``.
* during ``train()`` (:func:`on_cpu`): tensors NeMo-RL puts on ``"cuda"`` (``torch.tensor(...,
  device="cuda")``, ``data.to("cuda")``, ``t.cuda()``) go to (stay on) the CPU; ``torch.autocast(device_type="cuda")`` is
  the CPU's autocast (CUDA's is disabled, with a warning, without CUDA); ``torch.cuda.get_device_name()``
  (a metric of ``train()``'s) says ``"cpu"``; ``torch.cuda.nvtx``'s range
  calls do nothing (a CPU build of torch has no NVTX; NeMo-RL's own unit tests stub them the same
  way).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = [
    "CpuAutoModel",
    "build_worker",
    "on_cpu",
    "policy_config",
    "save_tiny_model",
    "use_cpu_stand_ins",
]

VOCAB = 256


def save_tiny_model(path: str) -> str:
    """A tiny Qwen2 (2 layers, hidden 64, vocab 256) and a word-level tokenizer, saved in ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<eos>"
    ).save_pretrained(path)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(path)
    return path


def shared_model_dir() -> str:
    """Rank 0 saves the tiny model in a fresh directory; every rank gets its path."""
    box = [
        save_tiny_model(tempfile.mkdtemp(prefix="nemo-rl-model-")) if dist.get_rank() == 0 else ""
    ]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def policy_config(
    model: str,
    *,
    precision: str = "float16",
    global_batch: int = 8,
    micro_batch: int = 2,
    lr: float = 1e-3,
    warmup: int = 8,
    max_grad_norm: float | None = 1.0,
    fused: bool = False,
    distscaler: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A NeMo-RL policy config (``grpo_math_1B.yaml``'s policy section, shrunk): DTensor v2,
    AdamW, NeMo-RL's linear warmup then constant LR, no dynamic batching nor packing."""
    config: dict[str, Any] = {
        "model_name": model,
        "tokenizer": {"name": model, "chat_template": None},
        "train_global_batch_size": global_batch,
        "train_micro_batch_size": micro_batch,
        "logprob_batch_size": micro_batch,
        "generation_batch_size": micro_batch,
        "max_total_sequence_length": 32,
        "precision": precision,
        "offload_optimizer_for_logprob": False,
        # NeMo-RL's test config's (the worker reads the sampling settings and colocation).
        "generation": {
            "backend": "hf",
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "max_new_tokens": 8,
            "stop_token_ids": None,
            "stop_strings": None,
            "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
        },
        "dtensor_cfg": {
            "_v2": True,
            "enabled": True,
            "cpu_offload": False,
            "sequence_parallel": False,
            "activation_checkpointing": False,
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
            "custom_parallel_plan": None,
            "automodel_kwargs": {},
            "lora_cfg": {"enabled": False},
        },
        "megatron_cfg": {"enabled": False},
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {"enabled": False},
        "make_sequence_length_divisible_by": 1,
        "max_grad_norm": max_grad_norm,
        "optimizer": {
            "name": "torch.optim.AdamW",
            "kwargs": {
                "lr": lr,
                "weight_decay": 0.01,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "foreach": not fused,
                "fused": fused,
            },
        },
        "scheduler": [
            {
                "name": "torch.optim.lr_scheduler.LinearLR",
                "kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": warmup},
            },
            {
                "name": "torch.optim.lr_scheduler.ConstantLR",
                "kwargs": {"factor": 1.0, "total_iters": 10_000_000_000},
            },
            {"milestones": [warmup]},
        ],
    }
    if distscaler is not None:
        config["distscaler"] = distscaler
    return config


class CpuAutoModel:
    """Stands for ``NeMoAutoModelForCausalLM`` in ``setup_model_and_optimizer`` (module doc)."""

    @staticmethod
    def from_pretrained(
        name: str, *, device_mesh: Any, distributed_config: Any, **kwargs: Any
    ) -> torch.nn.Module:
        from nemo_automodel.components.distributed.parallelizer import fsdp2_strategy_parallelize
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            name, torch_dtype=torch.float32, attn_implementation="sdpa"
        )
        return fsdp2_strategy_parallelize(
            model,
            device_mesh,
            mp_policy=distributed_config.mp_policy,
            offload_policy=distributed_config.offload_policy,
            sequence_parallel=False,
            activation_checkpointing=False,
            dp_replicate_mesh_name="dp_replicate",
            dp_shard_cp_mesh_name="dp_shard_cp",
            tp_mesh_name="tp",
        )


_INSTALLED = False


def use_cpu_stand_ins() -> None:
    """The build-time stand-ins (module doc); idempotent, in this process only."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    os.environ["NRL_DISABLE_NUMA_BINDING"] = "1"
    import ray
    from nemo_rl.models.automodel import setup as nrl_setup

    ray.get_gpu_ids = lambda: [dist.get_rank()]  # type: ignore[assignment]
    real_init = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            real_init(*args, **kwargs)

    dist.init_process_group = init_process_group  # type: ignore[assignment]
    real_mesh = nrl_setup.create_device_mesh

    def create_device_mesh(fsdp2_config: Any, *args: Any, **kwargs: Any) -> Any:
        fsdp2_config.backend = "gloo"
        return real_mesh(fsdp2_config, *args, **kwargs)

    nrl_setup.create_device_mesh = create_device_mesh
    nrl_setup.resolve_model_class = lambda model_type: CpuAutoModel
    torch.cuda.nvtx.range_push = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.nvtx.range_pop = lambda *args, **kwargs: None  # type: ignore[assignment]


def _cpu(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class _CudaToCpu(TorchFunctionMode):
    """Tensors asked for on ``"cuda"`` are made (or moved) on the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.cuda:  # ``t.cuda()``: the tensor where it is, as on a GPU
            return args[0]
        kwargs = {k: _cpu(v) for k, v in (kwargs or {}).items()}
        args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


class _CpuAutocast(torch.autocast):
    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Around a worker call (``train``...): its ``"cuda"`` tensors and autocast on the CPU."""
    real_autocast, real_name = torch.autocast, torch.cuda.get_device_name
    torch.autocast = _CpuAutocast  # type: ignore[misc]
    torch.cuda.get_device_name = lambda *args, **kwargs: "cpu"
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.autocast = real_autocast  # type: ignore[misc]
        torch.cuda.get_device_name = real_name


def build_worker(
    config: dict[str, Any],
    *,
    ours: bool,
    weights_path: str | None = None,
    optimizer_path: str | None = None,
) -> Any:
    """NeMo-RL's ``DTensorPolicyWorkerV2Impl`` (stock), or distscaler's (``ours``), built by its
    own ``__init__`` in this process (the stand-ins above), with NeMo-RL's arguments."""
    use_cpu_stand_ins()
    from nemo_rl.models.policy.workers.dtensor_policy_worker_v2 import DTensorPolicyWorkerV2Impl

    if ours:
        import distscaler.integrations.nemo_rl as ds_nemo_rl

        cls = ds_nemo_rl.DTensorPolicyWorkerV2Impl
    else:
        cls = DTensorPolicyWorkerV2Impl
    with on_cpu():
        return cls(
            config,
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            init_optimizer=True,
            init_reference_model=False,
        )
