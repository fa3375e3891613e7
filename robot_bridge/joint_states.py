"""The robot's state assembled by joint name from every JointState message, whoever publishes it.

An arm's driver and a gripper's driver often publish their own ``sensor_msgs/JointState``, on one topic or on
several, each at its own rate. `JointStateAssembly` keeps, for each joint the policy reads, the newest value with
its message's stamp and arrival; the state is complete once every joint has one, and each joint goes stale on its
own. A message is one source's: a source is the set of joint names it carries (rclpy's EventsExecutor passes no
publisher identity, and a driver publishes the same names every time), and its stamps must not go backwards.
Names the policy does not read are ignored. One joint reported by two sources with values further apart than
``agreement_tolerance`` at stamps within ``AGREEMENT_WINDOW_S`` of each other is a fault: two drivers disagree
about where the robot is. A joint is never moved back in time: a source's value older than another's is not
taken. No ROS import here.
"""

from __future__ import annotations

import math

import numpy as np

from robot_bridge.codec import InputRejected

# Two sources' values of one joint are compared only when their stamps are this close (seconds): the same instant,
# where a moving joint has not moved (1 rad/s: 5 mrad, under the default tolerance of 10).
AGREEMENT_WINDOW_S = 0.005


def source_name(names: frozenset[str] | list[str], wanted: list[str]) -> str:
    """A source's name in faults and logs: ``joint_states`` and the wanted joints it carries, in state order."""
    carried = [n for n in wanted if n in names]
    shown = carried if len(carried) <= 3 else [carried[0], "..", carried[-1]]
    return f"joint_states [{' '.join(shown)}]"


class JointStateAssembly:
    """The newest value, stamp (s) and arrival (monotonic s) of each joint in ``wanted`` (the state's order)."""

    def __init__(self, wanted: list[str], agreement_tolerance: float, agreement_window_s: float = AGREEMENT_WINDOW_S):
        self.wanted = list(wanted)
        self.index = {n: i for i, n in enumerate(self.wanted)}
        self.agreement_tolerance, self.agreement_window_s = agreement_tolerance, agreement_window_s
        self.values = np.full(len(self.wanted), np.nan)
        self.stamps = np.full(len(self.wanted), -math.inf)
        self.arrivals = np.full(len(self.wanted), -math.inf)
        self.owners: list[frozenset[str] | None] = [None] * len(self.wanted)  # the source that set each joint

    def read(self, names: list[str], positions) -> tuple[frozenset[str], np.ndarray, np.ndarray]:
        """A message's names and positions -> (its source, the indices in the state of the wanted joints it
        carries, their values). InputRejected for names and positions of different lengths, or a non-finite
        value of a wanted joint; a message with none of them carries nothing (empty indices)."""
        positions = np.asarray(positions, dtype=np.float64)
        if positions.ndim != 1 or len(names) != len(positions):
            raise InputRejected(f"joint_states has {len(names)} names but {positions.size} positions", "wrong_length")
        carried = [(self.index[n], k) for k, n in enumerate(names) if n in self.index]
        indices = np.array([i for i, _ in carried], dtype=np.int64)
        values = positions[[k for _, k in carried]] if carried else np.empty(0)
        if not np.isfinite(values).all():
            bad = [self.wanted[i] for i, v in zip(indices, values) if not np.isfinite(v)]
            raise InputRejected(f"joint_states has non-finite values for {bad}", "not_finite")
        return frozenset(names), indices, values

    def disagreement(self, source: frozenset[str], indices: np.ndarray, values: np.ndarray, stamp: float) -> str:
        """Why this message disagrees with another source about a joint both report (near in stamp), or ""."""
        for i, value in zip(indices.tolist(), values.tolist()):
            owner = self.owners[i]
            if owner is None or owner == source or abs(stamp - self.stamps[i]) > self.agreement_window_s:
                continue
            if abs(value - self.values[i]) > self.agreement_tolerance:
                return (f"{self.wanted[i]} is {self.values[i]:g} from {source_name(owner, self.wanted)} and {value:g} "
                        f"from {source_name(source, self.wanted)} (tolerance {self.agreement_tolerance:g}): two "
                        f"drivers report it; remove one, or raise safety.joint_agreement_tolerance")  # fmt: skip
        return ""

    def take(
        self, source: frozenset[str], indices: np.ndarray, values: np.ndarray, stamp: float, arrival: float
    ) -> bool:
        """Record a checked message's joints, each unless another source reported it at a newer stamp (a lagging
        driver never moves a joint back in time); whether any was taken."""
        newer = [
            k for k, i in enumerate(indices.tolist()) if self.owners[i] in (None, source) or stamp >= self.stamps[i]
        ]
        indices, values = indices[newer], values[newer]
        self.values[indices] = values
        self.stamps[indices] = stamp
        self.arrivals[indices] = arrival
        for i in indices.tolist():
            self.owners[i] = source
        return bool(newer)

    @property
    def complete(self) -> bool:
        return bool(np.isfinite(self.values).all())

    def missing(self) -> list[str]:
        """The joints no message has reported yet."""
        return [n for n, v in zip(self.wanted, self.values) if not np.isfinite(v)]

    def stale(self, now: float, limit: float) -> list[str]:
        """The joints reported (or not at all) longer than ``limit`` seconds before ``now`` (monotonic)."""
        return [n for n, a in zip(self.wanted, self.arrivals) if now - a > limit]
