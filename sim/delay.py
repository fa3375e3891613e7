"""The inference-delay model: what happens between asking a policy for a chunk and getting it.

`DelayedChunkEnv` wraps any batched env. A chunk computed from the observation at step t
becomes available only at step t + d; meanwhile the actions already committed keep executing
through `vla_rl.runtime.ActionChunkExecutor`, the same object the robot bridge drives. Each
observation handed to the policy carries the delay augmentation of DESIGN.md: the actions that
will run before its chunk can start, their mask, and the delay d it will see.

Timing, per world (all worlds step together, each on its own schedule):

- a request at step t draws a delay d from the delay model; the chunk arrives at step t + d and
  is merged into the queue (its actions for steps before t + d are already past and dropped);
- the next request happens at step max(t + execute_steps, t + d): after ``execute_steps`` steps,
  and never while an inference is still running (one inference at a time, as on a robot);
- a step with nothing queued sends the env's hold action (``env.hold_actions()`` when the env
  has it, else the executor's last action);
- an episode that ends resets the world's queue, drops its in-flight chunk, and requests at once.

Delay models draw d in control steps: fixed, uniform over [low, high], or replayed from latencies
measured on a robot (seconds, converted with the control period and rounded up).

For RL, each world's chunk is one transition: from its request to its next request, or to the end
of its episode. Worlds run on their own schedules, so a call to ``step`` may end some worlds'
transitions and only advance the others'; `ChunkTransition` (``info["transition"]``) keeps the
per-world sums and marks the complete ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from sim.config import world_indices
from vla_rl.runtime import ActionChunkExecutor, MergeMode
from vla_rl.types import ActionChunk, BatchedEnv, Worlds, WorldState


@dataclass
class DelayConfig:
    """How long inference takes, in control steps."""

    kind: Literal["fixed", "uniform", "histogram"] = "fixed"  # fixed, uniform or histogram
    steps: int = 0  # fixed: the delay d
    low: int = 0  # uniform: smallest d
    high: int = 0  # uniform: largest d
    latencies_file: str = ""  # histogram: JSON list of measured inference latencies in seconds
    control_dt: float = 0.05  # histogram: control period in seconds, to turn latencies into steps
    seed: int = 0  # seed of the delay draws


@dataclass
class ChunkTransition:
    """Each world's chunk-level transition, from its latest chunk request up to now. All (N,), on the CPU.

    start_step: long, the control step of the request (the step the chunk was conditioned on).
    steps: long, env steps taken since the request.
    reward: float32, the env's reward summed over those steps.
    terminated, truncated: bool, the episode ended on the last of them (a transition never spans
        two episodes; the episode's last observation is then ``info["final_obs"]``).
    ready: bool, the transition is complete: the world requests a new chunk now, or its episode
        ended. Other rows are still running and hold their values so far.
    """

    start_step: torch.Tensor
    steps: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    ready: torch.Tensor

    @classmethod
    def zeros(cls, n: int) -> ChunkTransition:
        long, flag = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
        return cls(long, long.clone(), torch.zeros(n), flag, flag.clone(), flag.clone())

    def clone(self) -> ChunkTransition:
        return ChunkTransition(*(t.clone() for t in vars(self).values()))

    def start(self, worlds: torch.Tensor, step: torch.Tensor) -> None:
        """Open a new transition in ``worlds`` ((N,) bool), requested at control step ``step`` (N,)."""
        self.start_step[worlds] = step[worlds]
        for running in (self.steps, self.reward, self.terminated, self.truncated, self.ready):
            running[worlds] = 0

    def add_step(self, reward: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor) -> None:
        """Every world took one env step: (N,) each, float32 and bool, on the CPU."""
        self.steps += 1
        self.reward += reward
        self.terminated |= terminated
        self.truncated |= truncated


class DelayModel:
    """Draws inference delays in control steps. ``max_steps`` bounds every draw."""

    def __init__(self, config: DelayConfig):
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        if config.kind == "fixed":
            if config.steps < 0:
                raise ValueError(f"delay steps must be >= 0, got {config.steps}")
            self.max_steps = config.steps
        elif config.kind == "uniform":
            if not 0 <= config.low <= config.high:
                raise ValueError(f"uniform delay needs 0 <= low <= high, got low={config.low} high={config.high}")
            self.max_steps = config.high
        elif config.kind == "histogram":
            self.latency_steps = latencies_to_steps(load_latencies(config.latencies_file), config.control_dt)
            self.max_steps = int(self.latency_steps.max())
        else:
            raise ValueError(f"unknown delay kind {config.kind!r}; choose fixed, uniform or histogram")

    def sample(self, n: int) -> np.ndarray:
        """(n,) int64 delays in control steps."""
        kind = self.config.kind
        if kind == "fixed":
            return np.full(n, self.config.steps, dtype=np.int64)
        if kind == "uniform":
            return self.rng.integers(self.config.low, self.config.high + 1, size=n)
        return self.rng.choice(self.latency_steps, size=n)


def load_latencies(path: str | Path) -> np.ndarray:
    """A JSON list of latencies in seconds (or {"latencies_s": [...]}) -> (M,) float array."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"latency file {path} not found; record one on the robot or use delay kind fixed")
    data = json.loads(path.read_text())
    values = np.asarray(data["latencies_s"] if isinstance(data, dict) else data, dtype=np.float64)
    if values.ndim != 1 or values.size == 0 or not np.isfinite(values).all() or (values < 0).any():
        raise ValueError(f"{path} must hold a non-empty list of finite latencies >= 0 in seconds")
    return values


def latencies_to_steps(latencies_s: np.ndarray, control_dt: float) -> np.ndarray:
    """A chunk that arrives partway through a control period is first usable at the next step: round up."""
    if control_dt <= 0:
        raise ValueError(f"control_dt must be > 0, got {control_dt}")
    # The small tolerance keeps exact multiples (0.1 s at 0.05 s) from rounding up by float error.
    return np.ceil(latencies_s / control_dt - 1e-9).astype(np.int64)


class DelayedChunkEnv:
    """A batched env seen through inference delay: the policy acts in chunks, the env in steps.

    ``reset`` and ``step`` return an observation batch and ``need`` (N,) bool: the worlds that
    request a chunk now. ``step`` takes the chunks for those worlds (other rows are ignored) and
    advances the env until some world requests again. Each world's transition since its request
    is ``info["transition"]`` (`ChunkTransition`).
    """

    def __init__(
        self,
        env: BatchedEnv,
        horizon: int,
        execute_steps: int,
        delay: DelayModel,
        merge: MergeMode = "latest",
        ensemble_coeff: float = 0.01,
    ):
        if not 1 <= execute_steps:
            raise ValueError(f"execute_steps must be >= 1, got {execute_steps}")
        self.env = env
        self.num_envs = env.num_envs
        self.delay = delay
        self.execute_steps = execute_steps
        self.executor = ActionChunkExecutor(
            env.num_envs, env.action_dim, horizon, merge=merge, ensemble_coeff=ensemble_coeff,
            max_delay=delay.max_steps, device=env.device,
        )  # fmt: skip
        n = env.num_envs
        self._obs: dict[str, Any] = {}
        self._need = np.zeros(n, dtype=bool)  # worlds whose request is open
        self._pending_delay = np.zeros(n, dtype=np.int64)  # d drawn for each open request
        self._in_flight = np.zeros(n, dtype=bool)  # a submitted chunk has not arrived yet
        self._flight_actions: torch.Tensor | None = None  # (N, H, A) the in-flight chunks
        self._flight_obs_step = torch.zeros(n, dtype=torch.long, device=env.device)  # (N,)
        self._arrival = np.zeros(n, dtype=np.int64)  # step at which the in-flight chunk arrives
        self._next_request = np.zeros(n, dtype=np.int64)
        self._transition = ChunkTransition.zeros(n)  # each world's, since its latest request

    @property
    def obs_step(self) -> torch.Tensor:
        """(N,) long: the step of the current observation, to condition chunks on."""
        return self.executor.step.clone()

    def reset(self, seed: int | Sequence[int] | None = None, *, worlds: Worlds = None) -> tuple[dict, torch.Tensor]:
        """Start new episodes in ``worlds`` (all when None; ``seed`` as in `BatchedEnv.reset`).

        Returns obs with delay augmentation and need (N,) bool: the restarted worlds request at once;
        the others keep their queues, in-flight chunks and transitions.
        """
        return self._restart(self.env.reset(seed=seed, worlds=worlds), worlds)

    def set_state(self, states: Sequence[WorldState], worlds: Worlds = None) -> tuple[dict, torch.Tensor]:
        """Load saved world states (`BatchedEnv.set_state`) into ``worlds``, which then start afresh
        here: an empty queue, no chunk in flight, a new transition, a request at once (GRPO's group
        of worlds starting from one state). Returns obs with delay augmentation and need (N,)."""
        return self._restart(self.env.set_state(states, worlds=worlds), worlds)

    def _restart(self, obs: dict[str, Any], worlds: Worlds) -> tuple[dict, torch.Tensor]:
        """Forget the selected worlds' chunks (they belong to the episode they left) and open a request."""
        selected = np.zeros(self.num_envs, dtype=bool)
        selected[world_indices(worlds, self.num_envs)] = True
        mask = torch.from_numpy(selected)
        self.executor.reset(mask.to(self.executor.device))
        self._in_flight[selected] = False
        self._next_request[selected] = 0
        self._need[selected] = True
        self._pending_delay[selected] = self.delay.sample(int(selected.sum()))
        self._transition.start(mask, torch.zeros(self.num_envs, dtype=torch.long))
        return self._augment(obs), torch.from_numpy(self._need.copy())

    def step(self, chunk: ActionChunk) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, dict, torch.Tensor]:
        """Submit chunks for the requesting worlds, then step until some world requests.

        chunk: (N, H, A) with ``obs_step`` the step each row was conditioned on; rows of worlds
        that did not request are ignored. Returns obs, reward (N,) summed over the steps taken,
        terminated (N,), truncated (N,), info, need (N,). ``info["steps"]`` (N,) counts the env
        steps taken, ``info["success"]`` (N,) is True where an episode ended in success,
        ``info["delay_steps"]`` (N,) is the delay each submitted chunk got (-1 where none was), and
        ``info["transition"]`` is each world's `ChunkTransition` since its own request (which may
        predate this call), complete where it is ``ready``.
        """
        submitted = self._need.copy()
        step_now = self.executor.step.cpu().numpy()
        if self._flight_actions is None or self._flight_actions.shape[1:] != chunk.actions.shape[1:]:
            self._flight_actions = torch.zeros_like(chunk.actions, device=self.executor.device)
        rows = torch.from_numpy(submitted).to(self.executor.device)
        self._flight_actions[rows] = chunk.actions.to(self.executor.device)[rows]
        self._flight_obs_step[rows] = chunk.obs_step.to(self.executor.device)[rows]
        self._in_flight |= submitted
        self._arrival = np.where(submitted, step_now + self._pending_delay, self._arrival)
        self._next_request = np.where(
            submitted, step_now + np.maximum(self.execute_steps, self._pending_delay), self._next_request
        )
        delays = np.where(submitted, self._pending_delay, -1)
        self._transition.start(torch.from_numpy(submitted), torch.from_numpy(step_now.astype(np.int64)))

        n = self.num_envs
        reward = torch.zeros(n)
        terminated = torch.zeros(n, dtype=torch.bool)
        truncated = torch.zeros(n, dtype=torch.bool)
        success = torch.zeros(n, dtype=torch.bool)
        steps = torch.zeros(n, dtype=torch.long)
        info: dict[str, Any] = {}
        hold = getattr(self.env, "hold_actions", None)
        while True:
            self._deliver_arrived()
            step_now = self.executor.step.cpu().numpy()
            self._need = ~self._in_flight & (step_now >= self._next_request)
            if self._need.any():
                break
            actions, valid = self.executor.next_action()
            if hold is not None and not valid.all():
                actions = torch.where(valid[:, None], actions, torch.as_tensor(hold(), dtype=actions.dtype))
            obs, r, term, trunc, info = self.env.step(actions)
            self._obs = obs
            r, term, trunc = r.float().cpu(), term.cpu(), trunc.cpu()  # one host copy each per step
            reward += r
            steps += 1
            terminated |= term
            truncated |= trunc
            self._transition.add_step(r, term, trunc)
            success |= info["success"].cpu()
            done = (term | trunc).numpy()
            if done.any():
                # The world starts a new episode: its queue and in-flight chunk belong to the old one.
                self.executor.reset(torch.from_numpy(done).to(self.executor.device))
                self._in_flight &= ~done
                self._next_request[done] = 0
        self._pending_delay = np.where(self._need, self.delay.sample(n), 0)
        self._transition.ready = torch.from_numpy(self._need.copy())
        info = {
            **info, "steps": steps, "success": success, "delay_steps": torch.from_numpy(delays),
            "transition": self._transition.clone(),
        }  # fmt: skip
        return self._augment(self._obs), reward, terminated, truncated, info, torch.from_numpy(self._need.copy())

    def _deliver_arrived(self) -> None:
        """Merge every in-flight chunk whose arrival step has come into the executor's queue."""
        arrived = self._in_flight & (self.executor.step.cpu().numpy() >= self._arrival)
        if arrived.any():
            chunks = ActionChunk(self._flight_actions, self._flight_obs_step)
            self.executor.add_chunk(chunks, env_mask=torch.from_numpy(arrived).to(self.executor.device))
            self._in_flight &= ~arrived

    def _augment(self, obs: dict[str, Any]) -> dict[str, Any]:
        self._obs = obs
        delay = torch.from_numpy(self._pending_delay).to(self.executor.device)
        return {**obs, **self.executor.delay_augmentation(delay)}
