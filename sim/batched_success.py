"""Each task's success rule on batched torch tensors, for backends whose state lives on a device.

Every rule here restates its task's ``is_success`` (``sim.tasks``) for N worlds at once, reading
the same bodies, joints and contacts with the same thresholds from the task's own fields;
``tests/test_warp_backend.py`` checks each against ``is_success`` on the same states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mujoco
import torch

from sim.tasks.pick_place import CUBE_HALF
from sim.tasks.stack import BASE_HALF


@dataclass
class WorldTensors:
    """Views of N worlds' kinematic state on one device (filled by the backend after forward)."""

    qpos: torch.Tensor  # (N, nq)
    xpos: torch.Tensor  # (N, nbody, 3) body frame positions
    xmat: torch.Tensor  # (N, nbody, 3, 3) body frame orientations
    site_xpos: torch.Tensor  # (N, nsite, 3)
    contact_geom: torch.Tensor  # (C, 2) geom ids of every contact slot of every world
    contact_worldid: torch.Tensor  # (C,) the world each contact slot belongs to
    nacon: torch.Tensor  # (1,) number of live contact slots (the first nacon of C)
    geom_bodyid: torch.Tensor  # (ngeom,) long, model constant: the body of each geom


def touches_gripper(model: mujoco.MjModel, w: WorldTensors, body: str) -> torch.Tensor:
    """(N,) bool: a geom of ``body`` is in contact with a finger (batched `sim.tasks.scene.touches_gripper`)."""
    n, slots = w.qpos.shape[0], w.contact_geom.shape[0]
    live = torch.arange(slots, device=w.qpos.device) < w.nacon.long()  # (C,)
    bodies = w.geom_bodyid[w.contact_geom.long().clamp(min=0)]  # (C, 2); dead slots hold stale ids
    target = model.body(body).id
    fingers = torch.tensor([model.body("left_finger").id, model.body("right_finger").id], device=w.qpos.device)
    b1, b2 = bodies[:, 0], bodies[:, 1]
    hit = live & (((b1 == target) & torch.isin(b2, fingers)) | ((b2 == target) & torch.isin(b1, fingers)))
    world = w.contact_worldid.long().clamp(0, n - 1)
    # scatter rather than boolean indexing, so no device-to-host sync is needed
    return torch.zeros(n, dtype=torch.long, device=w.qpos.device).scatter_reduce(0, world, hit.long(), "amax").bool()


def _lift(task, model: mujoco.MjModel, w: WorldTensors) -> torch.Tensor:
    return w.xpos[:, model.body("cube").id, 2] >= task.lift_height


def _reach(task, model: mujoco.MjModel, w: WorldTensors) -> torch.Tensor:
    gap = w.site_xpos[:, model.site("grasp").id] - w.xpos[:, model.body("target").id]
    return torch.linalg.vector_norm(gap, dim=1) <= task.success_distance


def _push(task, model: mujoco.MjModel, w: WorldTensors) -> torch.Tensor:
    gap = w.xpos[:, model.body("cube").id, :2] - w.xpos[:, model.body("goal").id, :2]
    return torch.linalg.vector_norm(gap, dim=1) <= task.goal_radius


def _pick_place(task, model: mujoco.MjModel, w: WorldTensors) -> torch.Tensor:
    bin_id = model.body("bin").id
    offset = w.xpos[:, model.body("cube").id] - w.xpos[:, bin_id]  # (N, 3)
    local = torch.einsum("nji,nj->ni", w.xmat[:, bin_id], offset)  # R^T offset: the bin's frame
    inside = (local[:, :2].abs() <= task.bin_inner_half - CUBE_HALF + 0.005).all(dim=1)
    resting = local[:, 2] <= task.bin_floor_top + CUBE_HALF + 0.01
    return inside & resting & ~touches_gripper(model, w, "cube")


def _stack(task, model: mujoco.MjModel, w: WorldTensors) -> torch.Tensor:
    red, blue = w.xpos[:, model.body("cube").id], w.xpos[:, model.body("base_cube").id]
    centred = torch.linalg.vector_norm(red[:, :2] - blue[:, :2], dim=1) <= task.xy_tolerance
    on_top = (red[:, 2] - blue[:, 2] - (BASE_HALF + CUBE_HALF)).abs() <= task.height_tolerance
    base_on_table = (blue[:, 2] - BASE_HALF).abs() <= task.height_tolerance
    return centred & on_top & base_on_table & ~touches_gripper(model, w, "cube")


def _open_drawer(task, model: mujoco.MjModel, w: WorldTensors) -> torch.Tensor:
    return w.qpos[:, model.joint("drawer").qposadr[0]] >= task.open_distance


SUCCESS_RULES: dict[str, Callable[..., torch.Tensor]] = {
    "lift": _lift,
    "reach": _reach,
    "push": _push,
    "pick_place": _pick_place,
    "stack": _stack,
    "open_drawer": _open_drawer,
}
