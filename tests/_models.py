"""A tiny model and a training loop shared by the single-process tests."""

from __future__ import annotations

import torch
from _common import FAULTS, make_optimizer


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 4),
    )


def train(
    scaler,
    opt_kind: str,
    *,
    steps: int,
    faults: dict[int, tuple[str, int]] | None = None,
    clip: str | None = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    start: int = 0,
    max_norm: float = 0.5,
):
    """Train ``steps`` steps; ``faults[step] = (kind, param_index)`` writes a non-finite gradient.

    ``clip``: None, ``"ours"`` (``scaler.clip_grad_norm_``) or ``"torch"`` (``unscale_`` then
    ``torch.nn.utils.clip_grad_norm_``), both to ``max_norm``. Returns (model, optimizer,
    per-step scales after update).
    """
    faults = faults or {}
    model = model or make_model()
    opt = optimizer or make_optimizer(opt_kind, model.parameters())
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1234)
    for _ in range(start):
        torch.randn(16, 8, generator=gen)
    scales = []
    for step in range(start, start + steps):
        x = torch.randn(16, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in faults:
            kind, index = faults[step]
            params[index % len(params)].grad.view(-1)[0] = FAULTS[kind]
        if clip == "ours":
            scaler.clip_grad_norm_(opt, max_norm=max_norm)
        elif clip == "torch":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, opt, scales
