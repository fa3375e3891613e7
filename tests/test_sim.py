import mujoco
import numpy as np
import pytest
import torch

from sim.batched_success import is_success
from sim.config import EnvConfig
from sim.mujoco_env import MujocoBatchedEnv
from sim.tasks import LiftExpert, get_task
from vla_core.types import OBS_STATE, TASK, BatchedEnv


@pytest.fixture
def env():
    with MujocoBatchedEnv(EnvConfig(num_envs=8)) as e:
        yield e


def test_observation_layout(env):
    assert isinstance(env, BatchedEnv)
    obs = env.reset(seed=0)
    img = obs["observation.images.front"]
    assert img.shape == (8, 3, 64, 64) and img.dtype == torch.float32
    assert 0.0 <= img.min() and img.max() <= 1.0 and img.std() > 0.05  # a real rendered scene, not a blank
    assert obs[OBS_STATE].shape == (8, 11)
    assert obs[TASK] == ["pick up the red cube"] * 8
    # state = 7 joints, gripper width (open: 2 x 0.04 m), end-effector xyz (the grasp site)
    np.testing.assert_allclose(obs[OBS_STATE][:, 7].numpy(), 0.08, atol=1e-3)
    np.testing.assert_allclose(obs[OBS_STATE][:, 8:].numpy(), env.ee_positions(), atol=1e-6)


def test_reset_is_seeded_and_randomized(env):
    env.reset(seed=3)
    cubes_a = env.privileged_state()["cube"]
    env.reset(seed=3)
    np.testing.assert_array_equal(env.privileged_state()["cube"], cubes_a)
    env.reset(seed=4)
    assert not np.allclose(env.privileged_state()["cube"], cubes_a)
    task = get_task("lift")
    assert (cubes_a[:, 0] >= task.cube_x_range[0]).all() and (cubes_a[:, 0] <= task.cube_x_range[1]).all()
    assert np.ptp(cubes_a[:, 1]) > 0.02  # worlds differ from each other


def test_controller_tracks_end_effector_target(env):
    env.reset(seed=0)
    target = env.ee_positions() + np.array([0.05, -0.04, -0.06])
    actions = np.concatenate([target, np.zeros((8, 1))], axis=1)
    for _ in range(15):
        env.step(torch.from_numpy(actions))
    np.testing.assert_allclose(env.ee_positions(), target, atol=0.005)


def test_expert_succeeds_at_least_95_percent():
    n = 16
    with MujocoBatchedEnv(EnvConfig(num_envs=n)) as env:
        expert = LiftExpert(n)
        env.reset(seed=123)
        outcomes = []
        while len(outcomes) < 48:
            actions = expert.act(env.ee_positions(), env.privileged_state())
            _, reward, terminated, truncated, info = env.step(torch.from_numpy(actions))
            done = (terminated | truncated).numpy()
            outcomes += [bool(info["success"][i]) for i in np.flatnonzero(done)]
            np.testing.assert_array_equal(reward.numpy(), info["success"].numpy().astype(np.float32))
            expert.reset(done)
    assert np.mean(outcomes) >= 0.95, f"expert success {np.mean(outcomes):.2f}"


def test_success_check_is_height_of_cube(env):
    env.reset(seed=0)
    task, model, data = env.task, env.model, env.data[0]
    assert not is_success(task, model, data)
    cube = model.joint("cube").qposadr[0]
    data.qpos[cube + 2] = task.lift_height + 0.01
    mujoco.mj_forward(model, data)
    assert is_success(task, model, data)


def test_bad_actions_are_clipped_and_counted(env):
    env.reset(seed=0)
    before = env.ee_positions().copy()
    hold = np.concatenate([before, np.zeros((8, 1))], axis=1)
    actions = torch.from_numpy(hold.copy())
    actions[1] = float("nan")
    actions[2, 0] = float("inf")
    actions[3] = torch.tensor([5.0, before[3, 1], -5.0, 7.0])  # far in +x, below the table, grip beyond closed
    actions[4, 3] = 0.5  # in range: applied as given
    obs, _, _, _, info = env.step(actions)
    assert info["invalid_actions"].tolist() == [False, True, True, False, False, False, False, False]
    assert info["clipped_actions"].tolist() == [False, False, False, True, False, False, False, False]
    assert torch.isfinite(obs[OBS_STATE]).all()
    np.testing.assert_allclose(env.ee_positions()[1], before[1], atol=0.01)  # NaN holds position
    moved = {i: (env.data[i].qpos.copy(), env.data[i].ctrl.copy()) for i in (3, 4)}
    # Row 3 on the workspace's edge (x <= 0.80 m, z >= 0 m, grip <= 1), sent from the same start, does
    # exactly what the out-of-range row did: the env applied the clipped action.
    env.reset(seed=0)
    edge = torch.from_numpy(hold.copy())
    edge[3] = torch.tensor([0.80, before[3, 1], 0.0, 1.0])
    edge[4, 3] = 0.5
    _, _, _, _, info = env.step(edge)
    assert not info["clipped_actions"].any() and not info["invalid_actions"].any()
    np.testing.assert_array_equal(env.data[3].qpos, moved[3][0])
    np.testing.assert_array_equal(env.data[3].ctrl, moved[3][1])
    np.testing.assert_array_equal(env.data[3].ctrl[7:9], [0.0, 0.0])  # grip 1 (closed): fingers at 0 m
    np.testing.assert_allclose(moved[4][1][7:9], [0.02, 0.02])  # grip 0.5: each finger half of its 0.04 m
    with pytest.raises(ValueError, match=r"actions must have shape \(8, 4\)"):
        env.step(torch.zeros(8, 7))


def test_truncation_and_autoreset():
    with MujocoBatchedEnv(EnvConfig(num_envs=2, max_episode_steps=3)) as env:
        env.reset(seed=0)
        hold = torch.from_numpy(np.concatenate([env.ee_positions(), np.zeros((2, 1))], axis=1))
        cubes = env.privileged_state()["cube"]
        for t in range(3):
            _obs, _, term, trunc, info = env.step(hold)
        assert trunc.tolist() == [True, True] and term.tolist() == [False, False]
        assert env.episode_step.tolist() == [0, 0]
        assert not np.allclose(env.privileged_state()["cube"], cubes)  # new episodes were drawn
        assert info["final_obs"][OBS_STATE].shape == (2, 11)


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match="valid tasks: lift"):
        get_task("stack_blocks")


def test_non_finite_world_is_reset_and_flagged(env):
    env.reset(seed=0)
    env.data[2].qvel[:] = float("nan")  # a world whose state blew up
    others_before = env.ee_positions()[[0, 1, 3]].copy()
    hold = torch.from_numpy(np.concatenate([env.ee_positions(), np.zeros((8, 1))], axis=1))
    obs, _, terminated, _truncated, info = env.step(hold)
    assert info["diverged"].tolist() == [False, False, True] + [False] * 5
    assert terminated[2] and not terminated[[0, 1, 3]].any()
    assert env.episode_step.tolist() == [1, 1, 0, 1, 1, 1, 1, 1]  # only world 2 was reset
    assert torch.isfinite(obs[OBS_STATE]).all()
    np.testing.assert_allclose(env.ee_positions()[[0, 1, 3]], others_before, atol=0.01)  # the rest kept going
