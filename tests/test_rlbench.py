"""The RLBench adapter: everything around the simulator, with values worked out by hand.

CoppeliaSim, PyRep and RLBench cannot be installed from a package registry, so most of these tests run
without them: the PerAct task table, the quaternion convention, the corrected close_jar rule on
hand-made object poses, the conversions at RLBench's boundary, the error when RLBench is missing, and
the worker and batch logic. Only the worker and batch tests drive a stand-in for RLBench's
``TaskEnvironment`` (:class:`StandInTaskEnv`), because the real simulator cannot run here; the stand-in
has RLBench's method names and return shapes and nothing more. The tests marked ``rlbench`` need the
real simulator and are deselected by default (``-m rlbench`` runs them where it is installed).
"""

import importlib.util
from types import SimpleNamespace

import mujoco
import numpy as np
import pytest
import torch

from sim.config import EnvConfig
from sim.factory import env_family, make_env
from sim.rlbench_env import (
    ACTION_NAMES,
    Launched,
    RLBenchBatchedEnv,
    RLBenchWorld,
    WorldSpec,
    check_rlbench_config,
    lerobot_observation,
    raw_observation,
    to_rlbench_action,
)
from sim.rlbench_protocol import (
    PERACT,
    PERACT_TASKS,
    CloseJarObjects,
    close_jar_success,
    close_jar_success_as_forked,
    resolve_rlbench_task,
    rotate_xyzw,
    task_class_name,
    wxyz_to_xyzw,
    xyzw_to_wxyz,
)
from vla_core.types import ACTION, OBS_STATE, TASK, BatchedEnv

H = np.sqrt(0.5)  # cos 45 deg = sin 45 deg

# -- the PerAct table ---------------------------------------------------------------------------------


def test_peract_table_has_the_18_tasks_and_their_published_variation_counts():
    # PerAct's task list in its order, with the "# of Variations" of its task table.
    published = [("open_drawer", 3), ("slide_block_to_color_target", 4), ("sweep_to_dustpan_of_size", 2),
                 ("meat_off_grill", 2), ("turn_tap", 2), ("put_item_in_drawer", 3), ("close_jar", 20),
                 ("reach_and_drag", 20), ("stack_blocks", 60), ("light_bulb_in", 20), ("put_money_in_safe", 3),
                 ("place_wine_at_rack_location", 3), ("put_groceries_in_cupboard", 9),
                 ("place_shape_in_shape_sorter", 5), ("push_buttons", 50), ("insert_onto_square_peg", 20),
                 ("stack_cups", 20), ("place_cups", 3)]  # fmt: skip
    assert list(PERACT_TASKS.items()) == published
    assert sum(PERACT_TASKS.values()) == 249  # the abstract: "18 RLBench tasks (with 249 variations)"
    assert (PERACT.episodes_per_task, PERACT.episode_length, PERACT.image_size) == (25, 25, 128)
    assert PERACT.cameras == ("front", "left_shoulder", "right_shoulder", "wrist")


def test_task_names_and_classes():
    assert resolve_rlbench_task("rlbench/close_jar") == "close_jar"
    assert task_class_name("place_shape_in_shape_sorter") == "PlaceShapeInShapeSorter"
    with pytest.raises(ValueError, match=r"an RLBench task is rlbench/<task>.*got 'rlbench/close-jar'"):
        resolve_rlbench_task("rlbench/close-jar")


# -- quaternions -------------------------------------------------------------------------------------


def test_quaternion_convention_on_a_known_rotation():
    """90 deg about z: scalar-last (0, 0, sin 45, cos 45), scalar-first (cos 45, 0, 0, sin 45); it turns x into y."""
    q_xyzw = np.array([0.0, 0.0, H, H])
    assert np.allclose(xyzw_to_wxyz(q_xyzw), [H, 0.0, 0.0, H])
    assert np.allclose(rotate_xyzw(q_xyzw, [1.0, 0.0, 0.0]), [0.0, 1.0, 0.0])
    rotated = np.zeros(3)  # MuJoCo's own scalar-first rotation of the converted quaternion agrees
    mujoco.mju_rotVecQuat(rotated, np.array([1.0, 0.0, 0.0]), xyzw_to_wxyz(q_xyzw))
    assert np.allclose(rotated, [0.0, 1.0, 0.0])
    # 180 deg about x: scalar-last (1, 0, 0, 0) is scalar-first (0, 1, 0, 0) and turns y into -y;
    # read with the wrong order, (1, 0, 0, 0) would be the identity.
    assert np.allclose(xyzw_to_wxyz([1.0, 0.0, 0.0, 0.0]), [0.0, 1.0, 0.0, 0.0])
    assert np.allclose(rotate_xyzw([1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0]), [0.0, -1.0, 0.0])


def test_quaternion_round_trip_keeps_every_number():
    batch = np.array([[0.1, 0.2, 0.3, 0.9], [1.0, 2.0, 3.0, 4.0]])
    assert xyzw_to_wxyz(batch).tolist() == [[0.9, 0.1, 0.2, 0.3], [4.0, 1.0, 2.0, 3.0]]
    assert np.array_equal(wxyz_to_xyzw(xyzw_to_wxyz(batch)), batch)
    assert np.array_equal(xyzw_to_wxyz(wxyz_to_xyzw(batch)), batch)
    with pytest.raises(ValueError, match="4 numbers in its last axis"):
        xyzw_to_wxyz([0.0, 0.0, 1.0])


# -- close_jar's success -------------------------------------------------------------------------------


class Body:
    """A hand-placed object: its world position, as PyRep's ``get_position`` gives it."""

    def __init__(self, *position):
        self.position = np.array(position)

    def get_position(self):
        return self.position


class BoxSensor:
    """Stands in for the proximity sensor: detects an object whose position lies in a box around it."""

    def __init__(self, center, half_extent):
        self.center, self.half_extent = np.array(center), half_extent

    def is_detected(self, obj):
        return bool((np.abs(obj.get_position() - self.center) <= self.half_extent).all())


class Gripper:
    def __init__(self, holding):
        self.holding = holding

    def get_grasped_objects(self):
        return list(self.holding)


def test_close_jar_counts_a_sealed_jar_even_while_the_gripper_holds_the_lid():
    # Target jar at (0.20, 0.10, 0.75): the success sensor sits 5 cm above it (init_episode), 2 cm box.
    sensor = BoxSensor([0.20, 0.10, 0.80], 0.02)
    sealed = Body(0.205, 0.10, 0.79)  # 5 mm off the axis, 1 cm below the sensor: inside
    on_other_jar = Body(-0.10, 0.10, 0.80)  # the distractor jar, 30 cm away
    on_table = Body(0.20, 0.10, 0.75)  # 5 cm below the sensor: outside

    held = CloseJarObjects(sealed, sensor, Gripper([sealed]))
    assert close_jar_success(held) and not close_jar_success_as_forked(held)  # what the fix changes
    released = CloseJarObjects(sealed, sensor, Gripper([]))
    assert close_jar_success(released) and close_jar_success_as_forked(released)
    for lid in (on_other_jar, on_table):
        assert not close_jar_success(CloseJarObjects(lid, sensor, Gripper([])))


# -- the conversions at RLBench's boundary --------------------------------------------------------------


def test_keypose_action_becomes_a_unit_quaternion_pose_then_discrete_gripper():
    command = to_rlbench_action([0.1, 0.2, 0.9, 0.0, 0.0, 2.0, 2.0, 0.7], "keypose")
    arm, gripper = command[:7], command[7:]  # what EndEffectorPoseViaPlanning and Discrete each receive
    assert np.allclose(arm, [0.1, 0.2, 0.9, 0.0, 0.0, H, H]) and gripper.tolist() == [1.0]
    assert to_rlbench_action([0.1, 0.2, 0.9, 0.0, 0.0, 0.0, 1.0, 0.5], "keypose")[7] == 0.0  # 0.5 is not > 0.5
    with pytest.raises(ValueError, match="has no length"):
        to_rlbench_action([0.1, 0.2, 0.9, 0.0, 0.0, 0.0, 0.0, 1.0], "keypose")
    joints = [0.0, -0.3, 0.0, -2.2, 0.0, 2.0, 0.8]
    assert to_rlbench_action([*joints, 0.2], "joint").tolist() == [*joints, 0.0]  # joint targets untouched
    with pytest.raises(ValueError, match="8 numbers, got 7"):
        to_rlbench_action(joints, "joint")


def rlbench_observation(pose, joints, gripper_open, size=4):
    """An object with the fields of RLBench's ``Observation`` that the adapter reads."""
    front = np.zeros((size, size, 3), np.uint8)
    front[0, 1] = (255, 51, 0)
    wrist = np.full((size, size, 3), 0.5, np.float32)  # PyRep's float form: 0.5 -> 128
    return SimpleNamespace(gripper_pose=np.array(pose), joint_positions=np.array(joints), gripper_open=gripper_open,
                           front_rgb=front, wrist_rgb=wrist)  # fmt: skip


def test_rlbench_observation_becomes_our_observation():
    pose, joints = [0.3, -0.1, 1.0, 0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.3, -1.5, 0.5, 1.6, 0.7]
    obs = rlbench_observation(pose, joints, 0.0)
    raw = raw_observation(obs, "keypose", ["front", "wrist"])
    assert raw["robot_state"].tolist() == [*pose, 0.0]
    assert raw_observation(obs, "joint", []).keys() == {"robot_state"}
    assert raw_observation(obs, "joint", [])["robot_state"].tolist() == [*joints, 0.0]
    assert raw["pixels"]["wrist"].dtype == np.uint8 and (raw["pixels"]["wrist"] == 128).all()

    batch = {"robot_state": np.stack([raw["robot_state"]] * 2),
             "pixels": {cam: np.stack([raw["pixels"][cam]] * 2) for cam in ("front", "wrist")}}  # fmt: skip
    out = lerobot_observation(batch)
    assert out[OBS_STATE].shape == (2, 8) and out[OBS_STATE].dtype == torch.float32
    front = out["observation.images.front"]
    assert front.shape == (2, 3, 4, 4)  # channels first
    assert front[0, :, 0, 1].tolist() == pytest.approx([1.0, 0.2, 0.0])  # (255, 51, 0) / 255, row 0, column 1


# -- building -------------------------------------------------------------------------------------------


def test_missing_rlbench_is_one_error_naming_what_to_install(monkeypatch):
    monkeypatch.delenv("COPPELIASIM_ROOT", raising=False)  # the error holds wherever RLBench is unconfigured
    with pytest.raises(ImportError) as error:
        make_env(EnvConfig(task="rlbench/close_jar", num_envs=1))
    message = str(error.value)
    for needed in ("CoppeliaSim 4.1", "PyRep", "RLBench", "github.com/stepjam/RLBench", "COPPELIASIM_ROOT",
                   "LD_LIBRARY_PATH", "QT_QPA_PLATFORM_PLUGIN_PATH"):  # fmt: skip
        assert needed in message


def test_the_family_and_its_fields():
    family = env_family("rlbench/close_jar")
    assert family.prefix == "rlbench/" and family.builders == {"cpu": "sim.rlbench_env:RLBenchBatchedEnv"}
    with pytest.raises(ValueError, match=r"runs on the cpu backend \(RLBench worker processes"):
        make_env(EnvConfig(task="rlbench/close_jar", backend="warp", device="cuda"))
    with pytest.raises(ValueError, match="--env.rlbench_action_mode applies to rlbench/ tasks only, not 'lift'"):
        make_env(EnvConfig(task="lift", rlbench_action_mode="joint"))
    with pytest.raises(ValueError, match=r"rlbench_variation=20: use -1 \(drawn\) or a variation 0..19"):
        check_rlbench_config(EnvConfig(task="rlbench/close_jar", rlbench_variation=20), "close_jar")
    with pytest.raises(ValueError, match="RLBench cameras are front, left_shoulder"):
        check_rlbench_config(EnvConfig(task="rlbench/close_jar", cameras=["side"]), "close_jar")
    with pytest.raises(ValueError, match="stored episodes carry their own variation"):
        check_rlbench_config(EnvConfig(rlbench_variation=2, rlbench_demo_root="demos"), "close_jar")


# -- the worker and the batch, on a stand-in for RLBench's TaskEnvironment --------------------------------


class StandInInvalidAction(Exception):
    """Plays RLBench's InvalidActionError."""


class StandInTaskEnv:
    """Stands in for RLBench's ``TaskEnvironment`` (CoppeliaSim cannot run here): the gripper goes to each
    commanded pose; a target below z = 0.7 is refused; reward 1.0 once the gripper is past x = 0.5.
    Variations are drawn from numpy's global RNG, as RLBench's ``sample_variation`` does."""

    def __init__(self, spec: WorldSpec):
        self.size, self.variation, self.calls = spec.image_size, 0, []
        self.pose, self.open = np.zeros(7), 1.0

    def set_variation(self, v):
        self.calls.append(("set_variation", v))
        self.variation = v

    def sample_variation(self):
        self.variation = int(np.random.randint(0, 4))
        return self.variation

    def get_demos(self, amount, live_demos, random_selection, from_episode_number):
        self.calls.append(("get_demos", amount, live_demos, random_selection, from_episode_number))
        return [SimpleNamespace(variation_number=from_episode_number % 4)]

    def reset_to_demo(self, demo):
        self.calls.append(("reset_to_demo", demo.variation_number))
        return self.reset()

    def reset(self):
        self.pose, self.open = np.array([0.2, 0.0, 0.9, 0.0, 1.0, 0.0, 0.0]), 1.0
        return [f"reach target {self.variation}", "another wording"], self._observation()

    def step(self, action):
        self.calls.append(("step", np.asarray(action).tolist()))
        if action[2] < 0.7:
            raise StandInInvalidAction("A path could not be found")
        self.pose, self.open = np.asarray(action[:7]), float(action[7])
        reward = 1.0 if action[0] > 0.5 else 0.0
        return self._observation(), reward, reward >= 1.0

    def _observation(self):
        return SimpleNamespace(gripper_pose=self.pose.copy(), joint_positions=np.zeros(7), gripper_open=self.open,
                               front_rgb=np.full((self.size, self.size, 3), 51, np.uint8))  # fmt: skip


def stand_in_launch(spec: WorldSpec, objects=None) -> Launched:
    return Launched(StandInTaskEnv(spec), (StandInInvalidAction,), objects, lambda: None)


def spec(**changes):
    base = {"task": "reach_target", "mode": "keypose", "cameras": ("front",), "image_size": 4, "variation": -1,
            "demo_root": "", "stride": 3}  # fmt: skip
    return WorldSpec(**{**base, **changes})


def test_world_seeds_variations_sends_rlbench_arrays_and_ends_on_success_or_a_refused_action():
    world, twin = RLBenchWorld(spec(), launch=stand_in_launch), RLBenchWorld(spec(), launch=stand_in_launch)
    raw, _ = world.reset(seed=5)
    twin.reset(seed=5)
    np.random.seed(5)
    assert world.instruction() == twin.instruction() == f"reach target {np.random.randint(0, 4)}"
    assert raw["robot_state"].tolist() == [0.2, 0.0, 0.9, 0.0, 1.0, 0.0, 0.0, 1.0] and raw["pixels"]["front"].shape == (
        4,
        4,
        3,
    )

    raw, reward, terminated, _, info = world.step(np.array([0.3, 0.0, 0.8, 0.0, 0.0, 0.0, 3.0, 0.1]))
    assert world._sim.task_env.calls[-1] == ("step", [0.3, 0.0, 0.8, 0.0, 0.0, 0.0, 1.0, 0.0])  # unit quat, closed
    assert (reward, terminated, info["is_success"]) == (0.0, False, False)
    raw, reward, terminated, _, info = world.step(np.array([0.3, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0]))  # z refused
    assert (reward, terminated, info["is_success"], world.failed_actions) == (0.0, True, False, 1)
    assert raw["robot_state"].tolist() == [0.3, 0.0, 0.8, 0.0, 0.0, 0.0, 1.0, 0.0]  # the last observation stands
    world.reset(seed=6)
    _, reward, terminated, _, info = world.step(np.array([0.6, 0.0, 0.8, 0.0, 0.0, 0.0, 1.0, 1.0]))
    assert (reward, terminated, info["is_success"]) == (1.0, True, True)

    fixed = RLBenchWorld(spec(variation=2), launch=stand_in_launch)
    fixed.reset(seed=0)
    assert fixed.instruction() == "reach target 2" and ("set_variation", 2) in fixed._sim.task_env.calls


def test_world_resets_to_stored_episodes_and_moves_on_by_the_batch_size():
    world = RLBenchWorld(spec(demo_root="stored"), launch=stand_in_launch)
    world.reset(seed=7)
    calls = world._sim.task_env.calls
    assert calls == [("set_variation", -1), ("get_demos", 1, False, False, 7), ("set_variation", 3),
                     ("reset_to_demo", 3)]  # fmt: skip
    world.reset()  # an autoreset: episode 7 + 3 worlds
    assert calls[-3][-1] == 10 and world.instruction() == "reach target 2"


def test_close_jar_world_applies_the_corrected_rule():
    # RLBench's reward says 0 (its rule wants an empty gripper), the lid is on the target jar: success.
    lid = Body(0.2, 0.1, 0.8)
    objects = CloseJarObjects(lid, BoxSensor([0.2, 0.1, 0.8], 0.02), Gripper([lid]))
    world = RLBenchWorld(spec(task="close_jar"), launch=lambda s: stand_in_launch(s, lambda: objects))
    world.reset(seed=0)
    _, reward, terminated, _, info = world.step(np.array([0.3, 0.0, 0.8, 0.0, 0.0, 0.0, 1.0, 0.0]))
    assert (reward, terminated, info["is_success"]) == (1.0, True, True)
    lid.position = np.array([0.2, 0.1, 0.7])  # lifted off again: the sensor no longer sees it
    _, reward, terminated, _, info = world.step(np.array([0.3, 0.0, 0.8, 0.0, 0.0, 0.0, 1.0, 0.0]))
    assert (reward, terminated, info["is_success"]) == (0.0, False, False)


@pytest.fixture(scope="module")
def batch():
    cfg = EnvConfig(task="rlbench/reach_target", num_envs=2, cameras=["front"], image_size=4, max_episode_steps=3)
    with RLBenchBatchedEnv(cfg, launch=stand_in_launch) as env:
        yield env


def test_batch_contract_seeds_instructions_autoreset_and_hold(batch):
    assert isinstance(batch, BatchedEnv) and batch.action_dim == 8 and batch.control_dt == 1.0
    assert batch.features[ACTION]["names"] == ACTION_NAMES["keypose"] == batch.features[OBS_STATE]["names"]
    obs = batch.reset(seed=1)  # worlds get seeds 1 * 2 + 0 and 1 * 2 + 1
    expected = []
    for s in (2, 3):
        np.random.seed(s)
        expected.append(f"reach target {np.random.randint(0, 4)}")
    assert obs[TASK] == expected and obs["observation.images.front"].shape == (2, 3, 4, 4)
    assert torch.allclose(obs["observation.images.front"], torch.full((2, 3, 4, 4), 0.2))
    assert torch.equal(batch.hold_actions(), obs[OBS_STATE])

    actions = torch.tensor([[0.6, 0.0, 0.8, 0.0, 0.0, 0.0, 1.0, 1.0], [0.3, 0.0, 0.8, 0.0, 0.0, 0.0, 1.0, 1.0]])
    obs, reward, terminated, truncated, info = batch.step(actions)
    assert info["success"].tolist() == [True, False] and reward.tolist() == [1.0, 0.0]
    assert terminated.tolist() == [True, False] and info["task_id"].tolist() == [0, 0]
    assert info["final_obs"][OBS_STATE][0, 0].item() == pytest.approx(0.6)  # the ended episode's last pose
    assert obs[OBS_STATE][0, 0].item() == pytest.approx(0.2)  # world 0 already started its next episode
    assert info["final_obs"][TASK] == expected and obs[TASK][1] == expected[1]
    batch.step(batch.hold_actions())
    _, _, terminated, truncated, _ = batch.step(batch.hold_actions())  # world 1's third step: the limit
    assert truncated.tolist() == [False, True] and not terminated.any()
    assert batch.failed_actions() == [0, 0]


def test_batch_refuses_to_save_states(batch):
    with pytest.raises(NotImplementedError, match=r"cannot be saved and loaded.*reset\(seed=\[s, s, \.\.\.\]"):
        batch.get_state()
    with pytest.raises(NotImplementedError, match="cannot be saved and loaded"):
        batch.set_state([{}], worlds=[0])


# -- with the real simulator ----------------------------------------------------------------------------


@pytest.mark.rlbench
def test_close_jar_in_coppeliasim():
    """Two close_jar worlds in CoppeliaSim: observations, an instruction naming the jar, no success when holding."""
    assert importlib.util.find_spec("rlbench") is not None, "RLBench is not installed"
    cfg = EnvConfig(task="rlbench/close_jar", num_envs=2, cameras=list(PERACT.cameras), image_size=PERACT.image_size)
    with make_env(cfg) as env:
        obs = env.reset(seed=0)
        assert obs["observation.images.front"].shape == (2, 3, 128, 128) and obs[OBS_STATE].shape == (2, 8)
        assert all("jar" in text for text in obs[TASK])
        quat = obs[OBS_STATE][:, 3:7]
        assert torch.allclose(quat.norm(dim=1), torch.ones(2), atol=1e-3)  # scalar-last unit quaternions
        _, _, terminated, _, info = env.step(env.hold_actions())
        assert info["success"].tolist() == [False, False] and not terminated.any()
