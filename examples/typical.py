"""Typical mixed-precision training: autocast for the forward pass, the scaler for the backward.

    python examples/typical.py

torch's "Typical Mixed Precision Training" with one change: the import. On a GPU it runs on the
GPU; on the CPU it runs fp16 autocast too (this model is tiny: fp16 matmuls are slow on CPUs
without fp16 units, see docs/troubleshooting.md).
"""

import torch

from distscaler import GradScaler

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(
    device
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
# Created once, at the start of training. Same positional arguments and defaults as torch's.
scaler = GradScaler(device)

for _ in range(20):
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    optimizer.zero_grad(set_to_none=True)
    # The forward pass (model and loss) under autocast; the backward pass outside it.
    with torch.autocast(device, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    # Scales the loss and calls backward() on it: scaled gradients.
    scaler.scale(loss).backward()
    # Unscales the gradients, then calls optimizer.step() unless they hold inf/NaN.
    scaler.step(optimizer)
    # Updates the scale for the next iteration.
    scaler.update()

totals = scaler.skip_totals
print(
    f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
)
