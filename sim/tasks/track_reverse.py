"""Track-reverse: catch a green ball that turns back or changes speed at random times.

`track`'s scene, reset and success rule, with events (``sim.events``). On `track` the ball's motion
is fixed at the episode's start, so an observation a few steps old plus the actions since predict
the present and delay barely hurts; here the ball's future is not in its past. Its velocity
changes at random control steps drawn at reset from the world's own stream: after the start and
after each event ``min_gap`` steps pass, then every step brings the next event with probability
1 / (``mean_gap`` - ``min_gap`` + 1), memoryless (the time since the last event tells nothing about
the next), so events come every ``mean_gap`` steps on average (0.5 s at 20 Hz), often within one
inference window. At each event the ball draws a new speed from ``speed_range`` and turns back
with probability ``reverse_probability``; it stays on the y axis (left-right in the ``front``
camera). Two rules keep it within the arm's reach: it turns back at the first step it is
``wall`` from the middle (an event too, at a new speed), and an event never leaves it heading for
the wall it would reach within ``min_gap`` steps. So events are always ``min_gap`` steps apart
or more.

The events are written by the backend (`sim.events.EventSchedules.fire`), not by physics: the ball
is still frictionless slides that collide with nothing, so nothing else changes its velocity,
and where it is at every step is known when the events are drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco
import numpy as np

from sim.tasks.track import BALL_JOINTS, DRIFT, TrackTask, ball_velocity_dofs


@dataclass
class TrackReverseTask(TrackTask):
    name: str = "track_reverse"
    instruction: str = "catch the green ball as it changes direction"
    # m/s along +y or -y, drawn at reset and at every event: faster than track's, so 8 steps
    # (0.4 s) after a turn the ball is 8-16 cm from where it was heading
    speed_range: tuple[float, float] = (0.10, 0.20)
    min_gap: int = 4  # control steps from the start, or from an event, before the next can come (0.2 s)
    mean_gap: float = 10.0  # control steps between events on average (0.5 s)
    reverse_probability: float = 0.75  # an event turns the ball back; otherwise it goes on at its new speed
    # |y| (metres) at which the ball turns back, overshooting by one step's travel at most: well
    # within the arm's reach (|y| <= 0.35, `sim.arm`). From the start (|y| <= 0.06) or from one wall,
    # the next wall is 14 steps away or more.
    wall: float = 0.2
    control_dt: float = 0.05  # seconds per control step, the env's default (`EnvConfig.substeps` = 25)
    max_episode_steps: int = 50  # 2.5 s at 20 Hz
    # Events drawn per episode. The E-th comes after 12 * min_gap = 48 steps at the earliest (a wall
    # may bring one sooner, but crossing from wall to wall takes 40 steps or more); an env run past
    # the task's limit (`EnvConfig.max_episode_steps`) sees the ball go straight on after the last.
    max_events: int = 12

    def event_dofs(self, model: mujoco.MjModel) -> slice:
        """The ball's three slide joints' velocities."""
        return ball_velocity_dofs(model)

    def sample_events(
        self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """steps (E,) int64 and the ball's new velocities (E, 3), drawn from ``rng`` after the initial
        state (``data``: the ball's start and velocity). Always E draws of each kind, so the stream's
        next episode does not depend on how many fit in this one."""
        e, dt = self.max_events, self.control_dt
        gaps = self.min_gap + rng.geometric(1.0 / (self.mean_gap - self.min_gap + 1), size=e) - 1
        speeds = rng.uniform(*self.speed_range, size=e)
        turns = rng.uniform(size=e) < self.reverse_probability
        y = data.qpos[model.joint(BALL_JOINTS[1]).qposadr[0]]  # the ball's y, followed from event to event
        velocity = data.qvel[model.joint(BALL_JOINTS[1]).dofadr[0]]
        steps, new, step = np.empty(e, dtype=np.int64), np.empty(e), 0
        for j in range(e):
            heading = np.sign(velocity)
            to_wall = int(np.ceil((self.wall - heading * y) / abs(velocity * dt)))  # steps until |y| >= wall
            gap = min(to_wall, int(gaps[j]))  # the wall, if it comes first, turns the ball back
            y += velocity * gap * dt
            heading = -heading if gap == to_wall or turns[j] else heading
            if self.wall - heading * y < self.min_gap * speeds[j] * dt:  # the wall within min_gap steps
                heading = -heading
            step = steps[j] = step + gap
            velocity = new[j] = heading * speeds[j]
        return steps, new[:, None] * DRIFT
