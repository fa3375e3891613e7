"""A render worker of `sim.render.ProcessRenderers`: ``python -m sim.render_worker <fd> <parent pid>``.

It reads the base model from the connection on file descriptor ``fd``, then answers each ``("frames", camera, size,
slots, state, fields)`` request with ``("ok", frames)`` (uint8, (len(slots), size, size, 3)) or ``("error",
traceback)``: each slot's positions (and, with ``fields``, its model's varied fields) are written into that slot's
own data, the env's position pass is run, and the frame is rendered. It ends on ``("close",)``, when its parent's
end of the connection closes, or with its parent.
"""

from __future__ import annotations

import copy
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import mujoco
import numpy as np

from sim.poses import position_pass
from sim.render import Renderers
from sim.variations import set_varied_fields
from vla_core.lifetime import exit_with_parent


def serve(conn: Connection) -> None:
    base: mujoco.MjModel = conn.recv()
    renderers, worlds, pose = Renderers(base), {}, position_pass(base)  # worlds: slot -> (model, data)
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message[0] == "close":
                return
            _, camera, size, slots, state, fields = message
            try:
                out = np.empty((len(slots), size, size, 3), dtype=np.uint8)
                for k, slot in enumerate(slots):
                    if slot not in worlds:
                        worlds[slot] = (base if fields is None else copy.copy(base), mujoco.MjData(base))
                    model, data = worlds[slot]
                    if fields is not None:
                        set_varied_fields(model, fields[k])
                    for name, values in state.items():
                        getattr(data, name)[:] = values[k]
                    pose(model, data)
                    renderers.frame(data, camera, size, out=out[k], model=None if fields is None else model)
                reply = ("ok", out)
            except Exception:  # noqa: BLE001 (any error goes back to the parent, which raises it)
                reply = ("error", traceback.format_exc())
            try:
                conn.send(reply)
            except OSError:  # the parent is gone (or replaced this worker): nobody to answer
                return
    finally:
        renderers.close()


if __name__ == "__main__":
    exit_with_parent(int(sys.argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes its workers
    serve(Connection(int(sys.argv[1])))
