"""robosuite tasks behind the batched-env contract: two Lift worlds in worker processes, a few steps."""

import numpy as np
import pytest
import torch
from extras import require

require("robosuite", "libero")  # the libero extra brings robosuite; under CI a broken import fails

from sim.config import EnvConfig
from sim.factory import make_env
from sim.robosuite_env import RobosuiteWorld
from vla_core.types import OBS_STATE, TASK, BatchedEnv

CAMERAS = ["agentview", "robot0_eye_in_hand"]
MAX_STEPS = 6  # short episodes, so truncation shows within a test; every test starts with a reset


@pytest.fixture(scope="module")
def env():
    cfg = EnvConfig(task="robosuite/Lift", num_envs=2, cameras=CAMERAS, image_size=64, max_episode_steps=MAX_STEPS)
    with make_env(cfg) as e:
        yield e


def test_observation_layout_and_no_success_at_start(env):
    assert isinstance(env, BatchedEnv) and env.action_dim == 7 and env.num_envs == 2
    obs = env.reset(seed=0)
    assert {k: tuple(v.shape) for k, v in obs.items() if k != TASK} == {
        "observation.images.agentview": (2, 3, 64, 64),
        "observation.images.robot0_eye_in_hand": (2, 3, 64, 64),
        OBS_STATE: (2, 8),
    }
    assert obs[TASK] == ["lift the red cube"] * 2
    s = obs[OBS_STATE].numpy()  # eef xyz, axis-angle (gripper down: angle ~ pi), finger positions
    assert (s[:, 2] > 0.9).all() and np.allclose(np.linalg.norm(s[:, 3:6], axis=1), np.pi, atol=0.3)
    assert (s[:, 6] > 0.015).all() and np.allclose(s[:, 6], -s[:, 7], atol=1e-3)  # open, symmetric fingers
    obs, reward, terminated, truncated, info = env.step(env.hold_actions())
    assert info["success"].tolist() == [False, False] and reward.tolist() == [0.0, 0.0]
    assert not (terminated | truncated).any()
    frame = env.render(1, size=32)
    assert frame.shape == (32, 32, 3) and frame.dtype == np.uint8


def test_images_are_upright(env):
    obs = env.reset(seed=0)
    agent, wrist = obs["observation.images.agentview"][0], obs["observation.images.robot0_eye_in_hand"][0]
    row_brightness = lambda img: img.mean(dim=(0, 2))  # (3, H, W) -> (H,)
    # Upright: the agentview has the dark far wall at the top and the white table in front at the
    # bottom; the wrist camera has the dark gripper fingers at the bottom.
    assert row_brightness(agent)[-8:].mean() > row_brightness(agent)[:8].mean() + 0.2
    assert row_brightness(wrist)[:8].mean() > row_brightness(wrist)[-8:].mean() + 0.2


def test_world_flips_robosuites_frame_once():
    world = RobosuiteWorld("Lift", ["robot0_eye_in_hand"], 32)
    try:
        obs, info = world.reset(seed=0)
        raw = world._env._get_observations(force_update=True)["robot0_eye_in_hand_image"]
        np.testing.assert_array_equal(obs["pixels"]["robot0_eye_in_hand"], raw[::-1])
        assert info == {"is_success": False}
    finally:
        world.close()


def test_actions_move_the_end_effector_and_bad_ones_are_held(env):
    start = env.reset(seed=1)[OBS_STATE]
    actions = torch.tensor([[0.0, 0, 5.0, 0, 0, 0, -1], [float("inf")] + [0.0] * 6])  # +z (5 is out of range)
    for _ in range(3):
        obs, _, _, _, info = env.step(actions)
        assert info["invalid_actions"].tolist() == [False, True]
        assert info["clipped_actions"].tolist() == [True, False]
    moved = obs[OBS_STATE][:, :3] - start[:, :3]
    assert moved[0, 2] > 0.01 and moved[0, :2].abs().max() < 0.005
    assert moved[1].abs().max() < 0.002  # the non-finite action held the arm still
    with pytest.raises(ValueError, match=r"actions must have shape \(2, 7\)"):
        env.step(torch.zeros(2, 4))


def test_seeded_resets_and_truncation_with_autoreset(env):
    first = env.reset(seed=3)
    again = env.reset(seed=3)
    torch.testing.assert_close(again["observation.images.agentview"], first["observation.images.agentview"])
    assert (env.reset(seed=4)["observation.images.agentview"] - first["observation.images.agentview"]).abs().max() > 0.2

    env.reset(seed=3)
    for t in range(MAX_STEPS):
        obs, _, terminated, truncated, info = env.step(torch.tensor([[0.0, 0, 1, 0, 0, 0, -1]] * 2))
        assert truncated.tolist() == [t == MAX_STEPS - 1] * 2 and not terminated.any()
    assert env.episode_step.tolist() == [0, 0]
    final, fresh = info["final_obs"][OBS_STATE], obs[OBS_STATE]
    assert (final[:, 2] - fresh[:, 2] > 0.02).all()  # the final obs is the raised arm, the new one is back down
    assert (fresh[:, 2] - first[OBS_STATE][:, 2]).abs().max() < 0.02


def test_unknown_task_or_camera_lists_the_valid_names():
    with pytest.raises(ValueError, match="valid tasks: robosuite/Lift, robosuite/Stack, robosuite/PickPlaceCan"):
        make_env(EnvConfig(task="robosuite/Wipe"))
    with pytest.raises(ValueError, match="robosuite cameras are agentview, robot0_eye_in_hand"):
        make_env(EnvConfig(task="robosuite/Stack"))  # the default camera, 'front', is not robosuite's
    with pytest.raises(ValueError, match="runs on the cpu backend"):
        make_env(EnvConfig(task="robosuite/Lift", backend="warp"))


def test_missing_robosuite_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "robosuite" else find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r'pip install -e "\.\[libero\]"'):
        make_env(EnvConfig(task="robosuite/Lift", cameras=["agentview"]))
