"""Tiny denoising policies for the policy tests (training-time RTC, RL log-probabilities)."""

import torch

from policies.diffusion import DiffusionConfig
from policies.diffusion.modeling_diffusion import DiffusionPolicy
from policies.diffusion_vla import DiffusionVLAConfig
from policies.diffusion_vla.modeling_diffusion_vla import DiffusionVLAPolicy
from policies.pretrained import PreTrainedPolicy
from policies.tokenizer import word_vocabulary

TASK = "pick up the red cube"
H, A = 6, 2
ACTION_MIN, ACTION_MAX = [-2.0, 0.0], [2.0, 1.0]


def make_policy(kind: str, max_delay_steps: int = 0) -> PreTrainedPolicy:
    """A tiny policy of ``kind``, eval mode, with every weight random (the VLA's AdaLN-Zero gates too,
    so a token can see the others), horizon 6, actions in [-2, 2] x [0, 1], 16 px images.

    kind: ``diffusion`` (the small policy), ``diffusion-flow`` (the small policy, flow objective), ``flow``
    or ``ddpm`` (the VLA with that objective), or ``ddpm-sampler`` (the VLA, ddpm objective, whose
    deterministic sampler is DDPM, not DDIM).
    """
    torch.manual_seed(0)
    shared = {"state_dim": 3, "action_dim": A, "cameras": ["front"], "image_size": 16, "horizon": H,
              "n_action_steps": 2, "vocabulary": word_vocabulary([TASK]), "max_delay_steps": max_delay_steps}  # fmt: skip
    if kind.startswith("diffusion"):
        objective = "flow" if kind == "diffusion-flow" else "ddpm"
        policy = DiffusionPolicy(DiffusionConfig(**shared, vision_channels=8, num_keypoints=4, text_dim=8,
                                                 hidden_dim=32, num_blocks=2, objective=objective))  # fmt: skip
    else:
        objective = "flow" if kind == "flow" else "ddpm"
        sampler = "ddpm" if kind == "ddpm-sampler" else "ddim"
        policy = DiffusionVLAPolicy(DiffusionVLAConfig(**shared, patch_size=8, dim=32, depth=1, heads=2,
                                                       vision_width=32, vision_layers=1, text_width=32,
                                                       objective=objective, ddpm_sampler=sampler))  # fmt: skip
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in policy.dit.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    policy.set_normalization([0.0] * 3, [1.0] * 3, ACTION_MIN, ACTION_MAX)
    return policy.eval()


def save_lift_flow_policy(
    directory, image_size: int = 64, horizon: int = 8, n_action_steps: int = 4
) -> DiffusionPolicy:
    """A random flow `diffusion` policy for the lift env (front camera ``image_size`` px, 11 states, 4 actions,
    chunks of ``horizon`` (8), ``n_action_steps`` (4) executed, 4 Euler steps, actions in [-1, 1]), saved to
    ``directory``; returns it."""
    torch.manual_seed(0)
    policy = DiffusionPolicy(DiffusionConfig(
        state_dim=11, action_dim=4, cameras=["front"], image_size=image_size, horizon=horizon,
        n_action_steps=n_action_steps, vocabulary=word_vocabulary([TASK]), vision_channels=8, num_keypoints=8, text_dim=8, hidden_dim=32,
        num_blocks=2, num_inference_steps=4, objective="flow",
    ))  # fmt: skip
    policy.set_normalization([0.0] * 11, [1.0] * 11, [-1.0] * 4, [1.0] * 4)
    policy.save_pretrained(directory)
    return policy
