"""The serve node's record of what happened: counters, rejections per cause, latencies, the last error.

Every part of the node (inputs, hold, chunk scheduler) counts into one `BridgeDiagnostics`; the
node publishes :meth:`BridgeDiagnostics.message` on /diagnostics and returns its values as the
final summary. No ROS import at module level.
"""

from __future__ import annotations

from collections import deque

import numpy as np

# The node's states; the DiagnosticStatus level (OK, WARN, ERROR) each is reported with.
STATE_LEVELS = {"RUNNING": "OK", "LOADING": "WARN", "HOLDING": "WARN", "ESTOP": "WARN", "FAILED": "ERROR"}
# excess_states: joint states that ticked no command (clock=joint_states, arriving faster than control_hz).
# unpaired_observations: requests not made because a camera had no image within safety.pair_tolerance_s.
# description_rejected: robot descriptions (URDF) refused. output=trajectory: trajectories sent, ik_failures
# (chunks not sent: a waypoint out of reach), velocity_limited_points (points the joints' velocity limits
# slowed), trajectory_goals_accepted and trajectory_rejected (goals of the FollowJointTrajectory action the server
# took, and refused or could not take: none was up). overrun_ticks: ticks whose work after the command (merging a
# chunk, the next request, planning the trajectory: with an end-effector policy its IK, tens of ms for a long
# chunk) took longer than a control period, delaying the next tick; counted from the node's start.
# low_latency_fallbacks: ticks whose low-latency part could not act (`robot_bridge.low_latency`), which sent the
# uncorrected action.
COUNTERS = ("ticks", "missed_deadlines", "rejected_messages", "out_of_order", "stale_events", "chunks",
            "dropped_chunks", "policy_errors", "invalid_chunks", "load_failures", "delay_clamped",
            "excess_states", "description_rejected", "trajectories", "ik_failures", "velocity_limited_points",
            "trajectory_goals_accepted", "trajectory_rejected", "unpaired_observations", "overrun_ticks",
            "low_latency_fallbacks")  # fmt: skip


class BridgeDiagnostics:
    """Counts and latencies of one serve node."""

    def __init__(self) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.rejections: dict[str, int] = {}  # kind of rejected input (InputRejected.kind) -> messages
        self.last_error = ""
        self.latencies_ms: list[float] = []  # request -> result, per merged chunk
        self.obs_to_command_ms: list[float] = []  # joint state arrival -> first command of its chunk
        # the low-latency part's time on its latest ticks (its observation built, then the part), before the command
        self.low_latency_ms: deque[float] = deque(maxlen=1000)
        self.after_command_max_ms = 0.0  # longest work after a tick's command (see overrun_ticks)
        # Whether the control process got real-time scheduling and locked memory ("granted", or why
        # not); `serve` fills it in, and it is reported with the other values.
        self.scheduling: dict[str, str] = {}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def rejected(self, kind: str) -> None:
        """One input message rejected for ``kind``."""
        self.counters["rejected_messages"] += 1
        self.rejections[kind] = self.rejections.get(kind, 0) + 1

    def values(self, state: str, cause: str | None, live: dict[str, str]) -> dict[str, str]:
        """The node's state and cause, the latency summary, ``live`` (queue depth, ...), every count
        and the scheduling, as text."""
        lat = self.latencies_ms[-100:]
        values = {
            "state": state,
            "cause": cause or "",
            "inference_latency_ms": f"{lat[-1]:.2f}" if lat else "",
            "inference_latency_p50_ms": f"{np.percentile(lat, 50):.2f}" if lat else "",
            "after_command_max_ms": f"{self.after_command_max_ms:.2f}",
            "low_latency_p99_ms": f"{np.percentile(self.low_latency_ms, 99):.2f}" if self.low_latency_ms else "",
            **live,
            "last_error": self.last_error,
        }
        values.update({k: str(v) for k, v in self.counters.items()})
        values.update({f"rejected_{kind}": str(n) for kind, n in sorted(self.rejections.items())})
        values.update(self.scheduling)
        return values

    @staticmethod
    def message(state: str, cause: str | None, values: dict[str, str], hardware_id: str, stamp, warning: str = ""):
        """diagnostic_msgs/DiagnosticArray of one status: the node's state, its cause, and ``values``;
        ``warning``: faults that do not hold (another commander under ``other_commanders: warn``, incompatible QoS),
        which raise an OK report to WARN and follow the state in its message."""
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

        level = STATE_LEVELS[state] if not (warning and STATE_LEVELS[state] == "OK") else "WARN"
        status = DiagnosticStatus(
            level=getattr(DiagnosticStatus, level), name="vla_rl serve", hardware_id=hardware_id,
            message=state + (f": {cause}" if cause else "") + (f"; {warning}" if warning else ""),
            values=[KeyValue(key=k, value=v) for k, v in values.items()],
        )  # fmt: skip
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = stamp
        return msg
