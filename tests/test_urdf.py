"""The robot from its URDF: the simulated Panda's shipped URDF against the MJCF the simulator runs (joint
order, limits, and the grasp frame and its Jacobian at random configurations, computed by MuJoCo), and bad
URDFs refused with one line naming the fix."""

from pathlib import Path

import mujoco
import numpy as np
import pytest

from vla_core.kinematics import KinematicChain
from vla_core.robot import PANDA_URDF, SIM_PANDA, RobotDescription
from vla_core.urdf import parse_urdf, read_urdf

ROOT = Path(__file__).resolve().parents[1]
LINKS_AB = "<robot name='r'><link name='a'/><link name='b'/>"
MJCF_JOINTS = [*(f"joint{i}" for i in range(1, 8)), "finger_joint1", "finger_joint2"]


@pytest.fixture(scope="module")
def mujoco_panda():
    model = mujoco.MjModel.from_xml_path(str(ROOT / "sim" / "assets" / "panda_lift.xml"))
    return model, mujoco.MjData(model)


def test_the_panda_urdf_has_the_simulators_joints_in_its_order_with_its_limits(mujoco_panda):
    model, _ = mujoco_panda
    urdf = read_urdf(str(PANDA_URDF))
    moving = urdf.moving_joints
    assert [j.name for j in moving] == MJCF_JOINTS  # qpos[:9] of every scene, arm first (panda_arm.xml)
    for joint in moving:
        low, high = model.jnt_range[model.joint(joint.name).id]
        assert (joint.lower, joint.upper) == (pytest.approx(low), pytest.approx(high)), joint.name
    assert urdf.chain("link0", "grasp")[-1].name == "grasp_joint" and urdf.root() == "link0"


def test_the_urdf_grasp_frame_and_jacobian_match_mujoco_at_random_configurations(mujoco_panda):
    model, data = mujoco_panda
    chain = SIM_PANDA.chain()  # the simulated Panda's description: its URDF, to the grasp link
    assert chain.names == tuple(MJCF_JOINTS[:7])
    rng = np.random.default_rng(0)
    q = rng.uniform(chain.lower, chain.upper, size=(25, 7))
    position, rotation = chain.forward(q)
    jacobian = chain.jacobian(q)
    site = model.site("grasp").id
    for n in range(len(q)):
        data.qpos[:7] = q[n]
        mujoco.mj_kinematics(model, data)
        mujoco.mj_comPos(model, data)  # mj_jacSite reads the com-based frames
        jacp, jacr = np.zeros((3, model.nv)), np.zeros((3, model.nv))
        mujoco.mj_jacSite(model, data, jacp, jacr, site)
        # To 1e-6: panda_arm.xml writes the hand's 45-degree quaternion to 7 digits (the URDF: -pi/4 exactly).
        np.testing.assert_allclose(position[n], data.site_xpos[site], atol=1e-6)
        np.testing.assert_allclose(rotation[n], data.site_xmat[site].reshape(3, 3), atol=1e-6)
        np.testing.assert_allclose(jacobian[n], np.vstack([jacp[:, :7], jacr[:, :7]]), atol=1e-6)


def test_a_prismatic_finger_moves_along_its_axis(mujoco_panda):
    model, data = mujoco_panda
    chain = KinematicChain.from_urdf(read_urdf(str(PANDA_URDF)), tip="right_finger")
    q = np.array([[0.3, -0.5, 0.2, -2.0, 0.1, 1.9, 0.4, 0.03]])
    data.qpos[:7], data.qpos[8] = q[0, :7], q[0, 7]
    mujoco.mj_kinematics(model, data)
    np.testing.assert_allclose(chain.forward(q)[0][0], data.xpos[model.body("right_finger").id], atol=1e-6)
    # d(position)/d(finger) is the finger's axis (local +y) in the world: the hand frame's -y (turned 180 deg).
    np.testing.assert_allclose(chain.jacobian(q)[0, :3, 7], -data.xmat[model.body("hand").id].reshape(3, 3)[:, 1],
                               atol=1e-6)  # fmt: skip


@pytest.mark.parametrize(
    "text, words",
    [("<robot name='r'><link name='a'/>", "not valid XML"),
     ("<model/>", "not a URDF"),
     (LINKS_AB + "<joint name='j' type='revolute'><parent link='a'/><child link='b'/></joint></robot>",
      "needs <limit lower=... upper=.../>"),
     (LINKS_AB + "<joint name='j' type='fixed'><parent link='a'/><child link='c'/></joint></robot>", "names link 'c'"),
     (LINKS_AB + "<joint name='j' type='floating'><parent link='a'/><child link='b'/></joint></robot>",
      "of type 'floating'"),
     (LINKS_AB + "<joint name='j' type='fixed'><parent link='a'/><child link='b'/><origin xyz='1 2'/></joint></robot>",
      "three numbers")],
)  # fmt: skip
def test_bad_urdfs_are_refused_naming_the_fix(text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_urdf(text)


def test_a_tip_that_does_not_hang_below_the_base_is_refused():
    urdf = read_urdf(str(PANDA_URDF))
    with pytest.raises(ValueError, match="does not hang below"):
        urdf.chain("left_finger", "grasp")
    with pytest.raises(ValueError, match="has no link 'tool0'"):
        KinematicChain.from_urdf(urdf, tip="tool0")
    with pytest.raises(ValueError, match="cannot read the URDF"):
        read_urdf(str(ROOT / "no_such.urdf"))


def test_a_description_read_from_a_urdf_takes_its_joints_limits_and_velocity_limits():
    """Joint space by default: state and actions are the moving joints, actions clipped to their limits."""
    robot = RobotDescription.read_urdf(PANDA_URDF)
    assert robot.name == "sim_panda" and list(robot.action_names) == MJCF_JOINTS == list(robot.state_names)
    assert robot.action_space == "joint" and robot.action_low[3] == -3.0718 and robot.action_high[8] == 0.04
    assert robot.state_bounds["joint6"] == (-0.0175, 3.7525)
    assert robot.velocity_limits["joint1"] == 2.175 and robot.velocity_limits["joint7"] == 2.61
    assert robot.velocity_limits["finger_joint1"] == 0.2
    # The simulated Panda: the URDF's limits, its own layout, and the grasp link its actions command.
    assert dict(SIM_PANDA.joint_limits) == dict(robot.joint_limits) and SIM_PANDA.ee_link == "grasp"
    assert SIM_PANDA.state_bounds["gripper_width"] == (0.0, 0.08)  # two fingers of 0.04 m


def test_a_description_refuses_actions_it_has_no_joints_or_limits_for_and_a_missing_link():
    with pytest.raises(ValueError, match=r"actions \['ee_x'\] are not joints of 'sim_panda'"):
        RobotDescription.read_urdf(PANDA_URDF, action_names=["joint1", "ee_x"])
    with pytest.raises(ValueError, match="has no link 'tool0'"):
        RobotDescription.read_urdf(PANDA_URDF, ee_link="tool0")
    with pytest.raises(ValueError, match="cannot read the URDF"):
        RobotDescription.read_urdf(ROOT / "no_such.urdf")


def test_ik_on_the_urdf_reaches_targets_made_by_forward_kinematics_and_flags_an_unreachable_one():
    """Targets from forward kinematics at configurations a few cm apart (a trajectory's waypoints) are reached to
    within 1 mm, the solution's own forward kinematics is the target, and every q stays within the limits; a
    point 2 m away is reported as not reached, with the closest q found."""
    from vla_core.ik import orientation_error_map, solve_ik

    chain = SIM_PANDA.chain()
    home = np.array([0.0, 0.1, 0.0, -2.2, 0.0, 2.3, 0.7854])  # panda_lift.xml's home keyframe
    _, home_rot = chain.forward(home)
    rng = np.random.default_rng(1)
    path = home + np.cumsum(rng.normal(0, 0.03, (8, 7)), axis=0)  # a wandering path of configurations
    targets = chain.forward(path)[0]
    solution = solve_ik(chain, targets, home, orientation_error_map(home_rot[0]), home, tolerance=1e-3)
    assert solution.converged.all(), solution.error
    np.testing.assert_allclose(chain.forward(solution.q)[0], targets, atol=1e-3)
    assert ((solution.q >= chain.lower) & (solution.q <= chain.upper)).all()
    far = solve_ik(chain, [[2.5, 0.0, 0.3]], home, orientation_error_map(home_rot[0]), home)
    assert not far.converged[0] and far.error[0] > 1.0
