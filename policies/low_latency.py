"""ARLI's low-latency policy: a small network that acts every control step, inside the inference window.

A chunk requested at step t arrives d steps later, and until the next one arrives the robot runs rows
planned from observations d to d + s steps old: under a delay of 8 steps a scripted expert acting on that
information reaches about 0.58 of what it reaches without delay (`vla-rl bench latency-rl`'s probe).
ARLI's answer is a second, fast policy that acts every control step on the freshest observation, with the
slow policy's plan as its prior. This module is that fast policy; the slow policy (the VLA) is unchanged and
the latency protocol (`vla_core.runtime`) calls it every control step, in simulation and on the robot alike.

What it reads at step t (`LowLatencyInputs`, built by the slow policy's `low_latency_inputs`, normalized with
its statistics):

- the freshest observation: ``observation.state`` and the images of ``cameras``, through small keypoint
  CNNs that start as copies of the slow policy's own encoders (so their keypoints already mean what the
  slow policy's mean: where the object is);
- the plan: the next ``rows`` actions the queue holds from step t on (the committed actions, then the rest
  of the chunk running now; `vla_core.runtime.ActionChunkExecutor.upcoming`), and which are queued;
- its place in the window: the age of the plan's information (t minus the step the running chunk was
  conditioned on; none before an episode's first chunk arrives) and the steps since the latest request.

What it does: a correction delta (A,) in the slow policy's normalized action units, added to the plan's row
for step t (the base action; before the first chunk arrives, the env's hold action, so it acts on its own
from step 0). Its output layer starts at zero, so until it is trained the robot runs exactly the slow
policy. RL samples delta ~ N(mu, sigma^2) with a learned, state-independent sigma (`LowLatencyActor`), one
decision per control step: the process it acts in is Markov again (fresh state, plan, ages).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LowLatencyInputs:
    """One control step's inputs for B worlds, normalized: ``state`` (B, S); ``images`` camera -> (B, 3, S, S) in
    [0, 1]; ``plan`` (B, R, A) and ``plan_mask`` (B, R) bool; ``plan_age`` (B,) float, the plan's information age
    over ``max_age`` (-1: no plan yet); ``since_request`` (B,) float, steps since the latest request over
    ``max_age``."""

    state: torch.Tensor
    images: dict[str, torch.Tensor]
    plan: torch.Tensor
    plan_mask: torch.Tensor
    plan_age: torch.Tensor
    since_request: torch.Tensor


class LowLatencyPolicy(nn.Module):
    """`LowLatencyInputs` -> (mean correction (B, A), features (B, hidden)); ``log_std`` (A,) its exploration.

    image_encoders: the slow policy's encoders of ``cameras`` ((B, 3, S, S) -> (B, keypoint_dim)), copied here;
    rows: R, the plan rows it reads; max_age: the scale of the ages (the largest delay it is made for plus a
    chunk's steps).
    """

    def __init__(self, *, state_dim: int, action_dim: int, cameras: list[str], image_encoders: dict[str, nn.Module],
                 keypoint_dim: int, rows: int, max_age: int, hidden_dim: int = 256, init_std: float = 0.05):  # fmt: skip
        super().__init__()
        if rows < 1 or max_age < 1 or not init_std > 0:
            raise ValueError(
                f"low-latency rows and max_age must be >= 1 and init_std > 0, got {rows}, {max_age}, {init_std}"
            )
        self.cameras, self.rows, self.max_age, self.action_dim = list(cameras), rows, max_age, action_dim
        self.encoders = nn.ModuleDict({cam: copy.deepcopy(image_encoders[cam]) for cam in self.cameras})
        in_dim = state_dim + keypoint_dim * len(self.cameras) + rows * (action_dim + 1) + 3
        self.body = nn.Sequential(
            nn.Linear(in_dim, hidden_dim), nn.Mish(), nn.Linear(hidden_dim, hidden_dim), nn.Mish()
        )
        self.mean = nn.Linear(hidden_dim, action_dim)
        nn.init.zeros_(self.mean.weight)  # the slow policy's actions, until it is trained
        nn.init.zeros_(self.mean.bias)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(torch.tensor(init_std).log())))

    def forward(self, inputs: LowLatencyInputs) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [inputs.state]
        parts += [self.encoders[cam](inputs.images[cam]) for cam in self.cameras]
        mask = inputs.plan_mask.to(inputs.plan.dtype)
        has_plan = (inputs.plan_age >= 0).to(inputs.plan.dtype)
        parts += [(inputs.plan * mask[..., None]).flatten(1), mask, inputs.plan_age[:, None].clamp(min=0),
                  has_plan[:, None], inputs.since_request[:, None]]  # fmt: skip
        features = self.body(torch.cat(parts, -1))
        return self.mean(features), features

    def log_prob(self, inputs: LowLatencyInputs, delta: torch.Tensor) -> torch.Tensor:
        """(B,) log N(delta; mu(inputs), sigma^2), summed over the action's dimensions, with autograd."""
        mean, _ = self(inputs)
        return torch.distributions.Normal(mean, self.log_std.exp()).log_prob(delta).sum(-1)
