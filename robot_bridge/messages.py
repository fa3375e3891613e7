"""ROS 2 message fields <-> numpy, with the checks every input goes through.

The functions read message fields only (duck typing), so this module imports no ROS package.
Every rejection raises ``InputRejected`` with one line naming the problem and a ``kind`` (the cause
the node counts and rate-limits its log lines by); the node reports it.
"""

from __future__ import annotations

import numpy as np

CHANNELS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}


class InputRejected(ValueError):
    """A message that fails a shape, encoding, finiteness or bounds check; ``kind`` names the cause."""

    def __init__(self, message: str, kind: str = "malformed"):
        super().__init__(message)
        self.kind = kind


def stamp_seconds(stamp) -> float:
    """builtin_interfaces/Time -> seconds."""
    return stamp.sec + stamp.nanosec * 1e-9


def joint_state_vector(names: list[str], positions, wanted: list[str]) -> np.ndarray:
    """JointState name/position -> (len(wanted),) float64 in the order of ``wanted``, matched by name."""
    names = list(names)
    positions = np.asarray(positions, dtype=np.float64)
    if positions.ndim != 1 or len(names) != len(positions):
        raise InputRejected(f"joint_states has {len(names)} names but {positions.size} positions", "wrong_length")
    index = {n: i for i, n in enumerate(names)}
    missing = [n for n in wanted if n not in index]
    if missing:
        raise InputRejected(f"joint_states lacks {missing} (has {names})", "missing_names")
    vector = positions[[index[n] for n in wanted]]
    if not np.isfinite(vector).all():
        bad = [n for n, v in zip(wanted, vector) if not np.isfinite(v)]
        raise InputRejected(f"joint_states has non-finite values for {bad}", "not_finite")
    return vector


def check_bounds(vector: np.ndarray, names: list[str], low: np.ndarray, high: np.ndarray, margin: float) -> None:
    """Reject a state vector (S,) with an entry outside [low - margin, high + margin] (per entry, (S,) each).

    A value no robot of the configured kind can reach is a sensor fault (a 1e6 rad joint angle, a
    unit mix-up): it must not reach the policy, whose output clamp alone would hide it.
    """
    outside = (vector < low - margin) | (vector > high + margin)
    if not outside.any():
        return
    bad = [f"{names[i]}={vector[i]:g} outside [{low[i]:g}, {high[i]:g}]" for i in np.flatnonzero(outside)]
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    raise InputRejected(
        f"joint_states out of bounds: {', '.join(bad[:3])}{more}, margin {margin:g}; a sensor fault, or widen "
        f"safety.state_bounds in the serve YAML (or safety.state_margin) if the robot really is there",
        "out_of_bounds",
    )


def image_to_rgb(msg) -> np.ndarray:
    """sensor_msgs/Image (rgb8, bgr8, rgba8, bgra8 or mono8) -> (H, W, 3) uint8 RGB."""
    channels = CHANNELS.get(msg.encoding)
    if channels is None:
        raise InputRejected(
            f"image encoding {msg.encoding!r} is not supported; publish one of {sorted(CHANNELS)}", "encoding"
        )
    h, w, step = msg.height, msg.width, msg.step
    if h < 1 or w < 1 or step < w * channels:
        raise InputRejected(f"image header is inconsistent: {h}x{w} {msg.encoding} with step {step}", "image_header")
    data = np.frombuffer(msg.data, np.uint8)  # array.array or bytes: no copy
    if data.size != h * step:
        raise InputRejected(f"image data has {data.size} bytes, expected height*step = {h * step}", "image_data")
    pixels = data.reshape(h, step)[:, : w * channels].reshape(h, w, channels)
    if msg.encoding == "mono8":
        return np.repeat(pixels, 3, axis=2)
    if msg.encoding.startswith("bgr"):
        return np.ascontiguousarray(pixels[:, :, 2::-1])
    return np.ascontiguousarray(pixels[:, :, :3])


def compressed_to_rgb(msg) -> np.ndarray:
    """sensor_msgs/CompressedImage (png or jpeg) -> (H, W, 3) uint8 RGB."""
    import cv2

    data = np.frombuffer(msg.data, np.uint8)
    if data.size == 0:
        raise InputRejected(f"compressed image ({msg.format!r}) is empty", "image_data")
    bgr = cv2.imdecode(data, cv2.IMREAD_COLOR)
    if bgr is None:
        raise InputRejected(
            f"compressed image ({msg.format!r}, {data.size} bytes) does not decode as png or jpeg", "image_data"
        )
    return np.ascontiguousarray(bgr[:, :, ::-1])


def fit_image(rgb: np.ndarray, size: int, resize: bool) -> np.ndarray:
    """(H, W, 3) uint8 -> (size, size, 3) uint8: unchanged, resized when allowed, else rejected."""
    if rgb.shape[:2] == (size, size):
        return rgb
    if not resize:
        raise InputRejected(
            f"image is {rgb.shape[0]}x{rgb.shape[1]} but the policy expects {size}x{size}; "
            f"publish that size or set resize_images=true",
            "image_size",
        )
    import cv2

    return cv2.resize(rgb, (size, size), interpolation=cv2.INTER_AREA)
