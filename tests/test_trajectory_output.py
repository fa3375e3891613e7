"""Trajectory output without ROS: the seam read from the latency protocol's executor, the planner's trajectories
(the filter going on from the seam, the hold, the IK with a waypoint out of reach, the gripper mapping), the robot
description's mapping and its refusals, and the sim robot's trajectory follower (interpolation, replacement,
starvation, tracking error). Every expected value is worked out by hand in the comments."""

import numpy as np
import pytest
import torch

from robot_bridge.config import SafetyConfig, ServeConfig, TopicsConfig
from robot_bridge.description import DescriptionSource, describe, map_actions, safety_limits
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.log_limit import LogLimiter
from robot_bridge.trajectory import IKFailure, TrajectoryPlanner
from robot_bridge.trajectory_follower import TrackingError, TrajectoryFollower
from vla_core.robot import SIM_PANDA
from vla_core.runtime.executor import ActionChunkExecutor
from vla_core.types import ActionChunk

# Two prismatic joints along x and y: the joint positions are what the test reads back, no kinematics needed.
SLIDES = """<robot name='slides'><link name='base'/><link name='l1'/><link name='l2'/>
<joint name='a' type='prismatic'><parent link='base'/><child link='l1'/><axis xyz='1 0 0'/>
  <limit lower='-1' upper='1' velocity='10'/></joint>
<joint name='b' type='prismatic'><parent link='l1'/><child link='l2'/><axis xyz='0 1 0'/>
  <limit lower='-0.5' upper='0.5' velocity='0.2'/></joint></robot>"""
HOME = np.array([0.0, 0.1, 0.0, -2.2, 0.0, 2.3, 0.7854])  # the simulated Panda's home pose (panda_lift.xml)


def slides_config(**fields) -> ServeConfig:
    return ServeConfig(state_names=["a", "b"], action_names=["a", "b"], action_space="joint", output="trajectory",
                       safety=SafetyConfig(state_bounds={}, initial_command={}), **fields)  # fmt: skip


def test_the_plan_after_a_merge_starts_past_the_committed_prefix_rtc_blended():
    """Horizon 4, one action dim. Chunk 1 (observed at step 0) plans steps 0-3 as 10, 11, 12, 13; steps 0 and 1
    run. Chunk 2, observed at step 1, plans steps 1-4 as 20-23 and arrives at step 2: its lag d = 1, so its row
    for step 1 is dropped (the committed prefix ran) and the plan starts at step 2."""
    chunk1 = ActionChunk(torch.tensor([[[10.0], [11.0], [12.0], [13.0]]]), torch.tensor([0]))
    chunk2 = ActionChunk(torch.tensor([[[20.0], [21.0], [22.0], [23.0]]]), torch.tensor([1]))
    latest = ActionChunkExecutor(1, 1, 4, merge="latest")
    rtc = ActionChunkExecutor(1, 1, 4, merge="rtc")
    for executor in (latest, rtc):
        executor.add_chunk(chunk1)
        executor.next_action(), executor.next_action()
        executor.add_chunk(chunk2)
    actions, queued = latest.plan()
    assert queued.tolist() == [3] and actions[0, :3, 0].tolist() == [21.0, 22.0, 23.0]
    # RTC: the previous plan reaches chunk index d + 2 queued steps = 3; blend weight W_i = (1 + cos(pi i / 3)) / 2
    # for 1 <= i < 3: 0.75 at index 1 (step 2), 0.25 at index 2 (step 3), 0 at index 3 (step 4, nothing queued).
    # Step 2: 0.75 * 12 + 0.25 * 21 = 14.25; step 3: 0.25 * 13 + 0.75 * 22 = 19.75; step 4: 23.
    actions, queued = rtc.plan()
    assert queued.tolist() == [3] and actions[0, :3, 0].tolist() == pytest.approx([14.25, 19.75, 23.0])
    assert rtc.next_action()[0].item() == pytest.approx(14.25)  # what the per-tick output runs at step 2


def slides_planner(max_velocity=None, max_acceleration=()) -> TrajectoryPlanner:
    """Period 0.1 s; the action-space limits the description's (max_velocity: unless given), with ``max_acceleration``."""
    config = slides_config()
    description = describe(SLIDES, "slides", config)
    low, high, velocity = safety_limits(description, config)
    planner = TrajectoryPlanner(description, map_actions(description, config), 0.1, 0.001, low, high,
                                velocity if max_velocity is None else max_velocity, list(max_acceleration))  # fmt: skip
    planner.anchor(np.zeros(2), np.zeros(2))
    return planner


def test_each_trajectory_goes_on_from_the_previous_ones_seam_with_its_velocity():
    """Period 0.1 s; joint a limited to 1 unit/s^2 (so its velocity changes by at most 0.1/s a step), joint b to
    its URDF velocity, 0.2/s (0.02 a step)."""
    planner = slides_planner(max_acceleration=[1.0, 1e9])
    first = planner.plan(1, np.array([[0.01, 0.1], [0.03, 0.1], [0.06, 0.1]]))
    # a: velocities 0.1, 0.2, 0.3 /s, each 0.1 more than the last: allowed. b: 0.02 a step toward 0.1.
    assert first.arm == pytest.approx(np.array([[0.01, 0.02], [0.03, 0.04], [0.06, 0.06]]))
    assert first.first_step == 1 and first.arm_joints == ("a", "b") and first.gripper.shape == (3, 0)
    # A chunk merged at the tick of step 2 starts at step 3, from the previous trajectory's step 2 (a = 0.03,
    # moving at 0.2/s): 0.06 at 0.3/s and 0.10 at 0.4/s are allowed. From rest, step 3 could only reach 0.03 + 0.01.
    second = planner.plan(3, np.array([[0.06, 0.04], [0.10, 0.04]]))
    assert second.arm[:, 0] == pytest.approx([0.06, 0.10])
    # b's velocity limit (URDF: 0.2/s) from its seam value 0.04: 0.04 stays; the action-space filter took it too.
    assert second.arm[:, 1] == pytest.approx([0.04, 0.04])
    # The hold at the tick of step 5 holds where the controller is then: the point of step 4, latched.
    held = planner.hold(5)
    assert held.arm == pytest.approx(np.array([[0.10, 0.04]])) and planner.hold(6).arm == pytest.approx(held.arm)
    planner.release()
    # After the hold the next trajectory starts from the held point at rest: a's velocity grows by 0.1/s a step.
    third = planner.plan(9, np.array([[0.5, 0.04], [0.5, 0.04]]))
    assert third.arm[:, 0] == pytest.approx([0.11, 0.13])
    # A chunk that came a whole chunk late leaves an empty plan: nothing to send, the last trajectory stands.
    assert planner.plan(11, np.zeros((0, 2))) is None and planner.action_at(10) == pytest.approx([0.13, 0.04])


def test_a_plan_merged_with_a_lead_keeps_the_points_the_controller_runs_until_it_starts():
    """Period 0.1 s; a's acceleration limited to 1 unit/s^2 (its velocity changes by at most 0.1/s a step). A plan for
    steps 1-4 (a = 0.01 ... 0.04, 0.1/s); a chunk merged at the tick of step 2 with a lead of 2 steps starts at step 5,
    and the node keeps the points from the step before its tick, 1, on. Step 3 is still 0.03 (the seam alone would
    say 0.04). The low-latency part's correction at step 3 (a = 0.035) goes on from step 2 moving at 0.1/s (known
    from step 1): 0.15/s is a change of 0.05/s, allowed; the later points follow as sent: 0.04, then the merged 0.05,
    0.06. Without step 1 the seam would be at rest and 0.035 out of reach (0.03 at most)."""
    planner = slides_planner(max_acceleration=[1.0, 1e9])
    planner.plan(1, np.array([[0.01, 0.0], [0.02, 0.0], [0.03, 0.0], [0.04, 0.0]]))
    merged = planner.plan(5, np.array([[0.05, 0.0], [0.06, 0.0]]), keep_from=1)
    assert merged.first_step == 5 and merged.arm[:, 0] == pytest.approx([0.05, 0.06])
    assert planner.action_at(3) == pytest.approx([0.03, 0.0]) and planner.action_at(4) == pytest.approx([0.04, 0.0])
    corrected = planner.correct(3, np.array([0.035, 0.0]))
    assert corrected.first_step == 3 and corrected.arm[:, 0] == pytest.approx([0.035, 0.04, 0.05, 0.06])
    assert planner.action_at(3) == pytest.approx([0.035, 0.0]) and planner.action_at(6) == pytest.approx([0.06, 0.0])
    # Keeping from step 2 only, the seam at step 2 is at rest: from rest a reaches 0.03 at most at step 3.
    late = slides_planner(max_acceleration=[1.0, 1e9])
    late.plan(1, np.array([[0.01, 0.0], [0.02, 0.0], [0.03, 0.0], [0.04, 0.0]]))
    late.plan(5, np.array([[0.05, 0.0], [0.06, 0.0]]), keep_from=2)
    assert late.correct(3, np.array([0.035, 0.0])).arm[0, 0] == pytest.approx(0.03)
    # Without keep_from the points before the new plan's seam are not kept: step 3 reads the seam's 0.04.
    old_way = slides_planner()
    old_way.plan(1, np.array([[0.01, 0.0], [0.02, 0.0], [0.03, 0.0], [0.04, 0.0]]))
    old_way.plan(5, np.array([[0.05, 0.0], [0.06, 0.0]]))
    assert old_way.action_at(3) == pytest.approx([0.04, 0.0])


def test_a_correction_goes_on_from_the_controllers_point_and_the_later_points_follow_as_sent():
    """Period 0.1 s; b's velocity limited to its URDF's 0.2/s (0.02 a step). Sent: a = 0.01 ... 0.04 at steps 1-4,
    b = 0. The part corrects step 2 to a = 0.03, b = 0.05: b is held to 0.02 (the filter, from step 1); steps 3 and
    4 follow as sent (a = 0.03, 0.04; b back to 0 at 0.2/s, within the joint's limit). After a hold only the held
    point is left: a correction is that one point."""
    planner = slides_planner()
    planner.plan(1, np.array([[0.01, 0.0], [0.02, 0.0], [0.03, 0.0], [0.04, 0.0]]))
    corrected = planner.correct(2, np.array([0.03, 0.05]))
    assert corrected.first_step == 2 and corrected.limited_points == 0
    assert corrected.arm == pytest.approx(np.array([[0.03, 0.02], [0.03, 0.0], [0.04, 0.0]]))
    assert corrected.actions == pytest.approx(corrected.arm)  # joint actions: the points are the actions
    assert planner.action_at(3) == pytest.approx([0.03, 0.0]) and planner.action_at(9) == pytest.approx([0.04, 0.0])
    planner.hold(5)
    planner.release()
    alone = planner.correct(5, np.array([0.045, 0.0]))
    assert alone.first_step == 5 and alone.arm == pytest.approx(np.array([[0.045, 0.0]]))


def test_a_corrected_point_out_of_the_iks_reach_changes_nothing():
    planner, chain, start = panda_planner()
    sent = planner.plan(1, np.array([[*(start + [0.01, 0, 0]), 0.0], [*(start + [0.02, 0, 0]), 0.0]]))
    failure = planner.correct(1, np.array([2.0, 0.0, 0.3, 0.0]))  # 2 m out
    assert isinstance(failure, IKFailure) and failure.step == 1 and failure.error > 0.5
    assert planner.action_at(2)[:3] == pytest.approx(start + [0.02, 0, 0])
    # A reachable correction is solved for its point only; the later point keeps the joints sent for it.
    corrected = planner.correct(1, np.array([*(start + [0.01, 0.005, 0]), 0.0]))
    assert np.linalg.norm(chain.forward(corrected.arm[:1])[0][0] - (start + [0.01, 0.005, 0])) <= 0.001
    assert corrected.arm[1] == pytest.approx(sent.arm[1], abs=1e-12)


def test_the_joints_velocity_limits_slow_a_trajectory_and_are_counted():
    planner = slides_planner(max_velocity=[])  # the action-space filter unlimited: only the joints' limits act
    # b's URDF limit 0.2/s is 0.02 a step: from 0, targets 0.05 and 0.05 become 0.02 and 0.04; a's 10/s (1 a
    # step) lets 0.3 and 0.4 through. Both points were moved (by b).
    trajectory = planner.plan(1, np.array([[0.3, 0.05], [0.4, 0.05]]))
    assert trajectory.arm == pytest.approx(np.array([[0.3, 0.02], [0.4, 0.04]])) and trajectory.limited_points == 2


def panda_planner(**fields):
    config = ServeConfig(output="trajectory", **fields)
    description = describe(SIM_PANDA.urdf, "sim_panda", config, default=True)
    planner = TrajectoryPlanner(description, map_actions(description, config), 0.05, config.ik_tolerance,
                                [], [], [], [])  # fmt: skip
    position = description.chain().forward(HOME)[0][0]
    planner.anchor(np.array([*position, 0.0]), HOME)
    return planner, description.chain(), position


def test_an_end_effector_plan_is_solved_on_the_urdf_holding_the_tool_and_mapping_the_grip():
    planner, chain, start = panda_planner()
    targets = start + np.array([[0.01, 0.0, -0.01], [0.02, 0.01, -0.02]])
    trajectory = planner.plan(1, np.column_stack([targets, [0.25, 1.0]]))
    position, rotation = chain.forward(trajectory.arm)
    assert np.linalg.norm(position - targets, axis=1).max() <= 0.001  # within ik_tolerance
    # The tool keeps its orientation at the first measured state (a few milliradians of drift at most).
    home_rotation = chain.forward(HOME)[1][0]
    assert np.abs(rotation - home_rotation).max() < 0.01
    # Grip 0.25 -> each finger 0.04 (open, its upper limit) + 0.25 * (0 - 0.04) = 0.03; grip 1 -> 0 (closed).
    assert trajectory.gripper == pytest.approx(np.array([[0.03, 0.03], [0.0, 0.0]]))
    assert trajectory.arm_joints == tuple(f"joint{i}" for i in range(1, 8))
    assert trajectory.gripper_joints == ("finger_joint1", "finger_joint2")


def test_an_end_effector_plan_starts_where_the_measured_joints_put_the_tool_not_at_the_command_given():
    """A real arm's JointState has no ee_x, ee_y, ee_z: the hold's command there is a configured pose. The planner
    anchors on the forward kinematics of the measured joints instead (computed here by the chain at HOME)."""
    planner, chain, _ = panda_planner()
    planner.anchor(np.array([0.3, -0.2, 0.1, 0.0]), HOME)  # a configured pose 10-30 cm away
    assert planner.action_at(0)[:3] == pytest.approx(chain.forward(HOME)[0][0]) and planner.action_at(0)[3] == 0.0


def test_a_waypoint_out_of_reach_leaves_the_trajectory_unsent_and_the_previous_seam_in_force():
    planner, chain, start = panda_planner()
    out_of_reach = [2.0, 0.0, 0.3]  # 2 m out: the Panda reaches about 0.86 m from its shoulder
    failure = planner.plan(4, np.array([[*(start + [0.01, 0, 0]), 0.0], [*out_of_reach, 0.0]]))
    assert isinstance(failure, IKFailure) and failure.step == 5 and failure.target.tolist() == out_of_reach
    assert failure.error > 0.5
    line = failure.line(0.001)
    assert "step 5" in line and "(2.000, 0.000, 0.300)" in line and "safety.position_min" in line
    # Nothing was recorded: the controller still holds the anchor, so step 4 still commands the start.
    assert planner.action_at(4)[:3] == pytest.approx(start)
    trajectory = planner.plan(4, np.array([[*(start + [0.01, 0, 0]), 0.0]]))
    assert np.linalg.norm(chain.forward(trajectory.arm)[0][0] - (start + [0.01, 0, 0])) <= 0.001


def test_the_policys_actions_are_refused_when_they_do_not_map_onto_the_robot_naming_both_sides():
    def refusal(urdf, **fields):
        config = ServeConfig(**fields)
        with pytest.raises(ValueError) as err:
            map_actions(describe(urdf, "test", config), config)
        return str(err.value)

    line = refusal(SIM_PANDA.urdf, action_names=["shoulder", "joint2"], action_space="joint", state_names=["joint2"],
                   safety=slides_config().safety)  # fmt: skip
    assert "['shoulder']" in line and "'sim_panda'" in line and "'joint1'" in line
    line = refusal(SLIDES, state_names=["a", "b"], safety=slides_config().safety)  # an end-effector policy
    assert "robot 'slides' names no link" in line and "set ee_link" in line and "'l2'" in line
    line = refusal(SLIDES, state_names=["a", "b"], action_names=["a", "grip"], action_space="joint",
                   safety=slides_config().safety)  # fmt: skip
    assert "'grip'" in line and "gripper_joints ['finger_joint1', 'finger_joint2']" in line and "'slides'" in line


def test_the_description_sets_the_limits_left_empty_and_a_bad_urdf_holds_counted():
    config = slides_config()
    description = describe(SLIDES, "slides", config)
    assert safety_limits(description, config) == ([-1.0, -0.5], [1.0, 0.5], [10.0, 0.2])
    assert dict(description.state_bounds) == {"a": (-1.0, 1.0), "b": (-0.5, 0.5)}

    diagnostics, ready = BridgeDiagnostics(), []
    lines = []
    source = DescriptionSource(slides_config(topics=TopicsConfig(robot_description="/robot_description")), diagnostics,
                               LogLimiter(lambda level, line: lines.append(line)), lambda *args: ready.append(args))  # fmt: skip
    source.start()
    key, text = source.problem()
    assert key == "description waiting" and "/robot_description" in text and not ready
    source.on_message(type("Msg", (), {"data": "<robot name='x'"})())
    key, text = source.problem()
    assert (
        key == "description rejected" and "not valid XML" in text and diagnostics.counters["description_rejected"] == 1
    )
    assert len(lines) == 1 and lines[0].endswith("; holding")
    source.on_message(type("Msg", (), {"data": SLIDES})())
    assert source.problem() is None and ready[0][2] is True and ready[0][1].arm_joints == ("a", "b")


def test_the_follower_interpolates_replaces_at_the_start_and_counts_starvation():
    follower = TrajectoryFollower(["j"])
    assert not follower.active
    # Stamped 1000, points at +100 and +200 ns, arriving at 900: from the setpoint in force (0) at 1000.
    assert follower.offer(1000, np.array([100, 200]), np.array([[1.0], [3.0]]), 900, np.array([0.0])) is None
    assert follower.setpoint(np.array([900, 1050, 1150, 1300]))[:, 0].tolist() == [0.0, 0.5, 2.0, 3.0]
    assert not follower.starved(1199) and follower.starved(1200)
    # A new one starting at 1150 (arriving at 1120): the old runs until 1150, where it is at 2.0; then to 5 at 1250.
    assert follower.offer(1150, np.array([100]), np.array([[5.0]]), 1120, np.array([9.0])) is None
    assert follower.setpoint(np.array([1120, 1150, 1200]))[:, 0].tolist() == pytest.approx([1.4, 2.0, 3.5])
    # Stamp 0 = now (1300): from the held 5 there to 7 at 1400.
    assert follower.offer(0, np.array([100]), np.array([[7.0]]), 1300, np.array([9.0])) is None
    assert follower.setpoint(np.array([1350]))[0, 0] == pytest.approx(6.0)
    # One that ends in the past is rejected and changes nothing.
    assert follower.offer(1000, np.array([100]), np.array([[9.0]]), 1500, np.array([9.0])).startswith("stale")
    assert follower.setpoint(np.array([1500]))[0, 0] == 7.0
    # Stamped in the past but ending ahead: its point at 1550 is past (dropped); from 7 at now (1600) to 9 at 1650.
    assert follower.offer(1450, np.array([100, 200]), np.array([[8.0], [9.0]]), 1600, np.array([0.0])) is None
    assert follower.setpoint(np.array([1625]))[0, 0] == pytest.approx(8.0)
    follower.clear()
    assert not follower.active and not follower.starved(10**6)


def test_tracking_error_is_the_rms_and_max_over_joints_and_ticks():
    tracking = TrackingError()
    tracking.add(np.array([1.0, 2.0]), np.zeros(2))
    tracking.add(np.array([0.0, -2.0]), np.zeros(2))
    assert tracking.rms == pytest.approx(1.5) and tracking.max == 2.0  # sqrt((1 + 4 + 0 + 4) / 4)


def test_another_robots_urdf_bounds_its_joints_not_the_simulated_pandas_default_bounds():
    """A robot whose joints are named like the Panda's (joint1..7), joint1 limited to [-1, 1] in its URDF: the
    default safety.state_bounds (the Panda's, [-2.8973, 2.8973]) give way to it; bounds set in the config win."""
    urdf = SIM_PANDA.urdf.replace('name="sim_panda"', 'name="other_arm"', 1).replace(
        '<limit lower="-2.8973" upper="2.8973" velocity="2.175" effort="87"/>',
        '<limit lower="-1.0" upper="1.0" velocity="2.175" effort="87"/>', 1)  # fmt: skip
    assert describe(urdf, "other_arm.urdf", ServeConfig()).state_bounds["joint1"] == (-1.0, 1.0)
    configured = ServeConfig(safety=SafetyConfig(state_bounds={"joint1": [-0.5, 0.5]}))
    assert describe(urdf, "other_arm.urdf", configured).state_bounds["joint1"] == (-0.5, 0.5)
