"""The batched-env contract (`vla_core.types.BatchedEnv`), checked the same way on every backend.

Each backend runs a few worlds for a few steps. What a test expects is stated here, not read from
the env: the feature names, the task list, and what a seed, a subset reset and a saved state mean.
All four backends are deterministic here (Warp runs on the CPU), so their observations are
compared exactly. LIBERO resets rebuild the scene and take seconds each: the tests reset as few
times as they can.
"""

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from extras import require

from sim.config import EnvConfig
from sim.factory import make_env
from vla_core.types import ACTION, OBS_STATE, TASK, BatchedEnv, image_key

MAX_STEPS = 20  # no test comes near it by stepping; the autoreset test loads worlds one step before it
SIZE = 32
ARM_STATE = ["joint1", "joint2", "joint3", "joint4", "joint5", "joint6", "joint7", "gripper_width", "ee_x", "ee_y",
             "ee_z"]  # fmt: skip
ARM_ACTION = ["ee_x", "ee_y", "ee_z", "grip"]
EEF_STATE = ["eef_x", "eef_y", "eef_z", "eef_axis_angle_x", "eef_axis_angle_y", "eef_axis_angle_z",
             "gripper_finger_left", "gripper_finger_right"]  # fmt: skip
DELTA_ACTION = ["dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"]


@dataclass
class Backend:
    config: EnvConfig
    task_names: list[str]
    task_ids: list[int]
    state_names: list[str]
    action_names: list[str]
    move: list[float]  # an action every world takes (a target for the arm backends, a delta for the others)
    needs: tuple[str, str] | None = None  # (module, extra) the backend imports
    cameras: list[str] = field(init=False)

    def __post_init__(self):
        self.cameras = list(self.config.cameras)


def _config(**kwargs) -> EnvConfig:
    return EnvConfig(image_size=SIZE, max_episode_steps=MAX_STEPS, **kwargs)


BACKENDS = {
    "cpu": Backend(_config(task="lift", num_envs=3, cameras=["front"]), ["lift"], [0, 0, 0], ARM_STATE, ARM_ACTION,
                   [0.5, 0.0, 0.25, 0.0]),
    "warp": Backend(_config(task="lift", backend="warp", num_envs=3, cameras=["front"]), ["lift"], [0, 0, 0], ARM_STATE,
                    ARM_ACTION, [0.5, 0.0, 0.25, 0.0], needs=("mujoco_warp", "gpu")),
    "libero": Backend(_config(task="libero_spatial/0", num_envs=2, cameras=["image"]), ["libero_spatial/0"], [0, 0],
                      EEF_STATE, DELTA_ACTION, [0.3, 0.1, -0.2, 0.1, 0.0, 0.0, -1.0], needs=("libero", "libero")),
    "robosuite": Backend(_config(task="robosuite/Lift", num_envs=3, cameras=["agentview"]), ["robosuite/Lift"],
                         [0, 0, 0], EEF_STATE, DELTA_ACTION, [0.3, 0.1, -0.2, 0.1, 0.0, 0.0, -1.0],
                         needs=("robosuite", "libero")),
}  # fmt: skip


@dataclass
class Case:
    env: BatchedEnv
    spec: Backend
    first: dict  # the observations of reset(seed=0)

    def move(self) -> torch.Tensor:
        return torch.tensor([self.spec.move] * self.env.num_envs)


# LIBERO worlds take seconds to build and step (software rendering): their conformance runs under -m slow.
@pytest.fixture(
    scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n == "libero" else n for n in BACKENDS]
)
def case(request):
    spec = BACKENDS[request.param]
    if spec.needs:
        require(*spec.needs)  # skips without the extra; under CI a broken import fails instead
    with make_env(spec.config) as env:
        yield Case(env, spec, env.reset(seed=0))


def tensors(obs: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in obs.items() if k != TASK}


def rows(obs: dict, worlds) -> dict[str, torch.Tensor]:
    return {k: v[worlds] for k, v in tensors(obs).items()}


def assert_same_rows(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def assert_same_states(a, b) -> None:
    """Snapshots equal leaf by leaf (nested dicts, lists, arrays, numbers)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_states(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_states(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def test_features_describe_what_the_env_emits_and_takes(case):
    env, spec, n = case.env, case.spec, case.env.num_envs
    assert isinstance(env, BatchedEnv)
    image = {"dtype": "image", "shape": (SIZE, SIZE, 3), "names": ["height", "width", "channels"]}
    expected = {image_key(cam): image for cam in spec.cameras}
    expected[OBS_STATE] = {"dtype": "float32", "shape": (len(spec.state_names),), "names": spec.state_names}
    expected[ACTION] = {"dtype": "float32", "shape": (len(spec.action_names),), "names": spec.action_names}
    assert env.features == expected
    assert env.action_dim == len(spec.action_names)
    # The observations have the features' shapes, images channels first: (N, 3, H, W).
    shapes = {k: tuple(v.shape) for k, v in tensors(case.first).items()}
    assert shapes == {image_key(cam): (n, 3, SIZE, SIZE) for cam in spec.cameras} | {
        OBS_STATE: (n, len(spec.state_names))
    }
    assert len(case.first[TASK]) == n and all(isinstance(t, str) and t for t in case.first[TASK])


def test_step_returns_the_documented_shapes_dtypes_and_devices(case):
    env, n = case.env, case.env.num_envs
    obs, reward, terminated, truncated, info = env.step(case.move())
    assert env.task_names == case.spec.task_names
    assert info["task_id"].tolist() == case.spec.task_ids and info["task_id"].dtype == torch.long
    assert reward.shape == (n,) and reward.dtype == torch.float32
    for flags in (terminated, truncated, info["success"]):
        assert flags.shape == (n,) and flags.dtype == torch.bool
    for t in (reward, terminated, truncated, info["success"], info["task_id"], *tensors(obs).values()):
        assert t.device == env.device
    for key, value in tensors(obs).items():
        assert value.dtype == torch.float32, key
    images = [obs[image_key(cam)] for cam in case.spec.cameras]
    assert all(0.0 <= img.min() and img.max() <= 1.0 for img in images)
    assert {k: v.shape for k, v in tensors(info["final_obs"]).items()} == {k: v.shape for k, v in tensors(obs).items()}


def test_a_subset_reset_leaves_the_other_worlds_alone(case):
    env, n = case.env, case.env.num_envs
    env.step(case.move())
    obs_before, _, _, _, _ = env.step(case.move())  # every world away from its first observation
    others = list(range(n - 1))
    states_before = env.get_state(others)
    obs = env.reset(seed=0, worlds=[n - 1])
    # The reset world starts where reset(seed=0) started it: the same seed, the same episode.
    assert_same_rows(rows(obs, [n - 1]), rows(case.first, [n - 1]))
    assert not torch.equal(obs_before[OBS_STATE][n - 1], obs[OBS_STATE][n - 1])
    # The others are where they were, observations and full state alike.
    assert_same_rows(rows(obs, others), rows(obs_before, others))
    assert_same_states(env.get_state(others), states_before)
    # A bool mask selects the same way: no world changes nothing; the last world alone resets it alone.
    assert_same_rows(tensors(env.reset(worlds=torch.zeros(n, dtype=torch.bool))), tensors(obs))
    moved, _, _, _, _ = env.step(case.move())
    last = torch.zeros(n, dtype=torch.bool)
    last[n - 1] = True
    masked = env.reset(seed=0, worlds=last)
    assert_same_rows(rows(masked, [n - 1]), rows(case.first, [n - 1]))
    assert_same_rows(rows(masked, others), rows(moved, others))


def test_worlds_reset_without_a_seed_start_different_episodes(case):
    """Each world draws its own next episode (what an autoreset does): no two start alike."""
    env, n = case.env, case.env.num_envs
    images = env.reset()[image_key(case.spec.cameras[0])]  # the objects' placements show in the images
    for i in range(n):
        for j in range(i + 1, n):
            assert not torch.equal(images[i], images[j]), (i, j)


def test_equal_seeds_give_equal_starts(case):
    env, n = case.env, case.env.num_envs
    obs = env.reset(seed=[11] * n)  # one seed per world, all the same
    for world in range(1, n):
        assert_same_rows(rows(obs, [world]), rows(obs, [0]))
    assert not torch.equal(obs[OBS_STATE][0], case.first[OBS_STATE][0])  # and not the seed-0 start


def test_a_loaded_state_observes_and_steps_like_its_source(case):
    env, n = case.env, case.env.num_envs
    env.step(case.move())
    obs, _, _, _, _ = env.step(case.move())
    saved = env.get_state([0])
    assert len(saved) == 1
    loaded = env.set_state(saved * (n - 1), worlds=list(range(1, n)))  # GRPO's group: every world as world 0
    for world in range(n):
        assert_same_rows(rows(loaded, [world]), rows(obs, [0]))
    for _ in range(2):
        stepped, _, terminated, truncated, _ = env.step(case.move())
        assert not (terminated | truncated).any()
        for world in range(1, n):
            assert_same_rows(rows(stepped, [world]), rows(stepped, [0]))
    assert not torch.equal(stepped[OBS_STATE][0], obs[OBS_STATE][0])  # the worlds did move


def test_autoreset_hands_back_the_final_observation(case):
    env, n = case.env, case.env.num_envs
    states = env.get_state()
    # World 0, loaded one step before the episode limit, truncates at its next step; the others go on ...
    env.set_state([{**states[0], "episode_step": MAX_STEPS - 1}], worlds=[0])
    obs, _, terminated, truncated, info = env.step(case.move())
    assert truncated.tolist() == [True] + [False] * (n - 1) and terminated.tolist() == [False] * n
    final = info["final_obs"]
    # ... and its final observation is what the same step shows when the limit is far away.
    env.set_state(states)
    expected, _, _, truncated, _ = env.step(case.move())
    assert not truncated.any()
    assert_same_rows(tensors(final), tensors(expected))
    assert_same_rows(rows(obs, list(range(1, n))), rows(expected, list(range(1, n))))  # the others just stepped
    # World 0's returned observation is already its next episode's first.
    assert not torch.equal(obs[OBS_STATE][0], final[OBS_STATE][0])


def test_world_selection_is_read_one_way_everywhere():
    from vla_core.types import world_indices

    assert world_indices(None, 3).tolist() == [0, 1, 2]
    assert world_indices(torch.tensor([False, True, True]), 3).tolist() == [1, 2]
    assert world_indices(torch.tensor([2, 0]), 3).tolist() == [2, 0]  # in the order given
    assert world_indices([], 3).tolist() == []
    with pytest.raises(ValueError, match="must not repeat"):
        world_indices([1, 1], 3)
    with pytest.raises(ValueError, match=r"integers in \[0, 3\)"):
        world_indices([3], 3)
    with pytest.raises(ValueError, match=r"mask must have shape \(3,\)"):
        world_indices([True, False], 3)
