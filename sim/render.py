"""Offscreen MuJoCo renderers of one model, shared by the env backends."""

from __future__ import annotations

import mujoco
import numpy as np


class Renderers:
    """One `mujoco.Renderer` per square image size, made on first use (a GL context is costly)."""

    def __init__(self, model: mujoco.MjModel):
        self.model = model
        self._by_size: dict[int, mujoco.Renderer] = {}

    def frame(self, data: mujoco.MjData, camera: str, size: int, out: np.ndarray | None = None) -> np.ndarray:
        """(size, size, 3) uint8 image of ``data`` from ``camera``; written into ``out`` when given."""
        if size not in self._by_size:
            self._by_size[size] = mujoco.Renderer(self.model, size, size)
        renderer = self._by_size[size]
        renderer.update_scene(data, camera)
        return renderer.render(out=out)

    def close(self) -> None:
        for renderer in self._by_size.values():
            renderer.close()
        self._by_size.clear()
