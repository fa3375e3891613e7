"""A small image encoder that localizes objects precisely from few demonstrations: a 3-layer CNN ending
in spatial softmax (learned keypoints). The ``diffusion`` policy's vision, and the mid-inference image
encoder of a latency head (`policies.latency_head`) of a policy that has none of its own."""

from __future__ import annotations

import torch
from torch import nn


class SpatialSoftmax(nn.Module):
    """(B, C, h, w) feature maps -> (B, 2K) expected image coordinates of K learned keypoints."""

    def __init__(self, in_channels: int, num_keypoints: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, num_keypoints, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        attn = self.proj(x).flatten(2).softmax(-1)  # (B, K, h*w)
        ys = torch.linspace(-1, 1, h, device=x.device)
        xs = torch.linspace(-1, 1, w, device=x.device)
        grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij"), -1).reshape(h * w, 2)
        return (attn @ grid).reshape(b, -1)


class ImageEncoder(nn.Module):
    """(B, 3, S, S) in [0, 1] -> (B, 2K) keypoint coordinates."""

    def __init__(self, channels: int, num_keypoints: int):
        super().__init__()
        c = channels
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 3, stride=2, padding=1), nn.GroupNorm(8, c), nn.Mish(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * c), nn.Mish(),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.GroupNorm(8, 2 * c), nn.Mish(),
        )  # fmt: skip
        self.keypoints = SpatialSoftmax(2 * c, num_keypoints)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.keypoints(self.net(image * 2.0 - 1.0))
