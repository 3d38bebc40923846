"""Gradient clipping: the norm of the unscaled gradients, in the same pass as the inf/NaN check.

    python examples/clipping.py

torch's recipe unscales first (``scaler.unscale_(optimizer)``), then calls
``torch.nn.utils.clip_grad_norm_``. That still works here, for a single process. distscaler's
``scaler.clip_grad_norm_(optimizer, max_norm)`` does both in one call: it returns the norm of the
unscaled gradients and clips them; with several ranks the norm is the global one, folded into the
step's single collective (see examples/ddp.py).
"""

import torch

from distscaler import GradScaler

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(
    device
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = GradScaler(device)

for _ in range(20):
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    # The norm before clipping (a 0-dim float32 tensor: no host read); inf/NaN when the gradients
    # overflowed, and then step() skips.
    norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()

    # torch's way, for comparison (single process only; one or the other, not both):
    #   scaler.unscale_(optimizer)
    #   norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)

totals = scaler.skip_totals
print(f"last norm: {norm.item():.3f}")
print(
    f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
)
