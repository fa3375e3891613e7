"""Push-impulse: push the red cube to the green goal; at a random time something knocks it away.

`push`'s scene, reset and success rule, with one event (``sim.events``): at a control step drawn
uniformly from ``kick_steps`` (1 to 4 s in, mostly while the gripper approaches or pushes), the
cube's linear velocity is set to a kick of ``kick_speed_range`` in a uniformly drawn horizontal
direction, as a strike on its centre would. Friction stops it within 5 control steps (median; 10
at most), 5 cm away (median; 1 to 6.5), tumbled onto another face 7 times in 10 (measured on 200
kicks): a plan made before the kick pushes air, and one made on an observation from before it
aims where the cube no longer is. The kick is drawn at reset from
the world's own stream (equal seeds, equal kicks); what happens after it is physics.
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco
import numpy as np

from sim.tasks.push import PushTask


@dataclass
class PushImpulseTask(PushTask):
    name: str = "push_impulse"
    instruction: str = "push the red cube to the green target, however it is knocked"
    kick_steps: tuple[int, int] = (20, 80)  # the control step of the kick, uniform, both ends included
    kick_speed_range: tuple[float, float] = (0.8, 1.2)  # m/s, uniform, in the table plane
    max_events: int = 1

    def event_dofs(self, model: mujoco.MjModel) -> slice:
        """The cube's linear velocity: the first three dofs of its free joint (world frame)."""
        first = int(model.joint("cube").dofadr[0])
        return slice(first, first + 3)

    def sample_events(
        self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """steps (1,) int64: the kick's step; velocities (1, 3): the cube's linear velocity it sets."""
        step = rng.integers(self.kick_steps[0], self.kick_steps[1] + 1)
        angle, speed = rng.uniform(-np.pi, np.pi), rng.uniform(*self.kick_speed_range)
        return np.array([step], dtype=np.int64), np.array([[speed * np.cos(angle), speed * np.sin(angle), 0.0]])
