"""PCGrad (Yu et al. 2020, "Gradient Surgery for Multi-Task Learning"): per-task gradients that conflict
are projected onto each other's normal plane before they are summed.

For task gradients g_1 .. g_T (flattened over the trainable parameters), each g_i is visited
against every other task j in a random order; where they conflict (g_i . g_j < 0):

    g_i <- g_i - (g_i . g_j) / |g_j|^2 * g_j        (g_j the original, unprojected gradient)

and the update direction is sum_i g_i. A pair that does not conflict is left untouched.
"""

from __future__ import annotations

import torch


def pcgrad(grads: list[torch.Tensor], generator: torch.Generator | None = None) -> torch.Tensor:
    """grads: T flat (P,) task gradients -> the (P,) sum of their PCGrad projections."""
    projected = [g.clone() for g in grads]
    for i, g in enumerate(projected):
        others = [j for j in range(len(grads)) if j != i]
        for j in (others[k] for k in torch.randperm(len(others), generator=generator).tolist()):
            dot = torch.dot(g, grads[j])
            if dot < 0:
                g -= dot / grads[j].square().sum().clamp_min(1e-20) * grads[j]
    return torch.stack(projected).sum(0)


def flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """(P,) gradient of ``loss`` over ``params`` (zeros where a parameter does not reach the loss)."""
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)]
    )


def set_flat_grad(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Write a (P,) gradient into ``params``' ``.grad``, in the order of ``flat_grad``."""
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
