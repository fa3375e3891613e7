"""`vla-rl serve --output=trajectory`: each merged chunk as one joint trajectory, which the robot's controller
(ros2_control's joint_trajectory_controller, franka_ros2, UR, Kinova) interpolates at its own rate, so the
robot depends on a per-chunk deadline instead of a per-tick one. No ROS import here.

The seam. A chunk found at the tick of step n merges from step n + 1 + L (`ChunkScheduler`; L =
``chunking.lead_steps``, the time the trajectory has to reach the controller): the steps up to n + L are the
committed prefix, which the previous trajectory is executing. The new trajectory is the executor's plan from
step n + 1 + L on (`ActionChunkExecutor.plan`: what the per-tick output would command at each of those steps,
had no other chunk merged), read from the latency protocol, never re-derived. It is stamped with the tick time
of step n + 1 + L, from which the controller replaces the rest of the previous trajectory
(joint_trajectory_controller's trajectory replacement), and its point k is reached at stamp + (k + 1) periods:
one period after its step's tick, as the per-tick command of that step is (its one point has
``time_from_start`` one period). So both outputs put each action at the same instant.

Each trajectory goes on from where the previous one is at the seam (step n + L): the safety filter, in the
action's own terms, starts from the previous trajectory's action there and its velocity (as the per-tick
filter would have stepped through it); an end-effector plan is solved to the arm's joints by
`vla_core.ik.solve_ik` on the description's chain, warm-started from the previous trajectory's joints at
the seam (the measured joints before any), the tool's orientation held at what it was at the episode's
first measured state and the nullspace pulled toward that state; then each joint is clamped to its limits
and its velocity to the URDF's limit. A waypoint the IK does not reach leaves the trajectory unsent: the
controller runs the previous one to its end and holds its last point.

A hold (any hold cause of `robot_bridge.hold`) sends a one-point trajectory stamped at the tick's time: the
setpoint the controller is at now (the previous trajectory's point of step n - 1 at the tick of step n),
latched for as long as the hold lasts; the next trajectory goes on from it at rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from robot_bridge.description import ActionMapping
from robot_bridge.safety import SafetyFilter
from vla_core.ik import orientation_error_map, solve_ik
from vla_core.robot import RobotDescription


@dataclass
class PlannedTrajectory:
    """One trajectory to send: point k is step ``first_step + k``, reached ``k + 1`` periods after its stamp."""

    first_step: int  # the executor step of point 0 (a hold: the step of its tick)
    actions: np.ndarray  # (P, A) the filtered actions, in the policy's terms
    arm_joints: tuple[str, ...]
    arm: np.ndarray  # (P, J) arm joint positions
    gripper_joints: tuple[str, ...]
    gripper: np.ndarray  # (P, G) gripper joint positions (G = 0: the policy has no grip)
    limited_points: int = 0  # points the joints' velocity limits slowed


@dataclass
class IKFailure:
    """A waypoint the IK did not reach: the trajectory is not sent."""

    step: int  # the executor step of the waypoint
    target: np.ndarray  # (3,) where the end effector was asked to be
    error: float  # metres from the target to the closest pose the solver found

    def line(self, tolerance: float) -> str:
        where = ", ".join(f"{v:.3f}" for v in self.target)
        return (f"end-effector target ({where}) m of step {self.step} is {self.error * 1e3:.1f} mm from the closest "
                f"pose the IK reaches (tolerance {tolerance * 1e3:g} mm): out of the arm's reach or past a joint "
                f"limit; the previous trajectory runs on. Bound the workspace to what the arm reaches "
                f"(safety.position_min / position_max)")  # fmt: skip


@dataclass
class _Sent:
    """What the controller executes from step ``seam_step`` on: row 0 is the seam, row i step seam_step + i;
    past the last row it holds the last one."""

    seam_step: int
    actions: np.ndarray  # (R, A)
    arm: np.ndarray  # (R, J)
    gripper: np.ndarray  # (R, G)

    def at(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(action (A,), its velocity (A,) per step, arm (J,), its velocity (J,) per step, gripper (G,)) at ``step``;
        zero velocities where the controller holds (before the seam row's successor, past the last row)."""
        i = min(max(step - self.seam_step, 0), len(self.actions) - 1)
        moving = 0 < step - self.seam_step < len(self.actions)
        da = self.actions[i] - self.actions[i - 1] if moving else np.zeros_like(self.actions[i])
        dq = self.arm[i] - self.arm[i - 1] if moving else np.zeros_like(self.arm[i])
        return self.actions[i], da, self.arm[i], dq, self.gripper[i]


class TrajectoryPlanner:
    """Turns merged plans into joint trajectories for one robot (see the module docstring).

    position_min, position_max, max_velocity, max_acceleration: the action-space safety limits, per action
    dim (`robot_bridge.description.safety_limits`); ``delta``: the actions are increments of the last command.
    """

    def __init__(self, description: RobotDescription, mapping: ActionMapping, period: float, ik_tolerance: float,
                 position_min: list[float], position_max: list[float], max_velocity: list[float],
                 max_acceleration: list[float], delta: bool = False) -> None:  # fmt: skip
        self.mapping, self.period, self.ik_tolerance, self.delta = mapping, period, ik_tolerance, delta
        self._action_limits = (position_min, position_max, max_velocity, max_acceleration)
        self.chain = description.chain() if mapping.end_effector else None
        joints = mapping.arm_joints
        self._joint_low = [description.joint_limits[n][0] for n in joints]
        self._joint_high = [description.joint_limits[n][1] for n in joints]
        self._joint_velocity = [description.velocity_limits.get(n, np.inf) for n in joints]
        self._sent: _Sent | None = None
        self._home: np.ndarray | None = None  # (J,) the episode's first measured arm joints
        self._rot_error_map: np.ndarray | None = None  # (9, 3) toward the tool's orientation there
        self.holding = False

    @property
    def anchored(self) -> bool:
        return self._home is not None

    def anchor(self, measured_action: np.ndarray, measured_arm: np.ndarray) -> None:
        """Start afresh from a measured state (the first one, and each of the robot's episodes' first): the
        action-space command (A,) and arm joints (J,) it holds, the IK's orientation and nullspace goal. An
        end-effector position is taken from the forward kinematics of the measured joints, not from the
        command given."""
        self._home = np.asarray(measured_arm, dtype=np.float64).copy()
        if self.chain is not None:
            self._rot_error_map = orientation_error_map(self.chain.forward(self._home)[1][0])
        action = np.asarray(measured_action, dtype=np.float64).copy()
        if self.chain is not None:
            # The tool where the measured joints put it: a JointState without ee_x, ee_y, ee_z (a real arm's) gives
            # a configured pose there, from which the first trajectory would be rate-limited toward a fiction.
            action[list(self.mapping.arm_actions)] = self.chain.forward(self._home)[0][0]
        self._sent = _Sent(-(2**62), action[None], self._home[None], self.mapping.gripper_positions(action[None]))
        self.holding = False

    def plan(self, first_step: int, actions: np.ndarray,
             keep_from: int | None = None) -> PlannedTrajectory | IKFailure | None:  # fmt: skip
        """The trajectory of the executor's plan ``actions`` (P, A), its row 0 for step ``first_step``, going on
        from what the previous one does at step first_step - 1; an `IKFailure` when a waypoint is not reached,
        None for an empty plan (nothing changes then: the previous trajectory runs on). ``keep_from``: the first
        step whose point of the previous trajectory this planner keeps (the controller still runs the steps before
        ``first_step`` from it, and the low-latency part corrects them, see :meth:`correct`); first_step - 1 when
        None."""
        if self._sent is None:
            raise RuntimeError("TrajectoryPlanner.plan before anchor: anchor it at the measured state first")
        if len(actions) == 0:
            return None
        seam_action, seam_velocity, seam_arm, seam_arm_velocity, _ = self._sent.at(first_step - 1)
        filtered = self._filter_actions(np.asarray(actions, dtype=np.float64), seam_action, seam_velocity)
        solved = self._solve(first_step, self.mapping.arm_targets(filtered), seam_arm)
        if isinstance(solved, IKFailure):
            return solved
        arm, limited = self._filter_joints(solved, seam_arm, seam_arm_velocity)
        return self._splice(first_step, filtered, arm, limited, first_step - 1 if keep_from is None else keep_from)

    def correct(self, step: int, action: np.ndarray) -> PlannedTrajectory | IKFailure:
        """The low-latency part's correction ``action`` (A,) of ``step`` (the tick's step), as the trajectory the
        controller replaces its own with at this tick: point 0 the corrected action of ``step``, through the
        action-space filter going on from what the controller does at step - 1 and solved to the joints; then the
        points of the trajectory sent last for the steps after it, as they were sent (the plan runs on where no
        later tick corrects it), the joints' limits applied from the corrected point on. One IK solve a tick, so
        the control thread's cost stays bounded (a point out of reach: an `IKFailure`, nothing recorded, the
        previous trajectory runs on, uncorrected)."""
        if self._sent is None:
            raise RuntimeError("TrajectoryPlanner.correct before anchor: anchor it at the measured state first")
        sent = self._sent
        seam_action, seam_velocity, seam_arm, seam_arm_velocity, _ = sent.at(step - 1)
        later = range(step + 1, sent.seam_step + len(sent.actions))  # the sent points after the corrected one
        first = self._filter_actions(np.asarray(action, dtype=np.float64)[None], seam_action, seam_velocity)
        solved = self._solve(step, self.mapping.arm_targets(first), seam_arm)
        if isinstance(solved, IKFailure):
            return solved
        actions = np.vstack([first] + [sent.at(s)[0][None] for s in later])
        arm, limited = self._filter_joints(np.vstack([solved] + [sent.at(s)[2][None] for s in later]), seam_arm,
                                           seam_arm_velocity)  # fmt: skip
        return self._splice(step, actions, arm, limited, step - 1)

    def _solve(self, first_step: int, targets: np.ndarray, q: np.ndarray) -> np.ndarray | IKFailure:
        """(P, J) the arm joints of the arm targets (P, J) or (P, 3) of steps first_step, ..., warm-started from the
        joints ``q`` (J,); the targets themselves for a joint-space policy."""
        if self.chain is None:
            return targets
        # One waypoint per call, each warm-started from the one before (as solve_ik's own loop does), so a chunk
        # out of reach costs the control thread one waypoint's iterations, not every waypoint's.
        solved = []
        for k, target in enumerate(targets):
            solution = solve_ik(self.chain, target[None], q, self._rot_error_map, self._home, self.ik_tolerance)
            if not solution.converged[0]:
                return IKFailure(first_step + k, target, float(solution.error[0]))
            q = solution.q[0]
            solved.append(q)
        return np.stack(solved)

    def _splice(self, first_step: int, filtered: np.ndarray, arm: np.ndarray, limited: int,
                keep_from: int) -> PlannedTrajectory:  # fmt: skip
        """Record what the controller runs from now on: the sent points of steps keep_from to first_step - 1 (the
        seam last), then the new ones from ``first_step``; return the trajectory to send."""
        steps = range(min(keep_from, first_step - 1), first_step)
        before = [self._sent.at(s) for s in steps]
        gripper = self.mapping.gripper_positions(filtered)
        self._sent = _Sent(steps.start, np.vstack([b[0] for b in before] + [filtered]),
                           np.vstack([b[2] for b in before] + [arm]), np.vstack([b[4] for b in before] + [gripper]))  # fmt: skip
        self.holding = False
        m = self.mapping
        return PlannedTrajectory(first_step, filtered, m.arm_joints, arm, m.gripper_joints, gripper, limited)

    def hold(self, step: int) -> PlannedTrajectory | None:
        """The one-point trajectory holding the setpoint the controller is at when the tick of ``step`` comes
        (the previous trajectory's point of step - 1), latched while the hold lasts; None before any anchor."""
        if self._sent is None:
            return None
        if not self.holding:
            action, _, arm, _, gripper = self._sent.at(step - 1)
            self._sent = _Sent(step - 1, action[None].copy(), arm[None].copy(), gripper[None].copy())
            self.holding = True
        sent, m = self._sent, self.mapping
        return PlannedTrajectory(step, sent.actions, m.arm_joints, sent.arm, m.gripper_joints, sent.gripper)

    def action_at(self, step: int) -> np.ndarray:
        """(A,) the action the trajectory sent last has at ``step`` (its last past its end; the measured before any)."""
        return self._sent.at(step)[0].copy()

    def release(self) -> None:
        """The hold ended: the next trajectory goes on from the held point, at rest."""
        self.holding = False

    def _filter_actions(self, actions: np.ndarray, seam: np.ndarray, velocity: np.ndarray) -> np.ndarray:
        """(P, A) the actions through the action-space `SafetyFilter`, stepped on from the seam as the per-tick
        output steps it; a delta action adds to the command before it."""
        low, high, vmax, amax = self._action_limits
        limits = SafetyFilter(self.period, actions.shape[1], low, high, vmax, amax)
        limits.start_from(seam, velocity / self.period)
        if not self.delta:
            return limits.run(actions)
        return np.stack([limits.step(limits.last_command + a) for a in actions])

    def _filter_joints(self, arm: np.ndarray, seam: np.ndarray, velocity: np.ndarray) -> tuple[np.ndarray, int]:
        """(P, J) joint positions clamped to the joints' limits and their velocity to the URDF's, from the seam on;
        and how many points the velocity limits moved."""
        limits = SafetyFilter(self.period, arm.shape[1], self._joint_low, self._joint_high, self._joint_velocity)
        limits.start_from(seam, velocity / self.period)
        out = limits.run(arm)
        clamped = np.clip(arm, self._joint_low, self._joint_high)
        return out, int((np.abs(out - clamped) > 1e-9).any(axis=1).sum())
