"""The inference worker's messages as bytes, for a policy server on another machine (`robot_bridge.policy_server`).

The four messages of `robot_bridge.inference` (``InferenceRequest``, ``MidObservation``, ``WorkerStatus``,
``InferenceResult``) and the end of a session (None) travel as MessagePack: a message is ``{"type": its
class name, "fields": its dataclass fields}``, a numpy array ``{"__ndarray__": [dtype, shape, raw bytes]}``.
Decoding builds only those four classes and only numeric arrays (booleans, integers, floats): unlike
pickle, bytes from the network cannot make the robot run code. Sequences come back as tuples.
No ROS import here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from robot_bridge.inference import InferenceRequest, InferenceResult, MidObservation, WorkerStatus

MESSAGES = {cls.__name__: cls for cls in (InferenceRequest, MidObservation, WorkerStatus, InferenceResult)}
ARRAY = "__ndarray__"


def encode(message: Any) -> bytes:
    """One of the worker's messages (or None, the end of a session) -> bytes."""
    if message is None:
        return msgpack.packb(None)
    name = type(message).__name__
    if MESSAGES.get(name) is not type(message):
        raise TypeError(f"{name} is not a message of the inference worker ({sorted(MESSAGES)})")
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    return msgpack.packb({"type": name, "fields": fields}, default=_pack)


def decode(data: bytes) -> Any:
    """Bytes from `encode` -> the message (or None); ValueError for anything else."""
    try:
        obj = msgpack.unpackb(data, object_hook=_unpack, use_list=False, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise ValueError(f"not a message of the inference worker ({type(err).__name__}: {err})") from None
    if obj is None:
        return None
    if not isinstance(obj, dict) or obj.get("type") not in MESSAGES or not isinstance(obj.get("fields"), dict):
        raise ValueError(f"not a message of the inference worker: {str(obj)[:80]}")
    try:
        return MESSAGES[obj["type"]](**obj["fields"])
    except TypeError as err:
        raise ValueError(f"a {obj['type']} with other fields than this version's ({err})") from None


def _pack(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"only numeric arrays travel to the policy server, not {obj.dtype}")
        return {ARRAY: [obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()]}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot send a {type(obj).__name__} to the policy server")


def _unpack(obj: dict) -> Any:
    if ARRAY not in obj:
        return obj
    dtype, shape, raw = obj[ARRAY]
    dtype = np.dtype(dtype)
    if dtype.kind not in "biuf":
        raise ValueError(f"an array of {dtype} is not one the policy server sends")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # writable, as a pipe's unpickled array is
