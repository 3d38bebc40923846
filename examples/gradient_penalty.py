"""Gradient penalty: a loss term made of the gradients themselves.

    python examples/gradient_penalty.py

torch's recipe, unchanged but for the import: ``torch.autograd.grad`` of the *scaled* loss gives
scaled gradients, which are unscaled by hand (they are not the ``.grad`` the optimizer owns, so
``scaler.unscale_`` does not apply) before the penalty is computed. An inf/NaN in them makes the
penalty, hence the final gradients, inf/NaN too, and ``step`` skips.
"""

import torch

from distscaler import GradScaler

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(
    device
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = GradScaler(device)

for _ in range(20):
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 1, device=device)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)

    # Scaled gradients of the loss, kept in the graph (create_graph=True) for the penalty.
    scaled_grads = torch.autograd.grad(
        outputs=scaler.scale(loss), inputs=list(model.parameters()), create_graph=True
    )
    # Unscaled by hand (get_scale() reads the scale on the host: one sync per step).
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]

    # The penalty term, added to the loss under autocast.
    with torch.autocast(device, dtype=torch.float16):
        grad_norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + 0.1 * grad_norm

    # From here on, the typical loop.
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

totals = scaler.skip_totals
print(
    f"skipped steps: {totals.num_skipped} of {totals.num_updates}, final scale: {scaler.get_scale():g}"
)
