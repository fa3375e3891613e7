"""The simulated robot's joint trajectory controller (`vla-rl sim-robot --input=trajectory`): what a
ros2_control robot's joint_trajectory_controller does with the trajectories `vla-rl serve
--output=trajectory` sends, at the physics rate. Plain numpy; no ROS, no simulator.

The rules (joint_trajectory_controller's, for trajectories of positions only):

- a trajectory's points are at its start time plus each one's ``time_from_start``; the start time is
  its header stamp, or the time it arrives when the stamp is 0;
- replacement: the trajectory in force runs until the new one's start; from there the new one runs,
  from the setpoint the old one had at that instant (so the setpoint never jumps) to its points. A
  start already past runs from now; its points already past are dropped; a trajectory that ends in the
  past is rejected;
- between points the setpoint is interpolated linearly in time. Linear, not cubic: the trajectories
  carry positions only, for which joint_trajectory_controller interpolates linearly too (cubic needs
  velocities, quintic accelerations), and a linear setpoint never overshoots its points (a cubic through
  them can, past a joint limit); the servos' own dynamics round the corners;
- after its last point the setpoint holds that point: each control tick that starts there is starved
  (the trajectory ran out before the next one arrived).

Times are integer nanoseconds on the robot's clock.
"""

from __future__ import annotations

import numpy as np


class TrajectoryFollower:
    """The piecewise-linear setpoint of ``len(joint_names)`` joints: knots at ``times`` (K,) ns, ``positions``
    (K, J). Empty until the first trajectory; :meth:`clear` empties it (a new episode)."""

    def __init__(self, joint_names: list[str]) -> None:
        self.joint_names = list(joint_names)
        self.times = np.zeros(0, dtype=np.int64)  # (K,) ns, increasing
        self.positions = np.zeros((0, len(self.joint_names)))  # (K, J)

    @property
    def active(self) -> bool:
        """Whether a trajectory is in force (one arrived since the last clear)."""
        return len(self.times) > 0

    @property
    def end_ns(self) -> int:
        """When the trajectory in force reaches its last point."""
        return int(self.times[-1])

    def offer(self, start_ns: int, time_from_start_ns: np.ndarray, positions: np.ndarray, now_ns: int,
              current: np.ndarray) -> str | None:  # fmt: skip
        """Take a trajectory (start stamp, 0 = now; its points' times (P,) ns, strictly increasing; positions (P,
        J)) that arrived at ``now_ns``; ``current`` (J,) is the setpoint when none is in force. Returns why it
        was rejected, or None."""
        start = now_ns if start_ns == 0 else start_ns
        absolute = start + np.asarray(time_from_start_ns, dtype=np.int64)  # (P,)
        if absolute[-1] <= now_ns:
            return f"stale: it ends {(now_ns - absolute[-1]) / 1e9:.3f} s in the past"
        begin = max(start, now_ns)  # a start already past runs from now
        positions = np.asarray(positions, dtype=np.float64)
        at_begin = absolute == begin  # a point at the start itself is where the new one starts
        seed = positions[at_begin][-1] if at_begin.any() else (self.setpoint(np.array([begin]))[0] if self.active
                                                                else np.asarray(current, dtype=np.float64))  # fmt: skip
        keep_old = self.times < begin
        # Knots before the last one at or before now are history: dropped.
        keep_old &= np.arange(len(self.times)) >= max(0, int(np.searchsorted(self.times, now_ns, "right")) - 1)
        ahead = absolute > begin
        self.times = np.concatenate([self.times[keep_old], [begin], absolute[ahead]])
        self.positions = np.vstack([self.positions[keep_old], seed[None], positions[ahead]])
        return None

    def setpoint(self, times_ns: np.ndarray) -> np.ndarray:
        """(T, J) the setpoint at each of ``times_ns`` (T,): linear between knots, the first knot's before it and
        the last one's after it."""
        origin = self.times[0]
        t = (np.asarray(times_ns, dtype=np.int64) - origin).astype(np.float64)
        knots = (self.times - origin).astype(np.float64)
        return np.stack([np.interp(t, knots, self.positions[:, j]) for j in range(self.positions.shape[1])], axis=1)

    def starved(self, tick_start_ns: int) -> bool:
        """Whether a control tick that starts at ``tick_start_ns`` has no point left to move toward."""
        return self.active and tick_start_ns >= self.end_ns

    def clear(self) -> None:
        """Forget the trajectory in force (a new episode: the previous episode's trajectories no longer apply)."""
        self.times = self.times[:0]
        self.positions = self.positions[:0]


class TrackingError:
    """The running tracking error of the arm's joints against the setpoint, rad: RMS over every joint of every
    tick a trajectory drove, and the largest."""

    def __init__(self) -> None:
        self.sum_squares, self.count, self.max = 0.0, 0, 0.0

    def add(self, measured: np.ndarray, setpoint: np.ndarray) -> None:
        """One tick: the measured joints (J,) at its end against the setpoint (J,) there."""
        error = np.asarray(measured, dtype=np.float64) - np.asarray(setpoint, dtype=np.float64)
        self.sum_squares += float((error**2).sum())
        self.count += error.size
        self.max = max(self.max, float(np.abs(error).max()))

    @property
    def rms(self) -> float:
        return (self.sum_squares / self.count) ** 0.5 if self.count else 0.0
