"""Offscreen MuJoCo renderers of one model, shared by the env backends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import mujoco
import numpy as np

from sim.config import EnvConfig, render_thread_count
from sim.variations import varied_fields
from vla_core.crash_log import exit_cause

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


# A worker that dies again after this many restarts in a row on one request is no rare crash: the run stops,
# naming it.
MAX_RESTARTS_IN_A_ROW = 3


def camera_renderers(model: mujoco.MjModel, config: EnvConfig) -> ParallelRenderers | ProcessRenderers:
    """The renderers of a batch's camera images as ``config`` asks: ``render_threads``
    worker processes (``render_isolation=process``) or threads; no worker is started when no camera is rendered."""
    count = render_thread_count(config)  # validates render_threads and render_isolation
    isolated = config.render_isolation == "process" and config.cameras
    return (ProcessRenderers if isolated else ParallelRenderers)(model, count)


class ProcessRenderers:
    """Renders a batch of worlds in ``workers`` child processes, each with its own GL context: world ``i`` goes to
    worker ``i * workers // N``, as `ParallelRenderers` splits them over threads.

    Why processes: render threads of one process share the GL driver's state, and Mesa's llvmpipe crashed long
    runs natively (SIGSEGV) with two threads in ``mjr_render`` at once. Processes share nothing of the driver, so
    that race cannot happen; a worker that dies all the same (a driver's crash) is started again and renders its
    frames again, with one line on stderr: the run loses a second, never itself or a frame (``restarts`` counts).

    Each call ships, per world, what the picture depends on: its positions (``qpos``, ``mocap_pos``,
    ``mocap_quat``) and, with per-world ``models`` (a variation), the fields a variation writes. The worker
    (`sim.render_worker`) runs the env's own position pass on them and renders with `Renderers`, so frames are
    bit-identical to `ParallelRenderers`' (tested). A worker is a fresh interpreter (``python -m
    sim.render_worker``), never a fork of a process holding GL state and threads, nor a ``spawn`` that would import
    the user's main script again; it ends with its parent (`vla_core.lifetime`).
    """

    def __init__(self, model: mujoco.MjModel, workers: int):
        if workers < 1:
            raise ValueError(f"render workers must be >= 1, got {workers}")
        self.model, self.restarts = model, 0
        self._workers = [self._launch() for _ in range(workers)]  # all start importing at once
        for _, conn in self._workers:
            _send_quietly(conn, model)  # one that died at once is found and started again at its first request

    def _launch(self) -> tuple[subprocess.Popen, Connection]:
        here, there = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "sim.render_worker", str(there.fileno()), str(os.getpid())],
            pass_fds=[there.fileno()], stdin=subprocess.DEVNULL,
        )  # fmt: skip
        there.close()  # the worker's end: with it closed here, the worker's death reads as EOF
        return process, Connection(here.detach())

    def _start(self) -> tuple[subprocess.Popen, Connection]:
        """A worker started again, given the model."""
        process, conn = self._launch()
        _send_quietly(conn, self.model)  # died at once: the next receive finds out
        return process, conn

    def frames(self, datas: Sequence[mujoco.MjData], camera: str, size: int, out: np.ndarray,
               models: Sequence[mujoco.MjModel] | None = None) -> np.ndarray:  # fmt: skip
        """Render ``datas`` from ``camera`` into ``out`` (len(datas), size, size, 3) uint8; returns ``out``.
        ``models``: each world's own model (`Renderers.frame`), None = the renderers' for all."""
        n, count = len(datas), len(self._workers)
        bounds = [k * n // count for k in range(count + 1)]
        requests = {}
        for k in range(count):
            worlds = range(bounds[k], bounds[k + 1])
            if len(worlds):
                requests[k] = _request(datas, worlds, camera, size, models)
                _send_quietly(self._workers[k][1], requests[k])  # one that died: `_receive` finds out
        unanswered = set(requests)
        try:
            for k, request in requests.items():
                out[bounds[k] : bounds[k + 1]] = self._receive(k, request)
                unanswered.discard(k)
        finally:  # an error or a stop signal left answers in their sockets: those workers are replaced, so the
            for k in unanswered:  # next call never reads this call's frames
                self._replace(k)
        return out

    def _receive(self, k: int, request: tuple) -> np.ndarray:
        for restarts in range(MAX_RESTARTS_IN_A_ROW + 1):
            process, conn = self._workers[k]
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                cause = exit_cause(process.wait())
                if restarts == MAX_RESTARTS_IN_A_ROW:
                    raise RuntimeError(
                        f"render worker {k} died again after {restarts} restarts in a row on one request (last: "
                        f"{cause}): not a rare driver crash; render in threads (--env.render_isolation=thread) to see "
                        "the error in this process"
                    ) from None
                self.restarts += 1
                print(f"render worker {k} (pid {process.pid}) died ({cause}); started again, its {len(request[3])} "
                      f"frames rendered again", file=sys.stderr)  # fmt: skip
                conn.close()
                self._workers[k] = self._start()
                _send_quietly(self._workers[k][1], request)
                continue
            if status == "error":
                raise RuntimeError(f"render worker {k} failed:\n{value}")
            return value
        raise AssertionError("unreachable")

    def _replace(self, k: int) -> None:
        """Worker ``k`` killed (whatever it was writing is dropped) and started again."""
        process, conn = self._workers[k]
        process.kill()
        process.wait()
        conn.close()
        self._workers[k] = self._start()

    def close(self) -> None:
        for _, conn in self._workers:
            _send_quietly(conn, ("close",))
        for process, conn in self._workers:  # each had its request answered (`frames`): they end at once
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            conn.close()
        self._workers.clear()


def _request(datas, worlds: range, camera: str, size: int, models) -> tuple:
    """What one worker needs to render ``worlds`` of ``datas``: positions and, with ``models``, varied fields."""
    state = {"qpos": np.stack([datas[i].qpos for i in worlds])}
    if datas[worlds[0]].mocap_pos.size:
        state["mocap_pos"] = np.stack([datas[i].mocap_pos for i in worlds])
        state["mocap_quat"] = np.stack([datas[i].mocap_quat for i in worlds])
    fields = None if models is None else [varied_fields(models[i]) for i in worlds]
    return ("frames", camera, size, list(worlds), state, fields)


def _send_quietly(conn: Connection, message) -> None:
    """Send, where a dead worker's broken pipe is found by the next receive, not here."""
    try:
        conn.send(message)
    except OSError:
        pass
