"""Task variations outside the demonstrations (`--env.variation=<name>`): what a policy that works in the lab
meets when the scene shifts. The in-distribution setting (``""``) stays the default and changes nothing.

Each variation is drawn per episode from the world's own random stream, right after the task's initial
state (and its events), so equal seeds give equal variations; what was drawn is the episode's
``variation`` record (`VariedWorlds.record`), which `vla-rl eval` writes beside each episode. Every world
has its own copy of the model (``mujoco.rollout`` and the renderers take one per world), reset to the
base model's values before each draw, so nothing accumulates over episodes.

- ``position``: the task's whole layout (its free bodies and its mocap goal markers and fixtures) shifted
  sideways so that its object lands 2-10 cm beyond the recorded y range (``cube_y_range``, or
  ``cabinet_y_range``), on a random side; the relations between the objects stay those of the task;
- ``size``: the task's object (its first free body) scaled by 0.70-0.85 or 1.20-1.35, resting on the table;
- ``colour``: the object in a hue away from red (the demonstrations' colour), saturation and value 0.6-1;
- ``distractors``: three 3 cm boxes of other colours on the table, at least 8 cm from the task's bodies and
  from each other (the scene gets them as free bodies; an episode without room puts one aside);
- ``camera``: the cameras moved by up to 5 cm per axis and turned by 2-5 degrees about the vertical;
- ``lighting``: the lights' and the headlight's colours times 0.3-0.6 or 1.4-1.8 (each clipped at 1, so a
  brighter scene can be less than that much brighter), the lights moved by up to 0.5 m sideways;
- ``position_far`` and ``camera_far``: the same shifts, further: the object 10-16 cm beyond the recorded range;
  the cameras moved by up to 8 cm per axis and turned by 5-8 degrees.

Object variations need a task with a free body (lift, push, push_impulse, pick_place, stack; position needs a
recorded object range: lift, push, push_impulse, pick_place, open_drawer's cabinet); ``size`` is refused for
pick_place and stack (their success reads the cube's fixed size) and ``distractors`` for pick_place and
open_drawer (a box could land inside their fixture). The others are refused naming the tasks that fit.
"""

from __future__ import annotations

import colorsys
import copy
from typing import Any

import mujoco
import numpy as np

VARIATIONS = ("position", "size", "colour", "distractors", "camera", "lighting", "position_far", "camera_far")
# How far each shift goes: (metres beyond the recorded object range) for position; (metres per axis, degrees) camera
POSITION_BEYOND = {"position": (0.02, 0.10), "position_far": (0.10, 0.16)}
CAMERA_MOVE = {"camera": (0.05, (2.0, 5.0)), "camera_far": (0.08, (5.0, 8.0))}
DISTRACTORS, DISTRACTOR_HALF = 3, 0.015  # boxes added for ``distractors``, their half side (m)
# Where distractors may stand: the table in front of the arm, inside its workspace.
DISTRACTOR_X, DISTRACTOR_Y = (0.35, 0.70), (-0.25, 0.25)
DISTRACTOR_COLOURS = ((0.1, 0.7, 0.2, 1.0), (0.9, 0.8, 0.1, 1.0), (0.6, 0.2, 0.8, 1.0))  # green, yellow, purple
# The model fields a variation writes (and the headlight's colours), restored from the base model before each draw.
VARIED_FIELDS = ("geom_size", "geom_rbound", "geom_aabb", "geom_pos", "geom_rgba", "geom_matid", "cam_pos", "cam_quat",
                 "light_diffuse", "light_pos")  # fmt: skip


def varied_fields(model: mujoco.MjModel) -> dict[str, Any]:
    """Copies of ``model``'s fields a variation may write (`VARIED_FIELDS` and the headlight)."""
    fields = {name: getattr(model, name).copy() for name in VARIED_FIELDS}
    headlight = {"diffuse": np.array(model.vis.headlight.diffuse), "ambient": np.array(model.vis.headlight.ambient)}
    return {"fields": fields, "headlight": headlight}


def set_varied_fields(model: mujoco.MjModel, saved: dict[str, Any]) -> None:
    """Write `varied_fields`' copies into ``model`` (another model of the same scene)."""
    for name, value in saved["fields"].items():
        getattr(model, name)[:] = value
    model.vis.headlight.diffuse[:] = saved["headlight"]["diffuse"]
    model.vis.headlight.ambient[:] = saved["headlight"]["ambient"]


def check_variation(name: str, task: Any, model: mujoco.MjModel) -> None:
    """ValueError naming the fix when ``name`` is not a variation, or ``task`` has nothing it varies."""
    if name not in ("", *VARIATIONS):
        raise ValueError(f"unknown variation {name!r}; pass --env.variation= one of {', '.join(VARIATIONS)} "
                         f"(empty: in distribution)")  # fmt: skip
    if name == "size" and task.name in ("stack", "pick_place"):
        raise ValueError(f"--env.variation=size: task {task.name!r} judges success with its cube's fixed size; use "
                         f"lift, push or push_impulse")  # fmt: skip
    if name == "distractors" and model.nmocap and task.name in ("pick_place", "open_drawer"):
        raise ValueError(f"--env.variation=distractors: task {task.name!r} has a fixture (a bin, a cabinet) the "
                         f"boxes could be placed inside; use lift, push, push_impulse, stack, reach or track")  # fmt: skip
    if name in ("size", "colour") and not _free_bodies(model):
        raise ValueError(f"--env.variation={name} varies the task's object, and task {task.name!r} has none that "
                         f"moves freely; use lift, push, push_impulse, pick_place or stack")  # fmt: skip
    if name == "distractors" and mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, "distractor0") < 0:
        raise ValueError("--env.variation=distractors needs the scene built with its boxes: "
                         "sim.variations.scene_with_distractors(task.xml_path())")  # fmt: skip
    if name in POSITION_BEYOND and _y_range(task) is None:
        raise ValueError(f"--env.variation={name} shifts the layout beyond the recorded object range, and task "
                         f"{task.name!r} declares none; use lift, push, push_impulse, pick_place or open_drawer")  # fmt: skip


def scene_with_distractors(xml_path: str) -> mujoco.MjModel:
    """The task's scene with the ``distractors`` boxes added as free bodies (named ``distractor<k>``), parked off
    the table until an episode places them."""
    spec = mujoco.MjSpec.from_file(xml_path)
    for k, rgba in enumerate(DISTRACTOR_COLOURS[:DISTRACTORS]):
        body = spec.worldbody.add_body(name=f"distractor{k}", pos=[0.0, 1.0 + 0.1 * k, DISTRACTOR_HALF])
        body.add_freejoint(name=f"distractor{k}")
        body.add_geom(type=mujoco.mjtGeom.mjGEOM_BOX, size=[DISTRACTOR_HALF] * 3, rgba=list(rgba), mass=0.02)
        parked = [0.0, 1.0 + 0.1 * k, DISTRACTOR_HALF, 1.0, 0.0, 0.0, 0.0]
        for key in spec.keys:  # keyframes written before the box existed: it is parked there
            if len(key.qpos):
                key.qpos = [*key.qpos, *parked]
            if len(key.qvel):
                key.qvel = [*key.qvel, *[0.0] * 6]
    return spec.compile()


def _free_bodies(model: mujoco.MjModel) -> list[int]:
    """Body ids of the task's free bodies, in model order (the distractors excluded)."""
    free = np.flatnonzero(model.jnt_type == mujoco.mjtJoint.mjJNT_FREE)
    bodies = [int(model.jnt_bodyid[j]) for j in free]
    return [b for b in bodies if not model.body(b).name.startswith("distractor")]


def _y_range(task: Any) -> tuple[float, float] | None:
    return getattr(task, "cube_y_range", None) or getattr(task, "cabinet_y_range", None)


class VariedWorlds:
    """The per-world models and each world's current variation record for one variation ``name``.

    ``models[i]`` is world i's model (``base`` itself for the in-distribution setting: no copy).
    """

    def __init__(self, name: str, task: Any, base: mujoco.MjModel, num_envs: int):
        check_variation(name, task, base)
        self.name, self.task, self.base = name, task, base
        self.models = [copy.copy(base) for _ in range(num_envs)] if name else [base] * num_envs
        self.records: list[dict[str, Any]] = [{} for _ in range(num_envs)]
        self._objects = _free_bodies(base)

    def apply(self, i: int, data: mujoco.MjData, rng: np.random.Generator) -> None:
        """Draw world i's variation for the episode whose initial state ``data`` holds (from ``rng``, the world's
        stream), write it into its model and ``data``, and keep its record. Nothing without a variation."""
        if not self.name:
            return
        model = self.models[i]
        self._restore(model)
        draw = self.name.removesuffix("_far")  # a far shift is its shift's draw, further
        self.records[i] = {"variation": self.name, **getattr(self, f"_{draw}")(model, data, rng)}

    def record(self, i: int) -> dict[str, Any]:
        """World i's current episode's variation, as drawn ({} in distribution)."""
        return dict(self.records[i])

    def snapshot(self, i: int) -> dict[str, Any]:
        """World i's varied model fields and record, for a saved world (`MujocoBatchedEnv.get_state`)."""
        return {**varied_fields(self.models[i]), "record": dict(self.records[i])}

    def load(self, i: int, snapshot: dict[str, Any] | None) -> None:
        """Give world i the variation of a :meth:`snapshot` (of any world of a batch of the same variation); a
        state saved with another variation, or none, is refused (it would vary the shared model, or keep this
        world's previous episode's)."""
        saved = (snapshot or {}).get("record", {}).get("variation", "")
        if saved != self.name:
            raise ValueError(f"a world saved with variation {saved!r} cannot be loaded into an env of variation "
                             f"{self.name!r}; load it into an env built with --env.variation={saved}")  # fmt: skip
        if not self.name:
            return
        set_varied_fields(self.models[i], snapshot)
        self.records[i] = dict(snapshot["record"])

    # -- the variations ------------------------------------------------------------------------

    def _position(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> dict:
        low, high = _y_range(self.task)
        near, far = POSITION_BEYOND[self.name]
        side = 1.0 if rng.random() < 0.5 else -1.0
        target = (high + rng.uniform(near, far)) if side > 0 else (low - rng.uniform(near, far))
        anchor = self._anchor_y(model, data)
        shift = target - anchor
        for b in self._objects:
            adr = model.jnt_qposadr[model.body_jntadr[b]]
            data.qpos[adr + 1] += shift
        data.mocap_pos[:, 1] += shift
        return {"y_shift_m": round(float(shift), 6), "object_y_m": round(float(target), 6)}

    def _anchor_y(self, model: mujoco.MjModel, data: mujoco.MjData) -> float:
        """The y of what the task's y range draws: its first free body, else its first mocap body (a fixture)."""
        if self._objects:
            return float(data.qpos[model.jnt_qposadr[model.body_jntadr[self._objects[0]]] + 1])
        return float(data.mocap_pos[0, 1])

    def _size(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> dict:
        scale = rng.uniform(0.70, 0.85) if rng.random() < 0.5 else rng.uniform(1.20, 1.35)
        body = self._objects[0]
        geoms = np.flatnonzero(model.geom_bodyid == body)
        model.geom_size[geoms] = self.base.geom_size[geoms] * scale
        model.geom_rbound[geoms] = self.base.geom_rbound[geoms] * scale
        model.geom_aabb[geoms] = self.base.geom_aabb[geoms] * scale
        model.geom_pos[geoms] = self.base.geom_pos[geoms] * scale
        adr = model.jnt_qposadr[model.body_jntadr[body]]
        data.qpos[adr + 2] *= scale  # its centre at the scaled height: it rests on the table as before
        return {"object": model.body(body).name, "scale": round(float(scale), 6)}

    def _colour(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> dict:
        hue = rng.uniform(0.12, 0.88)  # red is hue 0 (= 1): at least 0.12 of the circle away from it
        rgb = colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0))
        body = self._objects[0]
        geoms = np.flatnonzero(model.geom_bodyid == body)
        model.geom_rgba[geoms, :3] = rgb
        model.geom_matid[geoms] = -1  # a material's colour would win over the geom's
        return {"object": model.body(body).name, "rgb": [round(float(c), 4) for c in rgb]}

    def _distractors(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> dict:
        adrs = [model.jnt_qposadr[model.body_jntadr[b]] for b in self._objects]
        taken = [data.qpos[a : a + 2].copy() for a in adrs] + [p[:2].copy() for p in data.mocap_pos]
        placed = []
        for k in range(DISTRACTORS):
            joint = model.joint(f"distractor{k}")
            adr = joint.qposadr[0]
            xy = None
            for _ in range(100):  # rejection sampling: a table of 35 x 50 cm has room for three
                candidate = np.array([rng.uniform(*DISTRACTOR_X), rng.uniform(*DISTRACTOR_Y)])
                if all(np.linalg.norm(candidate - np.asarray(t)) >= 0.08 for t in taken):
                    xy = candidate
                    break
            if xy is None:  # no room: aside, off the table
                xy = np.array([0.0, 1.0 + 0.1 * k])
            data.qpos[adr : adr + 3] = [*xy, DISTRACTOR_HALF]
            data.qpos[adr + 3 : adr + 7] = [1.0, 0.0, 0.0, 0.0]
            taken.append(xy)
            placed.append([round(float(v), 6) for v in xy])
        return {"xy_m": placed}

    def _camera(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> dict:
        move, degrees = CAMERA_MOVE[self.name]
        shift = rng.uniform(-move, move, size=3)
        turn = np.radians(rng.uniform(*degrees)) * (1.0 if rng.random() < 0.5 else -1.0)
        spin = np.array([np.cos(turn / 2), 0.0, 0.0, np.sin(turn / 2)])  # about the world z axis
        model.cam_pos[:] = self.base.cam_pos + shift
        for c in range(model.ncam):
            quat = np.empty(4)
            mujoco.mju_mulQuat(quat, spin, self.base.cam_quat[c])
            model.cam_quat[c] = quat
        return {"shift_m": [round(float(v), 6) for v in shift], "yaw_deg": round(float(np.degrees(turn)), 4)}

    def _lighting(self, model: mujoco.MjModel, data: mujoco.MjData, rng: np.random.Generator) -> dict:
        factor = rng.uniform(0.3, 0.6) if rng.random() < 0.5 else rng.uniform(1.4, 1.8)
        shift = rng.uniform(-0.5, 0.5, size=(model.nlight, 2))
        model.light_diffuse[:] = np.clip(self.base.light_diffuse * factor, 0.0, 1.0)
        model.light_pos[:, :2] = self.base.light_pos[:, :2] + shift
        model.vis.headlight.diffuse[:] = np.clip(np.asarray(self.base.vis.headlight.diffuse) * factor, 0.0, 1.0)
        model.vis.headlight.ambient[:] = np.clip(np.asarray(self.base.vis.headlight.ambient) * factor, 0.0, 1.0)
        return {"brightness": round(float(factor), 6), "light_shift_m": np.round(shift, 6).tolist()}

    def _restore(self, model: mujoco.MjModel) -> None:
        """The fields a variation writes, back to the base model's."""
        base = self.base
        for name in VARIED_FIELDS:
            getattr(model, name)[:] = getattr(base, name)
        model.vis.headlight.diffuse[:] = base.vis.headlight.diffuse
        model.vis.headlight.ambient[:] = base.vis.headlight.ambient
