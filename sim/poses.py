"""The position pass a batched MuJoCo env runs after stepping, shared by the env and its render workers (which
import this module alone: nothing here imports more than MuJoCo)."""

from __future__ import annotations

import mujoco


def forward_positions(model: mujoco.MjModel, data: mujoco.MjData) -> None:
    """The position-dependent quantities of ``data``'s state that anything reads between steps.

    Body, geom and site poses (the observation, the tasks' success checks), the com-based frames
    the site Jacobians need (the controller), camera and light poses (rendering) and the contacts
    (success checks that look at them). The dynamics a full ``mj_forward`` adds (mass matrix,
    constraints, accelerations) would be thrown away: ``mujoco.rollout`` recomputes them from the
    state at its first substep. About twice as fast as ``mj_forward`` on these scenes.
    """
    mujoco.mj_kinematics(model, data)
    mujoco.mj_comPos(model, data)
    mujoco.mj_camlight(model, data)
    mujoco.mj_collision(model, data)


def position_pass(model: mujoco.MjModel):
    """The pass to run after stepping ``model``: :func:`forward_positions`, or ``mj_forward`` for scenes
    with tendons, flexes or sensors, whose position-dependent quantities the kinematic pass leaves out."""
    return forward_positions if model.ntendon == 0 and model.nflex == 0 and model.nsensor == 0 else mujoco.mj_forward
