"""Scheduled events: what a task changes in its own world mid-episode, one rule for every backend.

Some tasks have surprises inside the inference window (``sim.tasks.track_reverse``: the ball turns
back or changes speed at random times; ``sim.tasks.push_impulse``: the cube is knocked away), so an
observation a few steps old no longer predicts the present. Such a task (`EventTask`) draws each episode's events when the episode starts, from the
world's own random stream right after its initial state: equal seeds, equal events. An event
sets a contiguous range of the world's velocities (``task.event_dofs``, e.g. a ball's slide
joints) to a drawn value at a drawn control step, whatever the arm does.

Both MuJoCo backends keep the N worlds' schedules of the current episodes in an
:class:`EventSchedules` (numpy on the cpu backend, torch tensors on the warp backend's device) and
run the one rule, :meth:`EventSchedules.fire`, after each control step's physics: event j of world i
fires when that world's ``episode_step`` (the steps taken in its episode, this one included)
reaches ``steps[i, j]``. The state after that step (its observation, the privileged state) already
has the new velocity; its positions are those the old velocity reached. As in
``sim.batched_success``, the rule uses only what means the same on numpy arrays and torch tensors,
plus :func:`where`, so the warp backend applies it on the device with no host round-trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mujoco
import numpy as np
import torch


class EventTask(Protocol):
    """What a task (`sim.tasks.base.Task`) whose episodes carry scheduled events adds (see the
    module docstring)."""

    max_events: int  # E, events drawn per episode: none comes after the E-th

    def event_dofs(self, model: mujoco.MjModel) -> slice:
        """The contiguous range of ``qvel`` an event sets (k dofs)."""
        ...

    def sample_events(
        self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """One episode's events, drawn right after ``sample_initial_state`` wrote ``data`` (same
        ``rng``): steps (E,) int64, strictly increasing, each >= 1; velocities (E, k) float64."""
        ...


def has_events(task: Any) -> bool:
    """Whether ``task`` schedules events (implements `EventTask`)."""
    return hasattr(task, "sample_events")


def check_control_period(task: Any, control_dt: float) -> None:
    """Refuse an env stepping ``control_dt`` seconds for a task whose events are drawn for another control period
    (``task.control_dt``: a velocity that covers a distance in so many steps), before anything is built."""
    planned = getattr(task, "control_dt", None) if has_events(task) else None
    if planned is not None and abs(planned - control_dt) > 1e-9:
        raise ValueError(f"task {task.name} draws its events for a control period of {planned} s, but the env "
                         f"steps {control_dt} s: set --env.substeps={round(planned / 0.002)}")  # fmt: skip


def draw_events(task: EventTask, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> dict:
    """One world's new episode's events, as :meth:`EventSchedules.load` takes them: {"steps": (E,),
    "velocity": (E, k)}, drawn by the task from ``rng`` right after its initial state (in ``data``)."""
    steps, velocity = task.sample_events(model, data, rng)
    return {"steps": steps, "velocity": velocity}


def where(condition: Any, a: Any, b: Any) -> Any:
    """``a`` where ``condition`` holds, else ``b``, elementwise: numpy arrays or torch tensors."""
    return torch.where(condition, a, b) if torch.is_tensor(condition) else np.where(condition, a, b)


@dataclass
class EventSchedules:
    """The events of N worlds' current episodes: numpy arrays or torch tensors throughout."""

    dofs: slice  # the range of qvel an event sets (k dofs)
    steps: Any  # (N, E) long: the episode step at whose end event j fires
    velocity: Any  # (N, E, k): what it sets the dofs to

    @classmethod
    def of(cls, task: Any, model: mujoco.MjModel, num_envs: int) -> EventSchedules | None:
        """Empty schedules (no event fires) for ``task``'s N worlds, on the host; None for a task
        without events."""
        if not has_events(task):
            return None
        dofs = task.event_dofs(model)
        steps = np.full((num_envs, task.max_events), -1, dtype=np.int64)  # -1: never (steps count from 1)
        return cls(dofs, steps, np.zeros((num_envs, task.max_events, dofs.stop - dofs.start)))

    def to_torch(self, device: torch.device, dtype: torch.dtype) -> EventSchedules:
        """The same schedules as tensors on ``device``, velocities in ``dtype`` (the backend's qvel's)."""
        steps = torch.as_tensor(self.steps, dtype=torch.long, device=device)
        return EventSchedules(self.dofs, steps, torch.as_tensor(self.velocity, dtype=dtype, device=device))

    def snapshot(self, worlds: np.ndarray) -> list[dict[str, np.ndarray]]:
        """The schedules of ``worlds`` (k,), one per world as host arrays: {"steps": (E,) int64,
        "velocity": (E, k) float64}. From the device: one copy to the host for all of them."""
        if torch.is_tensor(self.steps):
            idx = torch.as_tensor(worlds, dtype=torch.long, device=self.steps.device)
            steps, velocity = self.steps[idx].cpu().numpy(), self.velocity[idx].double().cpu().numpy()
        else:
            steps, velocity = self.steps[worlds], self.velocity[worlds]
        return [{"steps": s.copy(), "velocity": v.copy()} for s, v in zip(steps, velocity)]

    def load(self, worlds: Any, snapshots: list[dict[str, np.ndarray]]) -> None:
        """Give ``worlds`` (k,) the schedules ``snapshots`` (from :meth:`snapshot` or :func:`draw_events`)."""
        steps = np.stack([s["steps"] for s in snapshots])
        velocity = np.stack([s["velocity"] for s in snapshots])
        if torch.is_tensor(self.steps):
            idx = torch.as_tensor(worlds, dtype=torch.long, device=self.steps.device)
            self.steps[idx] = torch.as_tensor(steps, device=self.steps.device)
            self.velocity[idx] = torch.as_tensor(velocity, dtype=self.velocity.dtype).to(self.steps.device)
        else:
            self.steps[worlds], self.velocity[worlds] = steps, velocity

    def fire(self, episode_step: Any, qvel: Any, worlds: slice = slice(None)) -> Any:
        """The event rule, after a control step's physics: in each world of ``worlds`` whose
        ``episode_step`` (its episode's steps, this one included) is an event's step, set
        ``qvel[:, dofs]`` to that event's velocity, exactly. Returns (n,) bool: an event fired.

        episode_step: (n,) the selected worlds' steps; qvel: (n, nv), written in place. Steps are
        strictly increasing, so at most one event per world fires at a step.
        """
        hit = self.steps[worlds] == episode_step[:, None]  # (n, E)
        fired = hit.any(axis=1)
        new = (hit[:, :, None] * self.velocity[worlds]).sum(axis=1)  # (n, k): the firing event's (+ exact zeros)
        qvel[:, self.dofs] = where(fired[:, None], new, qvel[:, self.dofs])
        return fired
