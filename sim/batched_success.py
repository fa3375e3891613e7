"""What the tasks' success rules read: N worlds' kinematic state, batched, from either backend.

Each task states its success rule once, as ``success(model, worlds)`` (``sim.tasks``), and every
backend evaluates that same rule: the cpu backend (and one-world callers) on numpy arrays read
from its ``MjData`` (:class:`HostWorlds`), the Warp backend on torch views of its device arrays
(:class:`DeviceWorlds`). As in ``sim.ik``, a rule uses only what means the same on numpy arrays
and torch tensors (arithmetic, comparisons, ``&``, ``|``, ``~``, ``abs``, basic indexing,
``sum``/``all`` with ``axis``) and the helpers here; torch alone would cost the cpu backend tens
of microseconds of op dispatch per step, numpy alone a host round-trip per step on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import mujoco
import numpy as np
import torch


class WorldArrays(Protocol):
    """N worlds after forward kinematics and collision: numpy arrays or torch tensors throughout."""

    qpos: Any  # (N, nq)
    xpos: Any  # (N, nbody, 3) body frame positions
    xmat: Any  # (N, nbody, 3, 3) body frame orientations
    site_xpos: Any  # (N, nsite, 3)
    contact_bodies: Any  # (C, 2) the bodies of the two geoms of each contact slot, all worlds' together
    contact_live: Any  # (C,) bool: the slot holds a contact (device backends keep spare slots)

    def any_per_world(self, flags: Any) -> Any:
        """(N,) bool: whether any contact slot of each world has its flag, from ``flags`` (C,) bool."""
        ...


def vector_norm(x: Any) -> Any:
    """(..., k) -> (...) Euclidean norms over the last axis, of a numpy array or a torch tensor."""
    return (x * x).sum(axis=-1) ** 0.5


def touches_gripper(model: mujoco.MjModel, worlds: WorldArrays, body: str) -> Any:
    """(N,) bool: a geom of ``body`` is in contact with a finger (it is still held or pushed)."""
    target, left, right = model.body(body).id, model.body("left_finger").id, model.body("right_finger").id
    b1, b2 = worlds.contact_bodies[:, 0], worlds.contact_bodies[:, 1]
    finger1, finger2 = (b1 == left) | (b1 == right), (b2 == left) | (b2 == right)
    return worlds.any_per_world(worlds.contact_live & (((b1 == target) & finger2) | ((b2 == target) & finger1)))


class HostWorlds:
    """:class:`WorldArrays` of host worlds (``MjData``, each with its positions forwarded and its
    contacts found), as numpy arrays, each gathered when a rule first reads it: a rule reads two or
    three of them, and the cpu backend judges every world at every step."""

    def __init__(self, model: mujoco.MjModel, datas: Sequence[mujoco.MjData]):
        self._model, self._datas = model, datas

    def _stack(self, field: str) -> np.ndarray:
        return np.stack([getattr(d, field) for d in self._datas])

    @cached_property
    def qpos(self) -> np.ndarray:
        return self._stack("qpos")

    @cached_property
    def xpos(self) -> np.ndarray:
        return self._stack("xpos")

    @cached_property
    def xmat(self) -> np.ndarray:
        return self._stack("xmat").reshape(len(self._datas), -1, 3, 3)

    @cached_property
    def site_xpos(self) -> np.ndarray:
        return self._stack("site_xpos")

    @cached_property
    def contact_bodies(self) -> np.ndarray:
        geoms = [d.contact.geom for d in self._datas if d.ncon]
        return self._model.geom_bodyid[np.concatenate(geoms)] if geoms else np.zeros((0, 2), dtype=np.int32)

    @cached_property
    def contact_live(self) -> np.ndarray:
        return np.ones(len(self.contact_bodies), dtype=bool)  # MuJoCo lists only the contacts there are

    def any_per_world(self, flags: np.ndarray) -> np.ndarray:
        world = np.repeat(np.arange(len(self._datas)), [d.ncon for d in self._datas])  # (C,) each slot's world
        return np.bincount(world[flags], minlength=len(self._datas)) > 0


@dataclass
class DeviceWorlds:
    """:class:`WorldArrays` of N worlds as torch views of a device backend's arrays (written by its
    forward pass: reading them reads the current state), with its contact slots as Warp keeps them."""

    qpos: torch.Tensor  # (N, nq)
    xpos: torch.Tensor  # (N, nbody, 3)
    xmat: torch.Tensor  # (N, nbody, 3, 3)
    site_xpos: torch.Tensor  # (N, nsite, 3)
    contact_geom: torch.Tensor  # (C, 2) geom ids of every contact slot of every world
    contact_worldid: torch.Tensor  # (C,) the world each contact slot belongs to
    nacon: torch.Tensor  # (1,) number of live contact slots (the first nacon of C)
    geom_bodyid: torch.Tensor  # (ngeom,) long, model constant: the body of each geom

    @property
    def contact_bodies(self) -> torch.Tensor:
        return self.geom_bodyid[self.contact_geom.long().clamp(min=0)]  # dead slots hold stale ids

    @property
    def contact_live(self) -> torch.Tensor:
        return torch.arange(len(self.contact_geom), device=self.nacon.device) < self.nacon

    def any_per_world(self, flags: torch.Tensor) -> torch.Tensor:
        n = len(self.qpos)
        world = self.contact_worldid.long().clamp(0, n - 1)
        # scatter rather than boolean indexing, so no device-to-host sync is needed
        return (
            torch.zeros(n, dtype=torch.long, device=flags.device).scatter_reduce(0, world, flags.long(), "amax").bool()
        )


def is_success(task, model: mujoco.MjModel, data: mujoco.MjData) -> bool:
    """One world's verdict by the task's success rule (``data`` forwarded, as for :class:`HostWorlds`)."""
    return bool(task.success(model, HostWorlds(model, [data]))[0])
