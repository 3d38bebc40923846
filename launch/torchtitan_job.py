"""The torchtitan job's own pieces (``launch/train_torchtitan.py``): a byte-level tokenizer and
data loader over a text corpus, the CPU config that uses them, and the config function torchtitan's
command line names (``--module torchtitan_job --config llama3_debugmodel_fp16_bytes``).

The shims torchtitan needs on CPU processes, and the tiny llama3, are the shared helpers'
(``launch/common/torchtitan_cpu.py``); call :func:`~common.torchtitan_cpu.apply_cpu_shims` before
anything here imports torchtitan.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from common.torchtitan_cpu import cpu_settings

__all__ = ["ByteDataLoader", "ByteTokenizer", "cpu_config", "llama3_debugmodel_fp16_bytes"]


def _define() -> None:
    """The tokenizer and data loader classes subclass torchtitan's, so they are defined once
    torchtitan imports (after :func:`apply_cpu_shims`)."""
    global ByteTokenizer, ByteDataLoader
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class _ByteTokenizer(BaseTokenizer):
        """Bytes as tokens (vocabulary 256): nothing to download."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any = None, **kwargs: Any) -> None:
            super().__init__()

        def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
            return list(text.encode())

        def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
            return bytes(ids).decode(errors="replace")

        def get_vocab_size(self) -> int:
            return 256

    class _ByteDataLoader(BaseDataLoader):
        """Windows of ``seq_len + 1`` bytes of a text corpus, batch after batch, each data-parallel
        rank its own: ``({"input": (B, L) int64}, labels (B, L) int64)``. The corpus is
        ``dataset_path`` (a file or folder) or, empty, this interpreter's standard library sources
        (the reference job's data); ``dataset`` is ignored. Deterministic; its position is its
        checkpoint state."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            max_bytes: int = 4_000_000
            """Bytes of the corpus read (from its start)."""

        def __init__(
            self,
            config: Any,
            *,
            dp_world_size: int,
            dp_rank: int,
            tokenizer: Any,
            seq_len: int,
            local_batch_size: int,
            **kwargs: Any,
        ) -> None:
            self.data = _corpus(config.dataset_path, config.max_bytes)
            self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
            self.seq_len, self.batch = seq_len, local_batch_size
            self.position = 0

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            span = self.seq_len + 1
            per_batch = self.batch * span
            while True:
                start = (self.position * self.dp_world_size + self.dp_rank) * per_batch
                start %= len(self.data) - per_batch
                window = self.data[start : start + per_batch].long().view(self.batch, span)
                self.position += 1
                yield {"input": window[:, :-1].contiguous()}, window[:, 1:].contiguous()

        def state_dict(self) -> dict[str, Any]:
            return {f"position_dp{self.dp_rank}": self.position}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.position = int(state_dict.get(f"position_dp{self.dp_rank}", self.position))

    ByteTokenizer = _ByteTokenizer
    ByteDataLoader = _ByteDataLoader


ByteTokenizer: Any = None
ByteDataLoader: Any = None


def _corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    from lm.data import data_files

    blob = bytearray()
    for f in data_files(path or None):
        blob += f.read_bytes()
        if len(blob) >= max_bytes:
            break
    return torch.frombuffer(blob[:max_bytes], dtype=torch.uint8)


def cpu_config(
    config: Any, *, data: str | None = None, seq_len: int = 32, max_bytes: int = 4_000_000
) -> Any:
    """``config`` (a ``Trainer.Config``) set up for CPU processes: the byte tokenizer and data,
    and the CPU settings of ``common.torchtitan_cpu`` (:func:`~common.torchtitan_cpu.cpu_settings`)."""
    if ByteTokenizer is None:
        _define()
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = ByteDataLoader.Config(dataset_path=data, max_bytes=max_bytes)
    return cpu_settings(config, seq_len=seq_len)


def llama3_debugmodel_fp16_bytes() -> Any:
    """A config function for torchtitan's command line (``--module torchtitan_job --config
    llama3_debugmodel_fp16_bytes``): torchtitan's llama3 debug config in fp16 with distscaler
    (``distscaler.integrations.torchtitan.fp16``), shrunk and on byte data by :func:`cpu_config`."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from distscaler.integrations.torchtitan import fp16

    return cpu_config(fp16(llama3_debugmodel()))
