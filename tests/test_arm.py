"""The arm's contract (`sim.arm`) and its controller (`sim.ik`): the layouts and bounds match the
MJCF model, the gripper mapping, the hold action holds, and the controller's orientation error."""

import subprocess
import sys
from pathlib import Path

import mujoco
import numpy as np
import pytest
import torch

from sim.arm import (
    ACTION_HIGH,
    ACTION_LOW,
    ACTION_NAMES,
    EE_IN_STATE,
    FINGER_TRAVEL,
    JOINT_RANGES,
    STATE_BOUNDS,
    STATE_NAMES,
    arm_state,
    commanded_grip,
    finger_targets,
    hold_actions,
)
from sim.config import EnvConfig
from sim.ik import ArmController
from sim.mujoco_env import MujocoBatchedEnv
from vla_core.ik import orientation_error_map

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_contract_starts_no_simulator():
    code = "import sys, sim.arm; print('mujoco' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_layout_and_bounds_are_the_models():
    """Joint limits and finger travel as the MJCF states them; state and action names in order."""
    model = mujoco.MjModel.from_xml_path(str(ROOT / "sim/assets/panda_pick_place.xml"))
    np.testing.assert_array_equal(np.array(JOINT_RANGES), model.jnt_range[:7])
    np.testing.assert_array_equal(model.jnt_range[7:9], [[0.0, FINGER_TRAVEL]] * 2)
    np.testing.assert_array_equal(model.actuator_ctrlrange[7:9], [[0.0, FINGER_TRAVEL]] * 2)
    assert STATE_NAMES[EE_IN_STATE] == ACTION_NAMES[:3] == ["ee_x", "ee_y", "ee_z"]
    assert list(STATE_BOUNDS) == STATE_NAMES
    assert STATE_BOUNDS["joint4"] == [-3.0718, -0.0698] and STATE_BOUNDS["gripper_width"] == [0.0, 0.08]
    assert STATE_BOUNDS["ee_z"] == [0.0, 0.40] and ACTION_LOW[3] == 0.0 and ACTION_HIGH[3] == 1.0


def test_gripper_mapping():
    """grip 0 opens each finger its full 4 cm, 1 closes it; the inverse reads the grip back."""
    np.testing.assert_allclose(finger_targets(np.array([0.0, 0.5, 1.0])), [0.04, 0.02, 0.0])
    assert commanded_grip(torch.tensor([0.04, 0.01, 0.0])).tolist() == pytest.approx([0.0, 0.75, 1.0])


def test_state_and_hold_layouts():
    qpos, ee = np.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.01, 0.02]]), np.array([[0.5, -0.1, 0.2]])
    expected = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.03, 0.5, -0.1, 0.2]
    assert arm_state(qpos, ee, out=np.zeros((1, 11), np.float32))[0].tolist() == pytest.approx(expected)
    on_torch = arm_state(torch.from_numpy(qpos), torch.from_numpy(ee), out=torch.zeros(1, 11))
    assert on_torch[0].tolist() == pytest.approx(expected)
    ee = torch.tensor([[0.5, -0.1, 0.2], [0.6, 0.0, 0.1]], dtype=torch.float64)
    assert hold_actions(ee).tolist() == [[0.5, -0.1, 0.2, 0.0], [0.6, 0.0, 0.1, 0.0]]
    assert hold_actions(ee, torch.tensor([1.0, 0.25]))[:, 3].tolist() == [1.0, 0.25]


def test_hold_action_keeps_the_arm_and_the_grip():
    """Close the grippers halfway, then send the env's hold action: the arms stay put and the
    finger targets stay at half their 4 cm travel."""
    with MujocoBatchedEnv(EnvConfig(num_envs=2, cameras=[])) as env:
        env.reset(seed=1)
        start = env.ee_positions().copy()
        half_closed = torch.from_numpy(np.concatenate([start, np.full((2, 1), 0.5)], axis=1))
        env.step(half_closed)
        assert env.hold_actions()[:, 3].tolist() == pytest.approx([0.5, 0.5])
        for _ in range(5):
            env.step(env.hold_actions())
        np.testing.assert_allclose(env.ee_positions(), start, atol=0.005)
        np.testing.assert_allclose([d.ctrl[7:9] for d in env.data], 0.02)


def test_orientation_error_is_the_rotation_back_to_the_target():
    """A frame turned by theta about z away from the target has to turn back about -z: the error
    is -sin(theta) z (the small-angle measure), whatever the target; zero at the target."""
    theta = 0.3
    rz = np.array([[np.cos(theta), -np.sin(theta), 0.0], [np.sin(theta), np.cos(theta), 0.0], [0.0, 0.0, 1.0]])
    for target in (np.eye(3), rz.T):
        rot = rz @ target
        err = rot.reshape(1, 9) @ orientation_error_map(target)
        np.testing.assert_allclose(err[0], [0.0, 0.0, -np.sin(theta)], atol=1e-15)
        np.testing.assert_allclose(target.reshape(1, 9) @ orientation_error_map(target), 0.0, atol=1e-15)


def test_controller_at_its_goal_commands_no_motion():
    """At the home keyframe, aiming at where the end effector already is: no IK step, so the arm's
    targets are the home joints; the fingers follow the grip."""
    model = mujoco.MjModel.from_xml_path(str(ROOT / "sim/assets/panda_lift.xml"))
    data = mujoco.MjData(model)
    mujoco.mj_resetDataKeyframe(model, data, model.key("home").id)
    mujoco.mj_forward(model, data)
    site = model.site("grasp").id
    jacp, jacr = np.zeros((3, model.nv)), np.zeros((3, model.nv))
    mujoco.mj_jacSite(model, data, jacp, jacr, site)
    jac = np.concatenate([jacp[:, :7], jacr[:, :7]])[None]
    action = np.array([[*data.site_xpos[site], 0.25]])
    out = np.zeros((1, model.nu))
    ArmController.from_model(model).servo_targets(
        action, data.qpos[None, :7], jac, data.site_xpos[None, site], data.site_xmat[None, site], out=out
    )
    np.testing.assert_allclose(out[0, :7], model.key("home").qpos[:7], atol=1e-12)
    np.testing.assert_allclose(out[0, 7:9], [0.03, 0.03])


def test_servo_targets_step_the_worlds_as_the_controllers_own_targets_do():
    """`step_servo_targets` with, at every substep, the servo targets the IK controller wrote for an action
    reaches the same state, bit for bit, as stepping that action (the hook a joint trajectory follower drives)."""
    from sim.arm import SERVO_JOINTS

    assert SERVO_JOINTS == [*(f"joint{i}" for i in range(1, 8)), "finger_joint1", "finger_joint2"]  # ctrl[:9]
    config = EnvConfig(task="lift", num_envs=2, cameras=[])
    with MujocoBatchedEnv(config) as by_action, MujocoBatchedEnv(config) as by_servo:
        by_action.reset(seed=5)
        by_servo.reset(seed=5)
        action = torch.from_numpy(by_action.ee_positions() + [0.02, -0.01, -0.02]).float()
        action = torch.cat([action, torch.tensor([[0.3], [0.8]])], dim=1)
        by_action.step(action)
        targets = np.stack([d.ctrl[:9].copy() for d in by_action.data])  # (2, 9) what the controller wrote
        *_, info = by_servo.step_servo_targets(np.repeat(targets[:, None], config.substeps, axis=1))
        for a, s in zip(by_action.data, by_servo.data, strict=True):
            np.testing.assert_array_equal(a.qpos, s.qpos)
            np.testing.assert_array_equal(a.qvel, s.qvel)
            np.testing.assert_array_equal(a.ctrl, s.ctrl)
        assert not info["invalid_actions"].any() and not info["clipped_actions"].any()
        with pytest.raises(ValueError, match=r"servo targets must be finite with shape \(2, 25, 9\)"):
            by_servo.step_servo_targets(np.zeros((2, 9)))
