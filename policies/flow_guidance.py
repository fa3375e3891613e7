"""Real-time-chunking guidance of a flow sampler: one definition for every flow policy.

Black et al. 2025 ("Real-Time Execution of Action Chunking Flow Policies"): while the robot executes
the previous chunk, the next one is sampled so that its first steps follow what is already queued.
Each Euler step's velocity is corrected by pseudo-inverse guidance (PiGDM) on the chunk the velocity
leads to at t = 0. Time runs as in openpi and LeRobot: t = 1 is noise, t = 0 the actions, x_t = t *
noise + (1 - t) * actions, so the velocity is noise - actions and the clean chunk is x - t * v.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_MAX_GUIDANCE = 5.0  # the paper's clip of the guidance weight


def guided_velocity(
    velocity: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    t: float,
    target: torch.Tensor,
    weights: torch.Tensor,
    max_guidance: float = DEFAULT_MAX_GUIDANCE,
    time: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The velocity at x, corrected so the predicted clean chunk moves toward ``target`` where weights > 0.

    velocity: x -> v, differentiable in x; x, target: (B, ..., H, A) normalized; weights broadcastable to
    x, in [0, 1]; t: the sampler's time in (0, 1]; time: the time each element of x is at, when it is not
    t everywhere (a known, clean step sits at 0), broadcastable to x. Returns v (detached) - beta * J^T
    (weights * (target - clean)), beta the guidance weight of RTC eq. 5 clipped at ``max_guidance``.
    """
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        v = velocity(x)
        clean = x - (t if time is None else time) * v
        error = (target - clean) * weights
        (grad,) = torch.autograd.grad(clean, x, error)  # J^T error
    s = 1.0 - t  # time measured from noise, as in the paper
    r2 = (1 - s) ** 2 / (s**2 + (1 - s) ** 2)
    beta = min(max_guidance, (1 - s) / max(s * r2, 1e-8))
    # Integration runs x <- x - v dt, so subtracting the gradient pushes the chunk toward the target.
    return v.detach() - beta * grad
