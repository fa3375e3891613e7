"""Reach-switch: move the gripper to the ball the instruction names, when the instruction changes mid-task.

SwitchVLA's setting on the smallest scene that has it: a red and a blue ball float in the workspace, the episode's
first instruction names one of them (a coin flip), and in most episodes (``switch_probability``) the instruction
switches to the other at a random control step. Success is judged on the instruction in force: the grasp site within
``success_distance`` of the ball it names now. Touching the other ball, the one the instruction in force does not name,
ends the episode as a failure (the task's ``failure`` rule): a policy that keeps running the plan made under the old
instruction touches the ball it was told to leave; one that reacts at once stops in time.

The instruction in force is the world's own state (``sim/assets/panda_reach_switch.xml``): the qpos of the
``instruction`` slide joint, 0 for the first of ``instructions`` (red), 1 for the second (blue). A switch at step S is
two scheduled events (`sim.events`): after step S - 1 the joint gets the velocity that carries it to the other value
over one control step, after step S zero. The observation after S control steps is the first to carry the new
instruction (``observation.task`` per world; `instructions`), and success from that step on is judged on it. Being
state, it is saved, restored and judged like the balls' places, and equal seeds give equal switches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np

from sim.batched_success import WorldArrays, vector_norm
from sim.tasks.base import step_toward
from sim.tasks.scene import place_mocap_body, reset_arm_near_home, scene_path

BALLS = ("red", "blue")  # the ball each value of the instruction joint names: qpos 0 -> red, 1 -> blue
NEVER = 10**9  # the step of a switch that does not happen (past every episode's limit)


@dataclass
class ReachSwitchTask:
    name: str = "reach_switch"
    # What each value of the instruction joint says (BALLS' order); every observation carries the one in force
    # (`instructions_of`).
    instructions: tuple[str, str] = ("move the gripper to the red ball", "move the gripper to the blue ball")
    # Where the balls float (metres, world frame): reach's box, in view of the `front` camera.
    target_x_range: tuple[float, float] = (0.40, 0.65)
    target_y_range: tuple[float, float] = (-0.20, 0.20)
    target_z_range: tuple[float, float] = (0.04, 0.20)  # below the gripper's start height (about 0.24 m)
    min_apart: float = 0.15  # metres between the balls' centres, at least: a switch is a real change of course
    min_start_distance: float = 0.12  # metres from the gripper's start to either ball: no episode starts solved
    switch_probability: float = 0.8  # episodes whose instruction switches; the others keep their first
    # The step S of a switch, uniform over this range (both included). Chosen by the scripted expert acting on what
    # each reaction leaves it at a delay of 8 steps in chunks of 8 (README, "Instructions that change mid-task").
    switch_steps: tuple[int, int] = (8, 20)
    arm_joint_noise: float = 0.05  # radians, std of the joints around home
    success_distance: float = 0.03  # metres, grasp site to the named ball's centre
    control_dt: float = 0.05  # seconds per control step, the env's default (`EnvConfig.substeps` = 25)
    max_episode_steps: int = 40  # 2 s at 20 Hz
    max_events: int = 2  # a switch: the instruction joint's velocity set, then zeroed

    @property
    def instruction(self) -> str:
        """The first of ``instructions``: the task's name for itself where one string is asked for."""
        return self.instructions[0]

    def xml_path(self) -> str:
        return scene_path("panda_reach_switch.xml")

    def sample_initial_state(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Write a random initial state into ``data`` (then the caller runs mj_forward): the arm near home, the two
        balls apart and away from the gripper, the first instruction. Always the same number of draws."""
        reset_arm_near_home(model, data, rng, self.arm_joint_noise)
        mujoco.mj_kinematics(model, data)
        gripper = data.site("grasp").xpos.copy()
        low, high = (np.array(r) for r in zip(self.target_x_range, self.target_y_range, self.target_z_range))
        while True:  # rejection sampling: most draws of the box are far enough apart
            red, blue = rng.uniform(low, high), rng.uniform(low, high)
            if (np.linalg.norm(red - blue) >= self.min_apart
                    and min(np.linalg.norm(red - gripper), np.linalg.norm(blue - gripper)) >= self.min_start_distance):  # fmt: skip
                break
        for name, where in zip(BALLS, (red, blue), strict=True):
            place_mocap_body(model, data, name, where)
            place_mocap_body(model, data, f"{name}_base", [where[0], where[1], 0.001])
        data.qpos[instruction_qpos(model)] = float(rng.integers(2))

    def event_dofs(self, model: mujoco.MjModel) -> slice:
        """The instruction joint's velocity."""
        dof = int(model.joint("instruction").dofadr[0])
        return slice(dof, dof + 1)

    def sample_events(
        self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """steps (2,) and velocities (2, 1): a switch at step S sets the velocity that carries the joint to the other
        value in one control step after step S - 1, and zero after step S; no switch puts both past every limit.
        Drawn from ``rng`` after the initial state (``data`` holds the first instruction); always two draws."""
        switches = rng.uniform() < self.switch_probability
        step = int(rng.integers(self.switch_steps[0], self.switch_steps[1] + 1))
        if not switches:
            return np.array([NEVER, NEVER + 1]), np.zeros((2, 1))
        first = data.qpos[instruction_qpos(model)]
        return np.array([step - 1, step]), np.array([[(1.0 - 2.0 * first) / self.control_dt], [0.0]])

    def privileged_state(self, model: mujoco.MjModel, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``target``: (3,) the centre of the ball the instruction in force names; ``avoid``: (3,) the other's;
        ``instruction``: (1,) the index of the one named (0 red, 1 blue)."""
        index = instruction_index(data.qpos[instruction_qpos(model)])
        return {"target": data.body(BALLS[index]).xpos.copy(), "avoid": data.body(BALLS[1 - index]).xpos.copy(),
                "instruction": np.array([float(index)])}  # fmt: skip

    def instructions_of(self, model: mujoco.MjModel, qpos: np.ndarray) -> list[str]:
        """The instruction in force in each world, from its qpos (n, nq)."""
        return [self.instructions[instruction_index(q)] for q in qpos[:, instruction_qpos(model)]]

    def success(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the grasp site is within ``success_distance`` of the ball the instruction in force names."""
        (red, blue), named_blue = self._near(model, worlds)
        return (red & ~named_blue) | (blue & named_blue)

    def failure(self, model: mujoco.MjModel, worlds: WorldArrays) -> Any:
        """(N,) bool: the grasp site is within ``success_distance`` of the ball the instruction in force does not
        name (the env ends such an episode without success)."""
        (red, blue), named_blue = self._near(model, worlds)
        return (red & named_blue) | (blue & ~named_blue)

    def _near(self, model: mujoco.MjModel, worlds: WorldArrays) -> tuple[tuple[Any, Any], Any]:
        """((N,) near red, (N,) near blue), (N,) the instruction in force names blue: numpy or torch, as worlds."""
        grasp = worlds.site_xpos[:, model.site("grasp").id]
        near = [vector_norm(grasp - worlds.xpos[:, model.body(ball).id]) <= self.success_distance for ball in BALLS]
        return (near[0], near[1]), worlds.qpos[:, instruction_qpos(model)] > 0.5


class ReachSwitchExpert:
    """Scripted expert for :class:`ReachSwitchTask`: a capped straight-line move to the ball the instruction in force
    names (privileged ``target``, so it follows every switch at once). Where that line would pass within
    ``clearance`` of the other ball (``avoid``: touching it fails the episode), it heads for a waypoint beside the
    other ball instead, ``clearance`` out from it on the side the line passes. No phases."""

    def __init__(self, num_envs: int, max_step: float = 0.035, clearance: float = 0.06):
        self.max_step, self.clearance = max_step, clearance

    def reset(self, env_mask: np.ndarray | None = None) -> None:
        """Nothing to restart: every action depends on the current state only."""

    def act(self, ee_pos: np.ndarray, privileged: dict[str, np.ndarray]) -> np.ndarray:
        """ee_pos (N, 3), privileged["target"], ["avoid"] (N, 3) -> actions (N, 4), gripper open."""
        target, avoid = privileged["target"], privileged["avoid"]
        line = target - ee_pos
        length = np.maximum(np.linalg.norm(line, axis=1, keepdims=True), 1e-9)
        along = np.clip(((avoid - ee_pos) * line).sum(axis=1, keepdims=True) / length**2, 0.0, 1.0)
        closest = ee_pos + along * line  # the line's point nearest the other ball
        side = closest - avoid
        gap = np.linalg.norm(side, axis=1, keepdims=True)
        # straight through the other ball: pass above it
        side = np.where(gap < 1e-6, np.array([0.0, 0.0, 1.0]), side / np.maximum(gap, 1e-9))
        blocked = (gap < self.clearance) & (along > 0.0) & (along < 1.0)
        goal = np.where(blocked, avoid + side * self.clearance, target)
        return step_toward(ee_pos, goal, np.zeros(len(ee_pos)), self.max_step)


def instruction_qpos(model: mujoco.MjModel) -> int:
    """The instruction joint's index in ``qpos``."""
    return int(model.joint("instruction").qposadr[0])


def instruction_index(value: float) -> int:
    """0 or 1 from the instruction joint's position (exactly 0 or 1 between switches, passing once through 0.5)."""
    return int(value > 0.5)
