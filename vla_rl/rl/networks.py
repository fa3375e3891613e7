"""Small networks the learners share."""

from __future__ import annotations

from torch import nn


def mlp(inputs: int, hidden: int, outputs: int, layer_norm: bool = False) -> nn.Sequential:
    """Two hidden layers of ``hidden`` with GELU (each after a LayerNorm when ``layer_norm``, as critics want)."""
    layers: list[nn.Module] = []
    for size in (inputs, hidden):
        layers += [nn.Linear(size, hidden), *([nn.LayerNorm(hidden)] if layer_norm else []), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(hidden, outputs))
