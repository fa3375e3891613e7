"""Offscreen MuJoCo renderers of one model, shared by the env backends."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import mujoco
import numpy as np

# Mesa's software GL (llvmpipe, what CPU-only machines render with) splits every frame over a
# rasterizer thread pool of its own. `ParallelRenderers` already keeps each core busy with one
# frame, and the two pools then contend: 16 frames of 64 px on 2 cores took 0.55-0.59 ms each
# with llvmpipe rasterizing in the calling thread, 0.77-0.89 ms with its pool (one render thread:
# 1.0 ms either way). Read when the first GL context is made; GPU drivers ignore it.
os.environ.setdefault("LP_NUM_THREADS", "0")


class Renderers:
    """One `mujoco.Renderer` per square image size, made on first use (a GL context is costly)."""

    def __init__(self, model: mujoco.MjModel):
        self.model = model
        self._by_size: dict[int, mujoco.Renderer] = {}

    def frame(self, data: mujoco.MjData, camera: str, size: int, out: np.ndarray | None = None,
              model: mujoco.MjModel | None = None) -> np.ndarray:  # fmt: skip
        """(size, size, 3) uint8 image of ``data`` from ``camera``; written into ``out`` when given. ``model``: the
        world's own model when it differs from the renderers' in colours, sizes, cameras or lights only (a
        variation, `sim.variations`); the scene is then built from it."""
        if size not in self._by_size:
            self._by_size[size] = mujoco.Renderer(self.model, size, size)
        renderer = self._by_size[size]
        if model is None or model is self.model:
            renderer.update_scene(data, camera)
        else:  # what update_scene does, from the world's model (the GL context holds only meshes and textures)
            view = mujoco.MjvCamera()
            view.type, view.fixedcamid = mujoco.mjtCamera.mjCAMERA_FIXED, model.camera(camera).id
            mujoco.mjv_updateScene(model, data, mujoco.MjvOption(), None, view, mujoco.mjtCatBit.mjCAT_ALL,
                                   renderer.scene)  # fmt: skip
        return renderer.render(out=out)

    def close(self) -> None:
        for renderer in self._by_size.values():
            renderer.close()
        self._by_size.clear()


class ParallelRenderers:
    """Renders a batch of worlds on ``threads`` threads, each with its own GL context.

    Why threads: on a CPU (Mesa llvmpipe) a small frame costs about a millisecond of fixed GL
    overhead (draw setup, the read-back's synchronisation), not pixels, so one render loop leaves
    every core but one idle while physics is already batched. MuJoCo releases the GIL inside
    ``mjr_render`` and ``mjr_readPixels``, so threads in one process overlap. A GL context is
    current in one thread at a time, so each thread keeps its own `Renderers` for its whole life
    (one single-thread executor per thread) and closes them itself.

    World ``i`` always goes to thread ``i * threads // N``: contiguous slices, the same every call.
    Frames are bit-identical to rendering the worlds one by one (tested).
    """

    def __init__(self, model: mujoco.MjModel, threads: int):
        if threads < 1:
            raise ValueError(f"render threads must be >= 1, got {threads}")
        self.threads = threads
        self._renderers = [Renderers(model) for _ in range(threads)]
        # One thread renders inline: no executor, no hand-off.
        self._executors = (
            [ThreadPoolExecutor(1, thread_name_prefix=f"render{k}") for k in range(threads)] if threads > 1 else []
        )

    def frames(self, datas: Sequence[mujoco.MjData], camera: str, size: int, out: np.ndarray,
               models: Sequence[mujoco.MjModel] | None = None) -> np.ndarray:  # fmt: skip
        """Render ``datas`` from ``camera`` into ``out`` (len(datas), size, size, 3) uint8; returns ``out``.
        ``models``: each world's own model (`Renderers.frame`), None = the renderers' for all."""

        def render(k: int, worlds: range) -> None:
            for i in worlds:
                self._renderers[k].frame(
                    datas[i], camera, size, out=out[i], model=None if models is None else models[i]
                )

        n = len(datas)
        if not self._executors:
            render(0, range(n))
            return out
        bounds = [k * n // self.threads for k in range(self.threads + 1)]
        jobs = [ex.submit(render, k, range(bounds[k], bounds[k + 1])) for k, ex in enumerate(self._executors)]
        for job in jobs:
            job.result()  # re-raises a thread's error here
        return out

    def close(self) -> None:
        if not self._executors:
            self._renderers[0].close()
            return
        for renderers, ex in zip(self._renderers, self._executors, strict=True):
            ex.submit(renderers.close).result()  # freed in the thread whose context it is
            ex.shutdown()
        self._executors.clear()
