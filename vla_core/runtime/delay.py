"""How long inference takes, in control steps: the delay model, measured latency files, and the
delay augmentation built from a demonstration.

The one definition of each, read by training (`vla_rl.train`), evaluation (`vla_core.runtime.delayed_env`) and the
robot (`robot_bridge`):

- `DelayConfig` / `DelayModel`: delays drawn fixed, uniform over [low, high], or replayed from
  latencies measured on a robot (``vla-rl serve`` writes them, see `LatencyLog`).
- A latency file is JSON lines, one measured inference per line:
  ``{"latency_s": 0.083, "control_dt": 0.05, ...}``. Seconds become control steps rounded up: a
  chunk that arrives partway through a control period is first usable at the next step.
- `committed_prefix`: the delay augmentation for a training sample, the actions a demonstration
  would already be executing while its chunk is computed (the robot's and the simulation's come
  from the queue, `ActionChunkExecutor.delay_augmentation`; all three share `augmentation`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from vla_core.types import (
    OBS_COMMITTED_ACTIONS,
    OBS_COMMITTED_MASK,
    OBS_DELAY_STEPS,
    OBS_MID_STATE,
    OBS_MID_STEPS,
    OBS_STATE,
    image_key,
    mid_image_key,
)

DelayKind = Literal["fixed", "uniform", "histogram"]
DelayEstimate = Literal["oracle", "measured"]


@dataclass
class DelayConfig:
    """How long inference takes, in control steps, and what the policy is told about it."""

    kind: DelayKind = "fixed"  # fixed, uniform or histogram
    steps: int = 0  # fixed: the delay d
    low: int = 0  # uniform: smallest d
    high: int = 0  # uniform: largest d
    # histogram: JSON lines of measured latencies, as `vla-rl serve` writes them. They become steps of
    # the control period they were measured at, which must be the env's (eval) or the dataset's (train).
    latencies_file: str = ""
    # What a request announces as its delay (observation.delay_steps, RTC guidance): oracle = the delay it
    # will get (simulation only), measured = the robot's estimate, the largest lag of the last
    # chunking.estimate_window merged chunks (what `vla-rl serve` announces).
    estimate: DelayEstimate = "oracle"
    seed: int = 0  # seed of the delay draws (stream s of a run draws from seed + s; see DelayModel)


class DelayModel:
    """Draws inference delays in control steps. ``max_steps`` bounds every draw.

    control_dt: seconds per control step where the delays are used (the env's, or the dataset's
    1 / fps); a latency file must have been measured at it. Only ``histogram`` needs it.
    stream: which of a run's delay streams this is (a data-parallel process, a rollout worker): every
    generator it owns, on the CPU and on any device, is seeded ``config.seed + stream`` (the one rule).
    """

    def __init__(self, config: DelayConfig, control_dt: float | None = None, stream: int = 0):
        self.config = config
        self.generator = torch.Generator()  # draws on the CPU (training)
        self.use_stream(stream)
        if config.estimate not in ("oracle", "measured"):
            raise ValueError(f"delay.estimate must be oracle or measured, got {config.estimate!r}")
        # A field of another kind would be ignored: say so, rather than run without the delay asked for.
        owner = {"steps": "fixed", "low": "uniform", "high": "uniform", "latencies_file": "histogram"}
        stray = [name for name, kind in owner.items() if kind != config.kind and getattr(config, name)]
        if stray and config.kind in owner.values():
            raise ValueError(
                f"delay.{stray[0]} does not apply to --delay.kind={config.kind}; set --delay.kind={owner[stray[0]]}"
            )
        if config.kind == "fixed":
            if config.steps < 0:
                raise ValueError(f"delay.steps must be >= 0, got {config.steps}")
            self.max_steps = config.steps
        elif config.kind == "uniform":
            if not 0 <= config.low <= config.high:
                raise ValueError(f"uniform delay needs 0 <= delay.low <= delay.high, got {config.low}, {config.high}")
            self.max_steps = config.high
        elif config.kind == "histogram":
            if control_dt is None:
                raise ValueError("a latency histogram needs the control period its delays are counted in")
            steps = latencies_to_steps(load_latencies(config.latencies_file, control_dt), control_dt)
            self.latency_steps = torch.from_numpy(steps)
            self.max_steps = int(self.latency_steps.max())
        else:
            raise ValueError(f"unknown delay kind {config.kind!r}; set --delay.kind to fixed, uniform or histogram")

    def use_stream(self, stream: int) -> None:
        """Draw from the start of the run's delay stream ``stream``: every generator seeded ``config.seed + stream``."""
        self.seed = self.config.seed + stream
        self.generator.manual_seed(self.seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every generator's state, by device (``cpu``, and each accelerator the delays were drawn on), so a
        resumed run draws on where it stopped, on the CPU and on a GPU alike."""
        devices = {str(d): g.get_state() for d, g in self._device_generators.items()}
        return {"cpu": self.generator.get_state(), **devices}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        """Restore the generators of ``states`` (any subset of `state_dict`'s), creating an accelerator's."""
        for name, state in states.items():
            if name == "cpu":
                self.generator.set_state(state)
            else:
                device = torch.device(name)
                self._device_generators.setdefault(device, torch.Generator(device=device)).set_state(state)

    def sample(self, n: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(n,) long delays in control steps, drawn on ``device`` (None: the CPU, from ``generator``).

        On another device the draws come from a generator of that device (seeded like the CPU's), so
        a simulation on a GPU draws without copying from the host.
        """
        cfg = self.config
        device = torch.device(device or "cpu")
        if cfg.kind == "fixed":
            return torch.full((n,), cfg.steps, dtype=torch.long, device=device)
        generator = self.generator
        if device.type != "cpu":
            if device not in self._device_generators:
                self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
            generator = self._device_generators[device]
        if cfg.kind == "uniform":
            return torch.randint(cfg.low, cfg.high + 1, (n,), generator=generator, device=device)
        pick = torch.randint(0, len(self.latency_steps), (n,), generator=generator, device=device)
        return self.latency_steps.to(device)[pick]


def load_latencies(path: str | Path, control_dt: float) -> np.ndarray:
    """A latency file (JSON lines with ``latency_s`` and ``control_dt``) -> (M,) float64 latencies in seconds.

    Every line must have been measured at ``control_dt``: a latency says nothing about steps of
    another rate's controller.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"latency file {path} not found; `vla-rl serve` writes one (latency_log), or use --delay.kind=fixed"
        )
    values, periods = [], set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            values.append(float(record["latency_s"]))
            periods.add(float(record["control_dt"]))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{path}:{number} is not a latency record {{'latency_s': .., 'control_dt': ..}} ({err})"
            ) from err
    latencies = np.asarray(values, dtype=np.float64)
    if latencies.size == 0:
        raise ValueError(f"{path} holds no latencies; record some with `vla-rl serve` first")
    if not np.isfinite(latencies).all() or (latencies < 0).any():
        raise ValueError(f"{path} holds latencies that are negative or not finite; it must list finite latencies >= 0")
    other = sorted(p for p in periods if not math.isclose(p, control_dt, rel_tol=1e-6))
    if other:
        raise ValueError(
            f"{path} was measured at a control period of {other[0]:g} s but the delays are counted in steps of "
            f"{control_dt:g} s; measure at that rate (vla-rl serve --control_hz={1 / control_dt:g})"
        )
    return latencies


def latencies_to_steps(latencies_s: np.ndarray, control_dt: float) -> np.ndarray:
    """(M,) seconds -> (M,) int64 control steps, rounded up."""
    if control_dt <= 0:
        raise ValueError(f"control_dt must be > 0, got {control_dt}")
    # The small tolerance keeps exact multiples (0.1 s at 0.05 s) from rounding up by float error.
    return np.ceil(latencies_s / control_dt - 1e-9).astype(np.int64)


class LatencyLog:
    """Writes measured inference latencies to a latency file (started afresh), one JSON line each,
    flushed at once so a killed run keeps every line it measured. Extra fields ride along for people."""

    def __init__(self, path: str | Path, control_dt: float):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.control_dt = control_dt
        self._file = self.path.open("w")

    def write(self, latency_s: float, **extra: float | str) -> None:
        record = {"latency_s": round(latency_s, 6), "control_dt": self.control_dt, **extra}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def augmentation(
    ahead: torch.Tensor, available: torch.Tensor, delay_steps: torch.Tensor, max_delay: int, validate: bool = True
) -> dict[str, torch.Tensor]:
    """The delay augmentation of a request whose chunk starts ``delay_steps`` steps from now.

    ahead: (B, n, A) the actions for the next n steps, index j = step now + j; available: (B, n)
    bool, where ``ahead`` holds a real action; delay_steps: (B,) long in [0, max_delay]. Returns

    - ``OBS_COMMITTED_ACTIONS``: (B, max_delay, A) float, row j = ``ahead[:, j]`` where the mask holds, else 0
    - ``OBS_COMMITTED_MASK``: (B, max_delay) bool, j < delay_steps and ``available``
    - ``OBS_DELAY_STEPS``: (B,) long, ``delay_steps``

    ``validate=False`` skips the range check, which reads the device, for a caller that clamped the
    delays itself (`vla_core.runtime.LatencyProtocol`).
    """
    if delay_steps.ndim != 1 or delay_steps.is_floating_point():
        raise ValueError(
            f"delay_steps must be a (B,) integer tensor, got {delay_steps.dtype} {tuple(delay_steps.shape)}"
        )
    delay_steps = delay_steps.to(ahead.device).long()
    if validate and ((delay_steps < 0) | (delay_steps > max_delay)).any():
        raise ValueError(f"delay_steps must be in [0, max_delay={max_delay}], got {delay_steps.tolist()}")
    B, _, A = ahead.shape
    n = min(max_delay, ahead.shape[1])  # steps past what is known are never committed: padding only
    rows = torch.arange(n, device=ahead.device)
    mask = torch.zeros(B, max_delay, dtype=torch.bool, device=ahead.device)
    mask[:, :n] = (rows[None, :] < delay_steps[:, None]) & available[:, :n]
    committed = torch.zeros(B, max_delay, A, dtype=ahead.dtype, device=ahead.device)
    committed[:, :n] = torch.where(mask[:, :n, None], ahead[:, :n], 0.0)
    return {OBS_COMMITTED_ACTIONS: committed, OBS_COMMITTED_MASK: mask, OBS_DELAY_STEPS: delay_steps}


def augmentation_features_dim(width: int, action_dim: int) -> int:
    """The width of `augmentation_features` for an augmentation ``width`` rows wide (0: none, no features)."""
    return width * (action_dim + 1) + 1 if width else 0


def augmentation_features(obs: dict, width: int, normalize_action) -> torch.Tensor:
    """(B, width * (A + 1) + 1) the delay augmentation as one flat vector, what a value head reads of it:
    the committed actions (normalized by ``normalize_action``; 0 where not committed), the mask, and the
    announced delay over ``width``. ``obs`` holds the augmentation of that width (`augmentation`)."""
    mask = obs[OBS_COMMITTED_MASK][:, :width].bool()
    actions = obs[OBS_COMMITTED_ACTIONS][:, :width].float()
    # Rows outside the mask are padding: never read them, not even through the normalization.
    committed = torch.where(mask[..., None], normalize_action(torch.where(mask[..., None], actions, 0.0)), 0.0)
    delay = obs[OBS_DELAY_STEPS].float()[:, None] / max(width, 1)
    return torch.cat([committed.flatten(1), mask.float(), delay], -1)


def committed_prefix(
    actions: torch.Tensor, action_is_pad: torch.Tensor, delay_steps: torch.Tensor, max_delay: int
) -> dict[str, torch.Tensor]:
    """The delay augmentation of a training sample: its demonstration chunk's first d actions.

    A chunk requested at step t with delay d starts at t + d; until then the robot executes what the
    previous chunk committed. In a demonstration, what runs at t + j is the demonstrated action at
    t + j, so the committed prefix is ``actions[:, :d]``. actions (B, H, A) in dataset units,
    action_is_pad (B, H) bool (padding past the episode end is never committed), delay_steps (B,).
    """
    return augmentation(actions, ~action_is_pad, delay_steps, max_delay)


def mid_inference_steps(delay_steps: torch.Tensor, mid_fraction: float) -> torch.Tensor:
    """(B,) long: m = floor(mid_fraction * d), the steps from a request announcing delay d to its
    mid-inference observation. In float64, so it floors the same product as plain Python floats."""
    return (delay_steps.double() * mid_fraction).floor().long()


def mid_observation(observation: dict, cameras, steps):
    """The one builder of ``observation.mid.*`` from an observation batch (torch or numpy): its state,
    the images of ``cameras``, and ``steps`` (B,) from the request."""
    mid = {OBS_MID_STATE: observation[OBS_STATE], OBS_MID_STEPS: steps}
    for cam in cameras:
        mid[mid_image_key(cam)] = observation[image_key(cam)]
    return mid
