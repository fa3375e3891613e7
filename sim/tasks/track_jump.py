"""Track-jump: touch a green ball that jumps to a new place at random times.

`track`'s scene and success rule, with events (``sim.events``). On `track_reverse` the ball only
turns on its line, so a hand left in the middle of its band meets it again whatever the delay, and
delay cost the plain policy at most 17 points there. Here the ball rests, and at random control
steps it jumps to a new place drawn anywhere in a box in front of the arm, at least ``min_jump``
from where it was: it never comes back to a hand that stayed behind. A hand reaches the new place
only by seeing the jump, and must get there before the next one: an observation d steps old costs
d steps of every window between jumps.

A jump is two events: at the first the ball's velocity is set so that it covers the jump in
``jump_steps`` control steps, and ``jump_steps`` later it is set to zero, so the ball lands where
drawn. The rests between jumps are memoryless as on `track_reverse`: after the start and after each
landing ``min_gap`` steps pass, then every step brings the next jump with probability
1 / (``mean_gap`` - ``min_gap`` + 1), so a rest lasts ``mean_gap`` steps on average and the time
since the last jump tells nothing about the next. Everything is drawn at reset from the world's own
stream (equal seeds, equal jumps), and since the ball is frictionless slides that collide with
nothing, where it is at every step is known then.
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco
import numpy as np

from sim.tasks.base import step_toward
from sim.tasks.track import BALL_JOINTS, TrackTask, ball_velocity_dofs


@dataclass
class TrackJumpTask(TrackTask):
    name: str = "track_jump"
    instruction: str = "touch the green ball wherever it jumps"
    # The box the ball starts and lands in (metres, world frame): in front of the arm, in view of
    # the `front` camera, within reach (`sim.arm`); the start keeps track's min_start_distance.
    target_x_range: tuple[float, float] = (0.42, 0.62)
    target_y_range: tuple[float, float] = (-0.15, 0.15)
    target_z_range: tuple[float, float] = (0.05, 0.17)
    speed_range: tuple[float, float] = (0.0, 0.0)  # the ball rests between jumps, from the start on
    min_jump: float = 0.10  # metres between where the ball was and where it lands, at least
    landing_draws: int = 8  # candidates per jump: the first far enough, else the farthest (fixed draws)
    jump_steps: int = 2  # control steps a jump takes (0.1 s)
    min_gap: int = 3  # control steps of rest from the start, or from a landing, before the next jump
    mean_gap: float = 10.0  # control steps of rest on average (0.5 s)
    control_dt: float = 0.05  # seconds per control step, the env's default (`EnvConfig.substeps` = 25)
    max_episode_steps: int = 50  # 2.5 s at 20 Hz
    # Jumps drawn per episode (two events each). The J-th lands after J * (min_gap + jump_steps) = 60
    # steps at the earliest, past the task's limit; an env run past it sees the ball rest after the last.
    max_jumps: int = 12

    @property
    def max_events(self) -> int:
        return 2 * self.max_jumps

    def event_dofs(self, model: mujoco.MjModel) -> slice:
        """The ball's three slide joints' velocities."""
        return ball_velocity_dofs(model)

    def sample_events(
        self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """steps (2J,) int64 and the ball's velocities (2J, 3): for jump j, at steps[2j] the velocity
        that carries it to its landing in ``jump_steps`` steps, at steps[2j + 1] zero. Drawn from
        ``rng`` after the initial state (``data``: the ball's start); always the same number of draws,
        so the stream's next episode does not depend on how many jumps fit in this one."""
        j, dt = self.max_jumps, self.control_dt
        rests = self.min_gap + rng.geometric(1.0 / (self.mean_gap - self.min_gap + 1), size=j) - 1
        low, high = (np.array(r) for r in zip(self.target_x_range, self.target_y_range, self.target_z_range))
        candidates = rng.uniform(low, high, size=(j, self.landing_draws, 3))
        where = np.array([data.qpos[model.joint(joint).qposadr[0]] for joint in BALL_JOINTS])
        steps, velocity, step = np.empty(2 * j, dtype=np.int64), np.zeros((2 * j, 3)), 0
        for k in range(j):
            distance = np.linalg.norm(candidates[k] - where, axis=1)
            far = np.flatnonzero(distance >= self.min_jump)
            landing = candidates[k, far[0] if len(far) else int(np.argmax(distance))]
            steps[2 * k] = step + rests[k]
            steps[2 * k + 1] = step = steps[2 * k] + self.jump_steps
            velocity[2 * k] = (landing - where) / (self.jump_steps * dt)
            where = landing
        return steps, velocity


class TrackJumpExpert:
    """Scripted expert for :class:`TrackJumpTask`: a capped straight-line move toward where the ball
    is one step from now (its privileged position and velocity: mid-jump, the jump's next point;
    at rest, where it is). It has no phases, so ``reset`` has nothing to restart."""

    def __init__(self, num_envs: int, max_step: float = 0.025, control_dt: float = 0.05):
        self.max_step = max_step
        self.control_dt = control_dt

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        """Nothing to restart: every action depends on the current state only."""

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged["target"], ["target_vel"] (N, 3) -> actions (N, 4), gripper open."""
        aim = privileged["target"] + privileged["target_vel"] * self.control_dt
        return step_toward(ee_pos, aim, np.zeros(len(ee_pos)), self.max_step)
