"""Hold and watchdog: whether a tick may send the policy's action, the node's state, and the safe command.

The node holds (repeats the previous command; the measured position before any command) whenever
it cannot trust the next action, and names the cause: e-stop, policy loading or failed to load, a
rejected input, a stale input, a policy exception or an invalid chunk. The cause's key leaves out
the details that change from message to message (a value, a stamp), so a persisting fault is one
state change: logged once, counted once. Every command, hold or not, goes through the
`SafetyFilter`. No ROS import here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from robot_bridge.commanders import CommanderWatch
from robot_bridge.config import ServeConfig
from robot_bridge.description import DescriptionSource
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.inputs import BridgeInputs
from robot_bridge.log_limit import LogLimiter
from robot_bridge.safety import SafetyFilter

if TYPE_CHECKING:
    from robot_bridge.chunk_scheduler import ChunkScheduler


class Hold:
    """The node's state (RUNNING, LOADING, HOLDING, ESTOP, FAILED), its cause, and the safety-filtered command.

    ``logger`` has rclpy's ``info``/``warning``/``error``; ``log_limiter`` rate-limits what repeats;
    ``description`` (optional): the robot description's source, whose problem (none yet, or rejected) holds;
    ``commanders`` (optional): the other publishers on the command topics, which hold with ``other_commanders:
    hold``.
    """

    def __init__(
        self,
        config: ServeConfig,
        period: float,
        inputs: BridgeInputs,
        scheduler: ChunkScheduler,
        diagnostics: BridgeDiagnostics,
        log_limiter: LogLimiter,
        logger,
        description: DescriptionSource | None = None,
        commanders: CommanderWatch | None = None,
    ) -> None:
        self.config, self.period, self.description, self.commanders = config, period, description, commanders
        self.inputs, self.scheduler, self.diagnostics = inputs, scheduler, diagnostics
        self.log_limiter, self.logger = log_limiter, logger
        s = config.safety
        self.safety = SafetyFilter(
            period, len(config.action_names), s.position_min, s.position_max, s.max_velocity, s.max_acceleration
        )
        self.state = "LOADING"
        self.cause: str | None = "loading the policy"
        self._cause_key: str | None = "worker loading"  # what the cause is, without its changing details
        self._last_state_tick = time.monotonic()

    # -- e-stop and watchdog ---------------------------------------------------------------------

    def on_estop(self, msg) -> None:
        """std_msgs/Bool: True latches a hold until False arrives."""
        if msg.data and not self.safety.estopped:
            self.safety.engage_estop()
            self.logger.error("E-STOP engaged: holding until False arrives on the estop topic")
        elif not msg.data and self.safety.estopped:
            self.safety.release_estop()
            self.logger.warning("e-stop released")

    def state_ticked(self, arrival: float) -> None:
        """A joint state ticked the control loop at ``arrival`` (monotonic)."""
        self._last_state_tick = arrival

    def watchdog_due(self, now: float) -> bool:
        """Whether joint states stopped for 1.5 periods: then the watchdog ticks (commanding the hold) every
        period until one arrives."""
        return now - self._last_state_tick > 1.5 * self.period

    # -- cause and state -------------------------------------------------------------------------

    def check(self, now: float) -> tuple[str | None, str | None]:
        """(key, text): why the next command must be a hold, or (None, None) when the policy's action can go out."""
        if self.safety.estopped:
            return "estop", "e-stop engaged"
        robot = self.description.problem() if self.description is not None else None
        commanders = self.commanders.problem() if self.commanders and self.config.other_commanders == "hold" else None
        for problem in (
            commanders,
            robot,
            self.scheduler.health.worker_problem(self.scheduler.worker.alive(), self.scheduler.worker.io_error),
            self.inputs.fault(),
        ):
            if problem is not None:
                return problem
        stale = self.inputs.stale(now)
        if stale:
            text = f"stale input (none newer than {self.config.safety.stale_after_s:g} s): {', '.join(stale)}"
            return "stale " + ", ".join(stale), text
        return self.inputs.pairing_problem(now) or self.scheduler.health.policy_problem() or (None, None)

    def update(self, key: str | None, cause: str | None) -> bool:
        """Take (key, cause) from :meth:`check` as the current one; True when the state changed (report it now)."""
        if key == self._cause_key:
            # The same cause with new details (the next out-of-order stamp, another value): the
            # diagnostics timer reports the newest text; no log line, no state change.
            if cause != self.cause:
                self.cause = cause
                self.diagnostics.last_error = cause or self.diagnostics.last_error
            return False
        if key is None:
            state = "RUNNING"
        elif self.safety.estopped:
            state = "ESTOP"
        elif self.scheduler.health.worker_state == "failed":
            state = "FAILED"
        elif self.scheduler.health.worker_state == "loading":
            state = "LOADING"
        else:
            state = "HOLDING"
        # Rejections, policy errors, load failures and the e-stop are logged where they are found;
        # only staleness (an absence: nothing arrives to be logged) and recovery are logged here.
        # Both are rate-limited: input that flickers between good and bad would flip the state every tick.
        if key is None:
            self.log_limiter("recovered", "info", f"{self.state} -> RUNNING (recovered from: {self.cause})")
        else:
            if key.startswith("stale"):
                self.diagnostics.count("stale_events")
                self.log_limiter(key, "warning", f"{state}: {cause}")
            self.diagnostics.last_error = cause
        self.state, self.cause, self._cause_key = state, cause, key
        return True

    # -- commands --------------------------------------------------------------------------------

    def command(self, target: np.ndarray | None) -> np.ndarray | None:
        """The safety-filtered command (A,) for this tick; a hold when target is None; None before any state."""
        if self.safety.last_command is None:
            if self.inputs.state is None:
                return None
            self.safety.start_from(self.measured_command())
        if target is None:
            return self.safety.hold()
        if self.config.action_mode == "delta":
            target = self.safety.last_command + target
        return self.safety.step(target)

    def set_limits(self, position_min: list[float], position_max: list[float], max_velocity: list[float]) -> None:
        """New position and velocity limits per action dim (the robot description's, once it is known); the
        command the filter holds and the e-stop carry over."""
        s, old = self.config.safety, self.safety
        self.safety = SafetyFilter(self.period, len(self.config.action_names), position_min, position_max,
                                   max_velocity, s.max_acceleration)  # fmt: skip
        self.safety.estopped = old.estopped
        if old.last_command is not None:
            self.safety.start_from(old.last_command)

    def start_episode(self) -> None:
        """The robot started a new episode (`ChunkScheduler.start_episode_if_due`): hold where it now is, as at
        start-up, not at the last episode's last command (the simulation holds a new episode's world still)."""
        if self.inputs.state is not None:
            self.safety.start_from(self.measured_command())

    def hold_target(self) -> np.ndarray:
        """(A,) what a hold sends now: the last command, or before any the measured one (the low-latency part
        corrects it when the queue ran dry, as simulation's shell corrects the arm's last target)."""
        last = self.safety.last_command
        return (self.measured_command() if last is None else last).astype(np.float64)

    def measured_command(self) -> np.ndarray:
        """(A,) the hold before any command: state entries named like the actions, else safety.initial_command."""
        cfg = self.config
        index = {n: i for i, n in enumerate(cfg.state_names)}
        state = self.inputs.state
        return np.array([state[index[n]] if n in index else cfg.safety.initial_command[n] for n in cfg.action_names])


class TickBudget:
    """Caps the control ticks of ``clock=joint_states`` at ``hz``, whatever rate the joint states arrive at.

    A token bucket: credit grows at ``hz`` per second, at most one tick of it banked; a state ticks when at
    least half a tick of credit is there, and spends one. A stream at the control rate ticks with every
    state even when one comes up to half a period early; a faster one (a flood, a driver publishing at its
    own rate) ticks at ``hz`` on average, and over any span T at most T * hz + 1.5 times.
    """

    def __init__(self, hz: float) -> None:
        self.hz = hz
        self.credit = 1.0
        self._last: float | None = None

    def allow(self, arrival: float) -> bool:
        """Whether the joint state that arrived at ``arrival`` (monotonic seconds) ticks the control loop."""
        if self._last is not None:
            self.credit = min(1.0, self.credit + (arrival - self._last) * self.hz)
        self._last = arrival
        if self.credit < 0.5:
            return False
        self.credit -= 1.0
        return True
