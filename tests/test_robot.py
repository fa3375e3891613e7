"""The robot description (`vla_core.robot`): the simulated Panda's is checked against facts read
independently (the MJCF file, parsed here without MuJoCo), the simulator and the bridge read the
same numbers from it, and a description is immutable and refuses inconsistent fields."""

import dataclasses
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from vla_core.robot import SIM_PANDA, RobotDescription

ROOT = Path(__file__).resolve().parents[1]
ARM_XML = ROOT / "sim/assets/panda_arm.xml"
ARM_JOINTS = [f"joint{i}" for i in range(1, 8)]


def _mjcf_joint_ranges(path: Path) -> dict[str, tuple[float, float]]:
    """Every named joint of an MJCF file -> its range, in tree order, with MJCF's default classes
    applied: a joint's own ``range``, else its class's (its ``class``, else the nearest body's
    ``childclass``), else the enclosing classes'."""
    root = ET.parse(path).getroot()
    joint_defaults: dict[str, dict] = {}  # class -> joint attributes, the enclosing classes' included

    def read_defaults(element, inherited: dict) -> None:
        for child in element.findall("default"):
            attrs = dict(inherited)
            if (joint := child.find("joint")) is not None:
                attrs.update(joint.attrib)
            joint_defaults[child.get("class", "main")] = attrs
            read_defaults(child, attrs)

    for section in root.findall("default"):
        read_defaults(section, {})
    ranges = {}

    def walk(body, childclass: str) -> None:
        childclass = body.get("childclass", childclass)
        for child in body:
            if child.tag == "joint":
                attrs = {**joint_defaults.get(child.get("class", childclass), {}), **child.attrib}
                low, high = map(float, attrs["range"].split())
                ranges[child.get("name")] = (low, high)
            elif child.tag == "body":
                walk(child, childclass)

    walk(root.find("worldbody"), "main")
    return ranges


def test_the_panda_has_seven_arm_joints_with_the_limits_of_its_model():
    xml = _mjcf_joint_ranges(ARM_XML)
    assert list(xml) == [*ARM_JOINTS, "finger_joint1", "finger_joint2"]  # the parser found the arm
    assert dict(SIM_PANDA.joint_limits) == xml and list(SIM_PANDA.joint_limits) == list(xml)
    assert xml["joint4"] == (-3.0718, -0.0698) and xml["joint1"] == (-2.8973, 2.8973)  # a class default, resolved
    # The 7 arm joints are the state's first 7 entries, bounded by their limits.
    assert list(SIM_PANDA.state_names[:7]) == ARM_JOINTS
    for name in ARM_JOINTS:
        assert SIM_PANDA.state_bounds[name] == xml[name]


def test_gripper_width_is_bounded_by_both_fingers_travel():
    xml = _mjcf_joint_ranges(ARM_XML)
    travel = xml["finger_joint1"][1]
    assert xml["finger_joint1"] == xml["finger_joint2"] == (0.0, 0.04)
    assert SIM_PANDA.state_bounds["gripper_width"] == (0.0, 2 * travel)


def test_actions_command_the_end_effector_inside_the_workspace():
    """The action is the state's end-effector position and a grip in [0, 1]; the workspace bounds the
    reported end effector too (the controller reaches for nothing outside it), above the table (z = 0)."""
    assert SIM_PANDA.action_space == "end_effector"
    assert list(SIM_PANDA.action_names) == ["ee_x", "ee_y", "ee_z", "grip"]
    assert list(SIM_PANDA.state_names[-3:]) == ["ee_x", "ee_y", "ee_z"] and len(SIM_PANDA.state_names) == 11
    assert SIM_PANDA.action_low[3] == 0.0 and SIM_PANDA.action_high[3] == 1.0
    assert SIM_PANDA.action_low[2] == 0.0  # the table top
    for i, name in enumerate(["ee_x", "ee_y", "ee_z"]):
        assert SIM_PANDA.state_bounds[name] == (SIM_PANDA.action_low[i], SIM_PANDA.action_high[i])
    assert list(SIM_PANDA.state_bounds) == list(SIM_PANDA.state_names)  # every entry is checked


def test_the_simulator_reads_the_description():
    from sim import arm

    assert arm.STATE_NAMES == list(SIM_PANDA.state_names) and arm.ACTION_NAMES == list(SIM_PANDA.action_names)
    np.testing.assert_array_equal(arm.ACTION_LOW, SIM_PANDA.action_low)
    np.testing.assert_array_equal(arm.ACTION_HIGH, SIM_PANDA.action_high)
    assert arm.FINGER_TRAVEL == _mjcf_joint_ranges(ARM_XML)["finger_joint1"][1]
    assert arm.JOINT_RANGES == [SIM_PANDA.joint_limits[name] for name in ARM_JOINTS]
    assert arm.STATE_BOUNDS == {name: list(bound) for name, bound in SIM_PANDA.state_bounds.items()}


def test_the_bridge_defaults_are_the_description():
    from robot_bridge.config import ServeConfig
    from robot_bridge.convert import ConvertConfig

    serve = ServeConfig()
    assert serve.state_names == list(SIM_PANDA.state_names)
    assert serve.action_names == list(SIM_PANDA.action_names)
    assert serve.action_space == SIM_PANDA.action_space
    assert serve.safety.state_bounds == {name: list(bound) for name, bound in SIM_PANDA.state_bounds.items()}
    assert ConvertConfig().action_names == list(SIM_PANDA.action_names)
    serve.validate()


def test_a_description_cannot_be_changed():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SIM_PANDA.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        SIM_PANDA.joint_limits["joint1"] = (0.0, 0.0)  # type: ignore[index]
    with pytest.raises(TypeError):
        SIM_PANDA.state_bounds["joint1"] = (0.0, 0.0)  # type: ignore[index]
    assert isinstance(SIM_PANDA.state_names, tuple) and isinstance(SIM_PANDA.action_low, tuple)


def _described(**changes) -> RobotDescription:
    fields = {f.name: getattr(SIM_PANDA, f.name) for f in dataclasses.fields(SIM_PANDA)}
    return RobotDescription(**{**fields, **changes})


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"action_space": "torque"}, "action_space='torque' is not one of"),
        ({"action_low": (0.0, 0.0, 0.0)}, "one value per action"),
        ({"action_high": (0.0, 0.0, 0.0, 1.0)}, "action_low must be <= action_high"),
        ({"state_names": ("joint1", "joint1")}, "state_names must be non-empty and unique"),
        ({"state_bounds": {"elbow": (0.0, 1.0)}}, r"not states: \['elbow'\]"),
        ({"joint_limits": {"joint1": (1.0, -1.0)}}, r"joint_limits\['joint1'\] must be \(low, high\)"),
        ({"joint_limits": {"joint1": (1.0,)}}, r"a range is \(low, high\)"),
    ],
)
def test_an_inconsistent_description_is_refused(changes, error):
    assert _described() == SIM_PANDA  # the unchanged fields build the same description
    with pytest.raises(ValueError, match=error):
        _described(**changes)
