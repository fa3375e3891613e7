"""The subprocess batched env's contract on a toy world (no simulator): success, truncation, bad actions."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from sim.subprocess_env import SubprocessBatchedEnv
from vla_core.types import OBS_STATE, TASK


class SlideWorld(gym.Env):
    """A point on a line: action[0] moves it, action[1] is a 'gripper' it remembers; success at x >= 1.5."""

    def __init__(self):
        self.observation_space = spaces.Dict({"agent_pos": spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float64)})
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.x, self.grip = 0.0, 0.0

    def reset(self, *, seed=None, options=None):
        self.x, self.grip = 0.0, 0.0
        return self._obs(), {"is_success": False}

    def step(self, action):
        self.x += float(action[0])
        self.grip = float(action[1])
        success = self.x >= 1.5
        return self._obs(), float(success), success, False, {"is_success": success}

    def _obs(self):
        return {"agent_pos": np.array([self.x, self.grip])}


def to_lerobot(raw):
    return {OBS_STATE: torch.from_numpy(raw["agent_pos"]).float()}


@pytest.fixture(scope="module")
def env():
    with SubprocessBatchedEnv([SlideWorld] * 3, to_lerobot, ["a", "b", "c"], 3, [], 0.05) as e:
        yield e


def test_success_terminates_and_truncation_ends_the_rest(env):
    obs = env.reset(seed=0)
    assert obs[TASK] == ["a", "b", "c"] and obs[OBS_STATE].tolist() == [[0, 0]] * 3
    actions = torch.tensor([[1.0, 1.0], [0.5, 0.0], [0.0, 0.0]])
    obs, reward, terminated, truncated, info = env.step(actions)
    assert not (terminated | truncated).any() and info["success"].tolist() == [False] * 3
    obs, reward, terminated, truncated, info = env.step(actions)  # world 0 reaches x = 2
    assert terminated.tolist() == [True, False, False] and info["success"].tolist() == [True, False, False]
    assert reward.tolist() == [1.0, 0.0, 0.0] and env.episode_step.tolist() == [0, 2, 2]
    assert info["final_obs"][OBS_STATE][0].tolist() == [2.0, 1.0] and obs[OBS_STATE][0].tolist() == [0.0, 0.0]
    assert info["final_obs"][OBS_STATE][1:].tolist() == obs[OBS_STATE][1:].tolist()  # the others go on
    obs, reward, terminated, truncated, info = env.step(actions)  # world 1 reaches 1.5 on the last step
    assert terminated.tolist() == [False, True, False] and truncated.tolist() == [False, False, True]
    assert info["success"].tolist() == [False, True, False]
    assert info["final_obs"][OBS_STATE][:, 0].tolist() == [1.0, 1.5, 0.0]


def test_bad_actions_are_held_or_clipped_and_counted(env):
    env.reset(seed=0)
    env.step(torch.tensor([[0.5, 1.0], [0.5, -1.0], [0.5, 1.0]]))
    nan, inf = float("nan"), float("inf")
    obs, _, _, _, info = env.step(torch.tensor([[nan, 0.0], [0.2, inf], [-3.0, -7.0]]))
    assert info["invalid_actions"].tolist() == [True, True, False]
    assert info["clipped_actions"].tolist() == [False, False, True]
    # non-finite rows hold: no move, the gripper as last commanded; the out-of-range row is clipped
    assert obs[OBS_STATE].tolist() == [[0.5, 1.0], [0.5, -1.0], [-0.5, -1.0]]
    assert env.hold_actions().tolist() == [[0.0, 1.0], [0.0, -1.0], [0.0, -1.0]]


def test_a_state_loads_only_into_a_world_of_its_task(env):
    """Worlds 0, 1, 2 run tasks a, b, c: a state of task 0 is refused by world 1, before any worker is asked."""
    state = {"world": None, "episode_step": 0, "gripper": 0.0, "task_id": 0}
    with pytest.raises(
        ValueError, match=r"\(world, state's task_id\) \[\(1, 0\)\] do not match the worlds' task_id \[1\]"
    ):
        env.set_state([state], worlds=[1])
