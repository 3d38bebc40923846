"""``TrainConfig``: every setting of the job, loaded from YAML and validated with pydantic.

The scaler's settings are a ``distscaler.ScalerConfig`` nested under ``scaler:``; the library
validates them (once, when the config is loaded) and ``GradScaler.from_config`` builds the scaler.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BeforeValidator,
    ConfigDict,
    PlainValidator,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import ErrorDetails

from distscaler import ScalerConfig

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_SCALER",
    "ConfigError",
    "InjectInf",
    "TrainConfig",
    "load_config",
]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"

#: The job's scaler: far too high a start (2**20) for fp16 gradients, so the first steps overflow,
#: are skipped on every rank and back off; then a growth every 25 clean steps until fp16 overflows
#: again. A ``scaler:`` section in a YAML file changes the keys it names and keeps the others.
#: The job checks the replicas at every update (its fault injection shows the check; the library's
#: default is every 32nd update with torch's kernels).
DEFAULT_SCALER = ScalerConfig(init_scale=2.0**20, growth_interval=25, replica_check_interval=1)


class ConfigError(ValueError):
    """Every problem found in a config, reported together so that one pass fixes them all."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"- {p}" for p in problems))


def _float_from_yaml_string(value: Any) -> Any:
    # PyYAML follows YAML 1.1, where "1e-3" (no dot) is a string, not a float.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # left for the float check to report
    return value


# Strict: YAML's `true` is not 1, and 2.5 is not an int. A float field takes an int.
YamlFloat = Annotated[float, BeforeValidator(_float_from_yaml_string), Strict()]


def _as_float(value: Any) -> Any:
    """A YAML number for a float field: "1e-3" (a string to PyYAML) and 1024 become floats."""
    value = _float_from_yaml_string(value)
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


_SCALER_FLOAT_FIELDS = frozenset(
    f.name for f in dataclasses.fields(ScalerConfig) if str(f.type).startswith("float")
)


def _scaler_config(value: Any) -> ScalerConfig:
    """The ``scaler:`` section: ``DEFAULT_SCALER`` with the keys given, checked by ScalerConfig."""
    if isinstance(value, ScalerConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError([f"scaler must be a mapping, got: {value!r}"])
    valid = [f.name for f in dataclasses.fields(ScalerConfig)]
    unknown = [k for k in value if k not in valid]
    if unknown:
        raise ConfigError(
            [f"unknown config key 'scaler.{k}'; valid keys: {', '.join(valid)}" for k in unknown]
        )
    changes = {k: _as_float(v) if k in _SCALER_FLOAT_FIELDS else v for k, v in value.items()}
    try:
        return dataclasses.replace(DEFAULT_SCALER, **changes)
    except (TypeError, ValueError) as e:
        lines = [line[2:] for line in str(e).splitlines() if line.startswith("- ")]
        raise ConfigError([f"scaler: {line}" for line in lines or [str(e)]]) from None


# The nested ScalerConfig is validated by distscaler itself, not field by field by pydantic.
ScalerSection = Annotated[ScalerConfig, PlainValidator(_scaler_config)]

# Lax at the dataclass level (strict would refuse the YAML mappings themselves); the field types
# above are what make the values strict.
_PYDANTIC_CONFIG = ConfigDict(extra="forbid")


@dataclass(kw_only=True, slots=True)
class InjectInf:
    """Fault injection: write an inf into one gradient on one rank, after backward.

    With DDP the gradients are already all-reduced at that point, so only ``rank`` sees the inf;
    the scaler must still make every rank skip the step and back off.
    """

    __pydantic_config__ = _PYDANTIC_CONFIG

    steps: list[StrictInt] = field(default_factory=list)
    """Optimizer steps (1-based) at which to inject."""
    rank: StrictInt = 1
    """Global rank that injects; must be in [0, world_size)."""

    def __post_init__(self) -> None:
        problems = []
        bad = [s for s in self.steps if s < 1]
        if bad:
            problems.append(f"inject_inf.steps must be >= 1, got: {bad}")
        if self.rank < 0:
            problems.append(f"inject_inf.rank must be >= 0, got: {self.rank}")
        if problems:
            raise ConfigError(problems)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Every setting of the job. YAML keys and ``--flags`` use these names."""

    __pydantic_config__ = _PYDANTIC_CONFIG

    # -- run --
    steps: StrictInt = 200
    """Total number of optimizer steps (a resumed run continues up to this number)."""
    out: StrictStr = "runs/default"
    """Output folder for metrics.jsonl, ckpt.pt and summary.json."""
    seed: StrictInt = 1337
    """Seed for model init; data-parallel replica r samples batches with seed + r."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: ``cuda:$LOCAL_RANK`` with NCCL where CUDA is available, else the CPU with gloo."""
    num_threads: StrictInt = 0
    """CPU threads per process; 0 = usable cores // processes on this node (at least 1)."""
    ckpt_interval: StrictInt = 50
    """Checkpoint interval, in steps (a checkpoint is also written at the end); 0 = only at end."""
    log_interval: StrictInt = 25
    """Interval, in steps, of the log lines (the progress bar updates every step)."""
    eval_interval: StrictInt = 50
    """Interval, in steps, of held-out evaluation (always done at the end); 0 = only at end."""
    eval_windows: StrictInt = 128
    """Number of fixed, evenly spaced held-out windows (of block_size bytes) per evaluation."""
    dist_timeout_s: YamlFloat = 300.0
    """Seconds a collective, or the start of the process group, waits for the other ranks before
    it fails (torch's default, 30 minutes on gloo, makes a lost rank look like a hang)."""

    # -- data --
    data: StrictStr | None = None
    """Text file or folder to train on; None = the stdlib sources of this interpreter."""
    eval_fraction: YamlFloat = 0.05
    """Fraction of the bytes, taken from the end, held out for evaluation, in (0, 0.5]."""
    block_size: StrictInt = 64
    """Context length, in bytes (tokens)."""
    batch_size: StrictInt = 16
    """Sequences per data-parallel replica per step (the ranks of one tensor-parallel group or
    one pipeline share a batch; every rank is a replica under ddp, fsdp1, fsdp2 and hsdp)."""

    # -- layout over the ranks (launch/lm/parallel.py) --
    parallelism: Literal["ddp", "fsdp1", "fsdp2", "hsdp", "tp", "pp"] = "ddp"
    """How the model is laid out over the ranks: ``ddp`` (replicated), ``fsdp1``
    (FullyShardedDataParallel, FULL_SHARD, use_orig_params), ``fsdp2`` (``fully_shard`` per block
    and the root, 1-D mesh), ``hsdp`` (``fully_shard`` on a 2-D (replicate, shard) mesh), ``tp``
    (tensor parallel over the attention and MLP linears; with more ranks than ``tp_size``, FSDP2
    over the data-parallel dimension of a 2-D (dp, tp) mesh), ``pp`` (``pp_stages`` pipeline
    stages; with more ranks, DDP over each stage's data-parallel replicas)."""
    hsdp_shard_size: StrictInt = 2
    """``hsdp``: ranks per shard group (the mesh's inner dimension); the world size must be a
    multiple of it with at least 2 replicas."""
    tp_size: StrictInt = 2
    """``tp``: ranks per tensor-parallel group; the world size must be a multiple of it."""
    pp_stages: StrictInt = 2
    """``pp``: number of pipeline stages; the world size must be a multiple of it."""
    pp_microbatches: StrictInt = 2
    """``pp``: micro-batches per step; must divide batch_size."""
    pp_schedule: Literal["gpipe", "1f1b"] = "gpipe"
    """``pp``: ``ScheduleGPipe`` or ``Schedule1F1B`` of torch.distributed.pipelining."""

    # -- model --
    n_layer: StrictInt = 2
    n_head: StrictInt = 2
    d_model: StrictInt = 64
    dropout: YamlFloat = 0.0

    # -- optimizer --
    lr: YamlFloat = 2e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr: YamlFloat = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: StrictInt = 20
    """Linear warmup length, in steps."""
    decay_steps: StrictInt = 0
    """Step at which the cosine decay reaches min_lr; 0 = ``steps``. Fix it to resume a run
    with a larger ``--steps`` on the same schedule."""
    weight_decay: YamlFloat = 0.1
    """AdamW weight decay, applied to weight matrices and embeddings, not to biases and norms."""
    beta1: YamlFloat = 0.9
    beta2: YamlFloat = 0.95
    max_norm: YamlFloat = 1.0
    """Gradient clipping threshold on the global norm of the unscaled gradients."""

    # -- mixed precision / scaler --
    amp: StrictBool = True
    """fp16 autocast and loss scaling; False = fp32 with a disabled scaler."""
    scaler: ScalerSection = DEFAULT_SCALER
    """``distscaler.ScalerConfig`` of the job's ``GradScaler`` (``GradScaler.from_config``); in
    YAML a mapping of its fields (``init_scale``, ``growth_interval``, ``policy``...)."""
    inject_inf: InjectInf | None = None
    """Fault injection, e.g. ``{steps: [40], rank: 1}``; None = off."""

    def __post_init__(self) -> None:
        problems = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        need(self.steps >= 1, f"steps must be >= 1, got: {self.steps}")
        need(self.num_threads >= 0, f"num_threads must be >= 0, got: {self.num_threads}")
        for name in ("ckpt_interval", "log_interval", "eval_interval"):
            value = getattr(self, name)
            need(value >= 0, f"{name} must be >= 0, got: {value}")
        need(self.eval_windows >= 1, f"eval_windows must be >= 1, got: {self.eval_windows}")
        need(
            0.0 < self.eval_fraction <= 0.5,
            f"eval_fraction must be in (0, 0.5], got: {self.eval_fraction}",
        )
        for name in ("block_size", "batch_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            need(value >= 1, f"{name} must be >= 1, got: {value}")
        need(
            self.d_model % self.n_head == 0,
            f"d_model must be a multiple of n_head, got: d_model={self.d_model}, "
            f"n_head={self.n_head}",
        )
        for name in ("hsdp_shard_size", "tp_size", "pp_microbatches"):
            value = getattr(self, name)
            need(value >= 1, f"{name} must be >= 1, got: {value}")
        need(self.pp_stages >= 2, f"pp_stages must be >= 2, got: {self.pp_stages}")
        need(
            self.parallelism != "pp"
            or self.pp_microbatches < 1
            or self.batch_size % self.pp_microbatches == 0,
            f"batch_size must be a multiple of pp_microbatches, got: batch_size="
            f"{self.batch_size}, pp_microbatches={self.pp_microbatches}",
        )
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got: {self.dropout}")
        need(self.lr > 0, f"lr must be > 0, got: {self.lr}")
        need(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr], got: {self.min_lr}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got: {self.warmup_steps}")
        need(self.decay_steps >= 0, f"decay_steps must be >= 0, got: {self.decay_steps}")
        need(self.max_norm > 0, f"max_norm must be > 0, got: {self.max_norm}")
        need(
            self.dist_timeout_s > 0,
            f"dist_timeout_s must be > 0 (seconds), got: {self.dist_timeout_s}",
        )
        if problems:
            raise ConfigError(problems)


# pydantic error types -> what the value must be, in the words of our messages.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dataclass_type": "a mapping",
}


def _key(loc: tuple[int | str, ...]) -> str:
    """``("inject_inf", "steps", 0)`` -> ``"inject_inf.steps[0]"``."""
    key = ""
    for part in loc:
        if not key:
            key = str(part)
        else:
            key += f"[{part}]" if isinstance(part, int) else f".{part}"
    return key


def _dataclass_at(loc: tuple[int | str, ...]) -> Any:
    """The config dataclass that the keys at ``loc`` belong to (``()``: ``TrainConfig``)."""
    cls: Any = TrainConfig
    for part in loc:
        hint = typing.get_type_hints(cls).get(str(part))
        cls = next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)
        if cls is None:
            return None
    return cls


def _problems(error: ErrorDetails) -> list[str]:
    """One pydantic error as our messages: the key, what it must be, the value given."""
    loc, value = error["loc"], error["input"]
    key = _key(loc)
    if error["type"] in ("unexpected_keyword_argument", "invalid_key"):
        cls = _dataclass_at(loc[:-1])
        valid = f"; valid keys: {', '.join(f.name for f in dataclasses.fields(cls))}" if cls else ""
        return [f"unknown config key '{key}'{valid}"]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # a __post_init__ range check: keep its list flat
        return cause.problems
    if error["type"] in _EXPECTED:
        return [f"{key} must be {_EXPECTED[error['type']]}, got: {value!r}"]
    if error["type"] == "literal_error":
        return [f"{key} must be one of {error['ctx']['expected']}, got: {value!r}"]
    return [f"{key or 'config'}: {error['msg']}, got: {value!r}"]


def load_config(path: str | os.PathLike | None, **overrides: Any) -> TrainConfig:
    """Returns the dataclass defaults, overridden by the YAML file ``path``, then by ``overrides``.

    Overrides whose value is None are ignored (an absent command-line flag). Raises
    ``ConfigError`` listing every unknown key and bad value; the range checks of
    ``TrainConfig.__post_init__`` run (and are listed together) once every value has its type.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(
                f"config file {path} must hold a mapping, got: {type(loaded).__name__}"
            )
        raw = dict(loaded or {})
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return TypeAdapter(TrainConfig).validate_python(raw)
    except ValidationError as e:
        raise ConfigError([p for error in e.errors() for p in _problems(error)]) from None
