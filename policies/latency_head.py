"""The fast part of a latency-aware policy (ARLI: asynchronous RL with intermediate information).

A chunk requested at control step t arrives d steps later; meanwhile the robot runs the actions
it already committed to, and the world moves on. A policy that sees only the request's observation
decides from a state that is d steps stale and does not know where its own arm will be: the
process it acts in is no longer Markov, and RL on it can fail. ARLI restores the missing state
with two augmentations, both of which this module reads:

- the **committed actions** (``observation.committed_actions`` (B, D, A), ``committed_mask``
  (B, D), ``delay_steps`` (B,)): what runs between the request and the chunk's first step, i.e.
  where the arm will be when the chunk starts;
- the **mid-inference observation** (``observation.mid.state`` (B, S), ``observation.mid.images.
  <cam>`` (B, 3, S, S) for ``mid_cameras``, ``observation.mid.steps`` (B,) = m): the world m steps
  into the inference window (m = floor(mid_fraction * d), taken by `vla_core.runtime` in simulation
  and by the inference process on the robot).

The low-latency design this implies, and how the policy is split:

- **slow part**: the policy's own observation encoder on the request's observation (images,
  state, instruction) -> condition (B, F). On a robot it can start the moment the request goes out.
- **fast part** (this module), run once the mid-inference observation is in: a small copy of the
  image encoder for the mid images (initialized from the slow encoder's weights, so its keypoints
  start out meaning the same thing), then an MLP over [committed actions (normalized, masked),
  committed mask, d / D, m / D, mid state, mid state - request state, mid keypoints, mid keypoints
  - request keypoints] -> a correction added to the condition. Its last layer starts at zero, so
  before fine-tuning the policy is exactly the imitation policy it was added to.
- then the denoiser (the action head) runs on the corrected condition.

So what must run after the mid observation is the small encoder, one MLP and the denoising steps;
the slow encoder's work never waits for it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from vla_core.types import (
    OBS_COMMITTED_ACTIONS,
    OBS_COMMITTED_MASK,
    OBS_DELAY_STEPS,
    OBS_MID_STATE,
    OBS_MID_STEPS,
    mid_image_key,
)


class LatencyHead(nn.Module):
    """(observation batch with the ARLI keys, the slow part's request features) -> (B, out_dim) correction.

    image_encoders: the slow part's encoders of ``mid_cameras`` ((B, 3, S, S) -> (B, 2K)), copied
    here (their current weights are the copies' starting point). max_delay: D, the most committed
    steps read (a delay past it is refused).
    """

    def __init__(
        self,
        *,
        state_dim: int,
        action_dim: int,
        max_delay: int,
        mid_cameras: list[str],
        image_encoders: dict[str, nn.Module],
        keypoint_dim: int,
        out_dim: int,
        hidden_dim: int = 256,
    ):
        super().__init__()
        self.max_delay, self.action_dim, self.mid_cameras = max_delay, action_dim, list(mid_cameras)
        self.mid_encoders = nn.ModuleDict({cam: copy.deepcopy(image_encoders[cam]) for cam in self.mid_cameras})
        in_dim = max_delay * (action_dim + 1) + 2 + 2 * state_dim + 2 * keypoint_dim * len(self.mid_cameras)
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim), nn.Mish(), nn.Linear(hidden_dim, hidden_dim), nn.Mish(),
            nn.Linear(hidden_dim, out_dim),
        )  # fmt: skip
        nn.init.zeros_(self.mlp[-1].weight)  # the imitation policy, until fine-tuning moves it
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(
        self,
        obs: dict,
        request_state: torch.Tensor,
        request_keypoints: dict[str, torch.Tensor],
        normalize_state,
        normalize_action,
    ) -> torch.Tensor:
        """request_state: (B, S) normalized; request_keypoints: camera -> (B, 2K) of the request's
        images; normalize_*: the policy's own normalizations. Raises ValueError naming the fix when
        an ARLI key is missing or a delay exceeds D."""
        missing = [k for k in self.required_keys() if k not in obs]
        if missing:
            raise ValueError(
                f"this latency-aware policy reads {', '.join(missing)} (the committed actions and the mid-inference "
                f"observation); run it through the delay shell, which `vla-rl eval` and `vla-rl finetune` set up from "
                f"the policy's config, or configure the mid-inference source of `vla-rl serve`"
            )
        device = request_state.device
        b, d = request_state.shape[0], self.max_delay
        mask = obs[OBS_COMMITTED_MASK].to(device, torch.bool)
        committed = obs[OBS_COMMITTED_ACTIONS].to(device, torch.float32)
        if mask[:, d:].any():
            raise ValueError(
                f"{OBS_COMMITTED_MASK} commits {int(mask.sum(1).max())} steps but this latency-aware policy was "
                f"fine-tuned for delays up to {d}; keep the delay at or below {d} or fine-tune at the larger delay"
            )
        rows = min(d, mask.shape[1])
        actions = torch.zeros(b, d, self.action_dim, device=device)
        known = torch.zeros(b, d, dtype=torch.bool, device=device)
        known[:, :rows] = mask[:, :rows]
        # Rows outside the mask are padding: never read them (not even through the normalization).
        actions[:, :rows] = torch.where(known[:, :rows, None], normalize_action(committed[:, :rows]), 0.0)
        scale = max(d, 1)
        delay = obs[OBS_DELAY_STEPS].to(device, torch.float32)[:, None] / scale
        mid_steps = obs[OBS_MID_STEPS].to(device, torch.float32)[:, None] / scale
        mid_state = normalize_state(obs[OBS_MID_STATE].to(device, torch.float32))
        feats = [actions.flatten(1), known.float(), delay, mid_steps, mid_state, mid_state - request_state]
        for cam in self.mid_cameras:
            mid = self.mid_encoders[cam](obs[mid_image_key(cam)].to(device, torch.float32))
            feats += [mid, mid - request_keypoints[cam]]
        return self.mlp(torch.cat(feats, -1))

    def required_keys(self) -> list[str]:
        keys = [OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_DELAY_STEPS, OBS_MID_STATE, OBS_MID_STEPS]
        return keys + [mid_image_key(cam) for cam in self.mid_cameras]
