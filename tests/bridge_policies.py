"""Small deterministic policies and loaders for the bridge tests (module-level, so they pickle into a worker)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from robot_bridge.config import SIM_ACTION_NAMES, SIM_STATE_NAMES
from vla_core.types import OBS_STATE, TASK, ActionChunk, image_key

IMAGE_SIZE = 16
RAISE_INSTRUCTION = "raise"  # the instruction that makes RampPolicy raise
STEP = 0.001  # metres per control step of the ramp


class RampPolicy:
    """Chunk j (absolute): ee_x of the observed state + STEP * (j + 1), ee_y and ee_z as observed, grip 0.5.

    With ``delta=True`` every action is (STEP, 0, 0, 0). Raises when the instruction is RAISE_INSTRUCTION.
    ``n_action_steps`` is told to the bridge only when given.
    """

    def __init__(self, horizon: int = 8, delta: bool = False, n_action_steps: int | None = None):
        self.config = SimpleNamespace(
            horizon=horizon, image_size=IMAGE_SIZE, state_dim=len(SIM_STATE_NAMES), action_dim=len(SIM_ACTION_NAMES)
        )
        if n_action_steps is not None:
            self.config.n_action_steps = n_action_steps
        self.delta = delta

    def predict_chunk(self, obs, obs_step=None) -> ActionChunk:
        if obs[TASK][0] == RAISE_INSTRUCTION:
            raise RuntimeError("injected policy failure")
        image = obs[image_key("front")]
        assert image.shape == (1, 3, IMAGE_SIZE, IMAGE_SIZE) and 0 <= image.min() and image.max() <= 1
        h = self.config.horizon
        steps = torch.arange(1, h + 1, dtype=torch.float32)
        if self.delta:
            actions = torch.zeros(1, h, 4)
            actions[..., 0] = STEP
        else:
            ee = obs[OBS_STATE][0, 8:11].float()
            actions = torch.cat([ee.expand(h, 3), torch.full((h, 1), 0.5)], dim=1)[None].clone()
            actions[0, :, 0] += STEP * steps
        return ActionChunk(actions, obs_step if obs_step is not None else torch.zeros(1, dtype=torch.long))


def ramp_policy(horizon: int = 8, delta: bool = False, n_action_steps: int | None = None) -> RampPolicy:
    return RampPolicy(horizon, delta, n_action_steps)


class SideStepPolicy(RampPolicy):
    """A RampPolicy with a low-latency part: every tick it sets ee_y to the freshest state's ee_y + STEP (the
    ramp's chunks keep ee_y as observed), whatever the base action, queued or held."""

    def __init__(self):
        super().__init__(horizon=8)
        self.config.low_latency, self.config.low_latency_rows = True, 2
        self.calls = 0  # of the low-latency part

    def low_latency_step(self, obs, base, context):
        self.calls += 1
        assert context.plan.shape == (1, 2, 4) and obs[image_key("front")].shape == (1, 3, IMAGE_SIZE, IMAGE_SIZE)
        out = base.clone()
        out[:, 1] = obs[OBS_STATE][:, 9].float() + STEP
        return out


def side_step_policy() -> SideStepPolicy:
    return SideStepPolicy()


class BadChunkPolicy(RampPolicy):
    """A RampPolicy whose calls numbered in ``bad`` (1-based) return an unusable chunk: "nan" puts one
    NaN at step 2, ee_y; "shape" drops the last action dim (grip)."""

    def __init__(self, bad: dict[int, str]):
        super().__init__(horizon=8)
        self.bad = bad
        self.calls = 0

    def predict_chunk(self, obs, obs_step=None) -> ActionChunk:
        chunk = super().predict_chunk(obs, obs_step)
        self.calls += 1
        kind = self.bad.get(self.calls)
        if kind == "nan":
            actions = chunk.actions.clone()
            actions[0, 2, 1] = float("nan")
            return ActionChunk(actions, chunk.obs_step)
        if kind == "shape":
            return ActionChunk(chunk.actions[..., :3].contiguous(), chunk.obs_step)
        return chunk


def bad_chunk_policy() -> BadChunkPolicy:
    """Chunk 3 carries a NaN, chunk 5 is one action dim short; the rest are good."""
    return BadChunkPolicy({3: "nan", 5: "shape"})


def random_diffusion_policy():
    """The project's DiffusionPolicy with random weights, sized for the sim robot (64x64 front camera)."""
    from policies.diffusion import DiffusionConfig
    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from policies.tokenizer import word_vocabulary

    torch.manual_seed(0)
    config = DiffusionConfig(
        state_dim=len(SIM_STATE_NAMES), action_dim=len(SIM_ACTION_NAMES), cameras=["front"], horizon=8,
        n_action_steps=4, hidden_dim=64, num_blocks=2, num_inference_steps=3, vocabulary=word_vocabulary(["lift"]),
    )  # fmt: skip
    return DiffusionPolicy(config).eval()


def random_flow_vla_policy():
    """The project's DiffusionVLAPolicy (flow matching, so it takes RTC guidance), tiny, random weights."""
    from policies.diffusion_vla import DiffusionVLAConfig
    from policies.diffusion_vla.modeling_diffusion_vla import DiffusionVLAPolicy
    from policies.tokenizer import word_vocabulary

    torch.manual_seed(0)
    config = DiffusionVLAConfig(
        state_dim=len(SIM_STATE_NAMES), action_dim=len(SIM_ACTION_NAMES), cameras=["front"], image_size=IMAGE_SIZE,
        patch_size=8, horizon=8, n_action_steps=4, dim=32, depth=1, heads=2, vision_width=32, vision_layers=1,
        text_width=32, vocabulary=word_vocabulary(["lift the cube"]), objective="flow", num_inference_steps=3,
    )  # fmt: skip
    return DiffusionVLAPolicy(config).eval()
