"""How long inference takes, in control steps: the delay model, measured latency files, and the
delay augmentation built from a demonstration.

The one definition of each, read by training (`vla_rl.train`), evaluation (`vla_core.runtime.delayed_env`) and the
robot (`robot_bridge`):

- `DelayConfig` / `DelayModel`: delays drawn fixed, uniform over [low, high], or taken from latencies
  measured on a robot (``vla-rl serve`` writes them, see `LatencyLog`): drawn at random from them
  (``histogram``) or replayed in the robot's order (``trace``, `LatencyTrace`).
- A latency file is JSON lines, one measured inference per line:
  ``{"latency_s": 0.083, "control_dt": 0.05, "episode": 3, "request": 7, ...}``. Seconds become control
  steps rounded up: a chunk that arrives partway through a control period is first usable at the next
  step. ``episode`` and ``request`` (the robot's episode, and the request's index in it from 0) are what
  ``trace`` replays by; ``histogram`` reads only the first two fields.
- `committed_prefix`: the delay augmentation for a training sample, the actions a demonstration
  would already be executing while its chunk is computed (the robot's and the simulation's come
  from the queue, `ActionChunkExecutor.delay_augmentation`; all three share `augmentation`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

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

DelayKind = Literal["fixed", "uniform", "histogram", "trace"]
DelayEstimate = Literal["oracle", "measured"]
PastTrace = Literal["refuse", "last"]


@dataclass
class DelayConfig:
    """How long inference takes, in control steps, and what the policy is told about it."""

    kind: DelayKind = "fixed"  # fixed, uniform, histogram or trace
    steps: int = 0  # fixed: the delay d
    low: int = 0  # uniform: smallest d
    high: int = 0  # uniform: largest d
    # histogram and trace: JSON lines of measured latencies, as `vla-rl serve` writes them. They become steps
    # of the control period they were measured at, which must be the env's (eval) or the dataset's (train).
    # histogram draws them at random; trace replays them in order, in `vla-rl eval` only: request k of the
    # evaluation's episode e gets the latency the robot measured for its request k of its episode e.
    latencies_file: str = ""
    # trace: what a request past the robot's last logged request of its episode gets (the episode ran longer
    # in simulation than on the robot): refuse (stop and say so) or last (that episode's last latency).
    past_trace: PastTrace = "refuse"
    # What a request announces as its delay (observation.delay_steps, RTC guidance): oracle = the delay it
    # will get (simulation only), measured = the robot's estimate, the largest lag of the last
    # chunking.estimate_window merged chunks (what `vla-rl serve` announces).
    estimate: DelayEstimate = "oracle"
    seed: int = 0  # seed of the delay draws (stream s of a run draws from seed + s; see DelayModel)


class DelayModel:
    """Draws inference delays in control steps (``trace``: replays them, `request_delays`). ``max_steps``
    bounds every draw.

    control_dt: seconds per control step where the delays are used (the env's, or the dataset's
    1 / fps); a latency file must have been measured at it. Only ``histogram`` and ``trace`` need it.
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
        owners = {"steps": ("fixed",), "low": ("uniform",), "high": ("uniform",),
                  "latencies_file": ("histogram", "trace"), "past_trace": ("trace",)}  # fmt: skip
        default = DelayConfig()
        stray = [name for name, kinds in owners.items()
                 if config.kind not in kinds and getattr(config, name) != getattr(default, name)]  # fmt: skip
        if stray and config.kind in get_args(DelayKind):
            raise ValueError(
                f"delay.{stray[0]} does not apply to --delay.kind={config.kind}; set --delay.kind={owners[stray[0]][0]}"
            )
        if config.kind == "fixed":
            if config.steps < 0:
                raise ValueError(f"delay.steps must be >= 0, got {config.steps}")
            self.max_steps = config.steps
        elif config.kind == "uniform":
            if not 0 <= config.low <= config.high:
                raise ValueError(f"uniform delay needs 0 <= delay.low <= delay.high, got {config.low}, {config.high}")
            self.max_steps = config.high
        elif config.kind in ("histogram", "trace"):
            if control_dt is None:
                raise ValueError(f"a latency {config.kind} needs the control period its delays are counted in")
            if config.kind == "trace":
                self.trace = LatencyTrace(config.latencies_file, control_dt, config.past_trace)
                self.max_steps = self.trace.max_steps
            else:
                steps = latencies_to_steps(load_latencies(config.latencies_file, control_dt), control_dt)
                self.latency_steps = torch.from_numpy(steps)
                self.max_steps = int(self.latency_steps.max())
        else:
            raise ValueError(
                f"unknown delay kind {config.kind!r}; set --delay.kind to fixed, uniform, histogram or trace"
            )

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
        if cfg.kind == "trace":
            raise ValueError(
                "--delay.kind=trace replays a robot's episodes request by request, which only `vla-rl eval` numbers; "
                "draw from the same latencies with --delay.kind=histogram here"
            )
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

    def request_delays(
        self, opened: torch.Tensor, episodes: torch.Tensor | None, requests: torch.Tensor, device=None
    ) -> torch.Tensor:
        """(N,) long on ``device``: the delay of the request each world in ``opened`` (N,) bool opens now (the
        other rows are unused). The drawn kinds draw N delays, as ``sample(N)`` does. The trace kind replays:
        world w's request ``requests[w]`` of episode ``episodes[w]`` (N,) long each, numbered by the
        evaluation's plan (-1: an episode the plan does not count, which gets 0); None: the caller numbers
        no episodes, which it refuses. A trace lookup reads ``opened`` and the numbers on the host."""
        if self.config.kind != "trace":
            return self.sample(len(requests), device)
        if episodes is None:
            self.sample(0)  # the one refusal of a caller that does not number its episodes
        return self.trace.delays(opened.cpu(), episodes.cpu(), requests.cpu()).to(device)

    def check_episodes(self, count: int) -> None:
        """Refuse, before any step, an evaluation of ``count`` episodes that a trace does not cover."""
        if self.config.kind == "trace":
            self.trace.check_episodes(count)


def load_latencies(path: str | Path, control_dt: float) -> np.ndarray:
    """A latency file (JSON lines with ``latency_s`` and ``control_dt``) -> (M,) float64 latencies in seconds.

    Every line must have been measured at ``control_dt``: a latency says nothing about steps of
    another rate's controller.
    """
    return np.asarray([r["latency_s"] for r in read_latency_records(path, control_dt)], dtype=np.float64)


def read_latency_records(path: str | Path, control_dt: float) -> list[dict]:
    """The records of a latency file, each checked: a finite ``latency_s`` >= 0 (as a float), measured at
    ``control_dt``; their other fields as written."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"latency file {path} not found; `vla-rl serve` writes one (latency_log), or use --delay.kind=fixed"
        )
    records, periods = [], set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["latency_s"] = float(record["latency_s"])
            periods.add(float(record["control_dt"]))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{path}:{number} is not a latency record {{'latency_s': .., 'control_dt': ..}} ({err})"
            ) from err
        records.append(record)
    latencies = np.asarray([r["latency_s"] for r in records], dtype=np.float64)
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
    return records


def latencies_to_steps(latencies_s: np.ndarray, control_dt: float) -> np.ndarray:
    """(M,) seconds -> (M,) int64 control steps, rounded up."""
    if control_dt <= 0:
        raise ValueError(f"control_dt must be > 0, got {control_dt}")
    # The small tolerance keeps exact multiples (0.1 s at 0.05 s) from rounding up by float error.
    return np.ceil(latencies_s / control_dt - 1e-9).astype(np.int64)


class LatencyTrace:
    """A robot's measured latencies in the order it made its requests, for ``--delay.kind=trace``.

    Read from a latency file whose records carry ``episode`` and ``request`` (as `vla-rl serve` writes
    them): ``steps`` (E, K) long, the delay in control steps (rounded up, `latencies_to_steps`) of request k
    of episode e, -1 where none was logged (the inference failed or never came back); ``logged`` (E,) long,
    one past each episode's last logged request. ``past``: what a request at or past ``logged[e]`` gets
    (`DelayConfig.past_trace`): refused, or that episode's last latency.
    """

    def __init__(self, path: str | Path, control_dt: float, past: PastTrace = "refuse"):
        if past not in get_args(PastTrace):
            raise ValueError(f"delay.past_trace must be one of {get_args(PastTrace)}, got {past!r}")
        self.path, self.past = Path(path), past
        records = read_latency_records(path, control_dt)
        keys: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        for number, record in enumerate(records, start=1):
            try:
                episode, request = int(record["episode"]), int(record["request"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(
                    f"{path}: record {number} has no episode and request numbers, which a trace replays by; record it "
                    "with `vla-rl serve --topics.episode=<the robot's episode status>`, or use --delay.kind=histogram"
                ) from None
            if episode < 0 or request < 0:
                raise ValueError(
                    f"{path}: record {number} numbers episode {episode}, request {request}; both must be >= 0"
                )
            if (episode, request) in seen:
                raise ValueError(
                    f"{path} logs request {request} of episode {episode} twice; a trace is one run of the robot: "
                    "record it afresh (serve rewrites its latency_log at start)"
                )
            keys.append((episode, request))
            seen.add((episode, request))
        steps = latencies_to_steps(np.asarray([r["latency_s"] for r in records]), control_dt)
        table = np.full((max(e for e, _ in keys) + 1, max(k for _, k in keys) + 1), -1, dtype=np.int64)
        logged = np.zeros(len(table), dtype=np.int64)
        for (episode, request), d in zip(keys, steps, strict=True):
            table[episode, request] = d
            logged[episode] = max(logged[episode], request + 1)
        self.steps, self.logged = torch.from_numpy(table), torch.from_numpy(logged)
        self.max_steps = int(steps.max())

    @property
    def episodes(self) -> int:
        """E: the episodes the trace covers, 0 to E - 1."""
        return len(self.logged)

    def check_episodes(self, count: int) -> None:
        """Refuse replaying ``count`` episodes from a trace of fewer."""
        if count > self.episodes:
            raise ValueError(
                f"the latency trace {self.path} holds the robot's episodes 0-{self.episodes - 1} but {count} are to "
                f"be replayed: record the robot for {count} episodes, or evaluate --num_episodes={self.episodes}"
            )

    def delays(self, opened: torch.Tensor, episodes: torch.Tensor, requests: torch.Tensor) -> torch.Tensor:
        """(N,) long: request ``requests[w]`` of episode ``episodes[w]`` for the worlds ``opened`` (N,) bool, 0
        elsewhere and where the episode is -1 (not counted). CPU tensors."""
        out = torch.zeros(len(opened), dtype=torch.long)
        rows = opened & (episodes >= 0)
        if not bool(rows.any()):
            return out
        e, k = episodes[rows], requests[rows]
        self.check_episodes(int(e.max()) + 1)
        logged = self.logged[e]
        past = k >= logged
        refused = past & ((logged == 0) | (self.past == "refuse"))
        if bool(refused.any()):
            i = int(torch.nonzero(refused)[0])
            raise ValueError(
                f"request {int(k[i])} of episode {int(e[i])} is past the latency trace {self.path}, which logged "
                f"{int(logged[i])} requests of that episode (it ran longer in simulation than on the robot): pass "
                "--delay.past_trace=last to give such requests the episode's last latency"
            )
        d = self.steps[e, torch.where(past, logged - 1, k)]
        if bool((d < 0).any()):
            i = int(torch.nonzero(d < 0)[0])
            raise ValueError(
                f"request {int(k[i])} of episode {int(e[i])} is missing from the latency trace {self.path} (its "
                "inference failed or never came back): record the robot again"
            )
        out[rows] = d
        return out


class LatencyLog:
    """Writes measured inference latencies to a latency file (started afresh), one JSON line each,
    flushed at once so a killed run keeps every line it measured. Extra fields ride along: `vla-rl serve`
    adds ``episode`` and ``request`` (what ``--delay.kind=trace`` replays by), ``request_id``, ``obs_step``,
    ``merged`` (whether its chunk was merged) and ``lag_steps`` (of a merged chunk: steps from the request to
    the tick that found it; a chunk dropped after a new episode restarted the step count has no such lag)."""

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
