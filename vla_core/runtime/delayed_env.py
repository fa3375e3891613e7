"""The simulation's shell around the latency model: what happens between asking a policy for a chunk
and getting it, stepped in simulated time.

`DelayedChunkEnv` wraps any batched env. When a request goes out and what it is told (the delay
estimate, the delay augmentation, RTC guidance) is `vla_core.runtime.ChunkSchedule`, and the queue of
committed actions is `vla_core.runtime.ActionChunkExecutor`: the objects the robot's node drives too
(`robot_bridge.chunk_scheduler`). What only simulation does is stand in for the inference itself:
the delay each request gets is drawn from `vla_core.runtime.DelayModel` (fixed, uniform, or replayed
from latencies a robot measured), and its chunk is held until then.

Timing, per world (all worlds step together, each on its own schedule):

- a request at step t draws a delay d; its chunk arrives at step t + d and is merged into the queue
  (its actions for steps before t + d are already past and dropped);
- the next request happens at step max(t + execute_steps, t + d): after ``execute_steps`` steps,
  and never while an inference is still running (one inference at a time, as on a robot);
- a step with nothing queued sends the env's hold action (``env.hold_actions()`` when the env
  has it, else the executor's last action);
- an episode that ends restarts the world in the schedule: its queue and in-flight chunk belong to
  the old episode, and it requests at once. Its transition is complete (``ready``) in the call
  whose steps ended it; with a mid-inference observation that call returns right there, even when
  no world's policy is asked yet (``need`` all False: call ``step`` again, with any chunk).

The mid-inference observation (``mid_fraction``, for latency-aware policies; `policies.latency_head`):
a request at step t that announces a delay d (the estimate the robot would have) is answered
m = floor(mid_fraction * d) steps later, once the policy can see the world part-way through its
inference. Until then the world runs its committed actions; the policy is then asked with the
request's observation and delay augmentation (as of step t), plus ``observation.mid.state``,
``observation.mid.images.<cam>`` (``mid_cameras``) and ``observation.mid.steps`` (m) as of step
t + m. The chunk is still conditioned on step t and arrives at t + (its true delay), but never
before step t + m + 1 when m > 0: the fast part runs after the mid observation, as on the robot
(`robot_bridge.chunk_scheduler`). Without ``mid_fraction`` the policy is asked at the request.

The state lives on the env's device, updated with masks, and delays are drawn there: the only host
read per control step is whether any world requests now, which decides when ``step`` returns. With
a mid-inference observation there are three: whether a request opens, whether a policy is asked,
and whether an episode ended (which ends the call). A
``step`` call reads it once more, to refuse a submitted chunk with NaN or inf.

For RL, each world's chunk is one transition: from its request to its next request, or to the end
of its episode. Worlds run on their own schedules, so a call to ``step`` may end some worlds'
transitions and only advance the others'; `ChunkTransition` (``info["transition"]``) keeps the
per-world sums and marks the complete ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vla_core.runtime import (
    ActionChunkExecutor,
    ChunkSchedule,
    DelayModel,
    MergeMode,
    mid_inference_steps,
    mid_observation,
)
from vla_core.types import (
    ActionChunk,
    BatchedEnv,
    Worlds,
    WorldState,
    world_indices,
)


def _merge_rows(old: dict[str, Any], new: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """``new``'s values in ``rows`` (N,) bool, ``old``'s elsewhere (all of ``new`` where ``old`` lacks a
    key): tensors with a leading world dim, or per-world lists (the instructions)."""
    merged: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if torch.is_tensor(value):
            if before is None or before.shape != value.shape:
                merged[key] = value.clone()
            else:
                mask = rows.to(value.device).view(-1, *([1] * (value.ndim - 1)))
                merged[key] = torch.where(mask, value, before)
        else:
            picked = rows.tolist()
            merged[key] = (
                list(value)
                if before is None
                else [v if p else b for v, b, p in zip(value, before, picked, strict=True)]
            )
    return merged


@dataclass
class ChunkTransition:
    """Each world's chunk-level transition, from its latest chunk request up to now. All (N,), on the env's device.

    start_step: long, the control step of the request (the step the chunk was conditioned on).
    steps: long, env steps taken since the request.
    reward: float32, the env's reward summed over those steps.
    discounted_reward: float32, the same rewards discounted per control step from the request:
        sum_i gamma^i r_i (RL's chunk-level reward; ``gamma`` of `DelayedChunkEnv`).
    discount: float32, gamma^steps: what the value of the next request is worth from this one.
    terminated, truncated: bool, the episode ended on the last of them (a transition never spans
        two episodes; the episode's last observation is then ``info["final_obs"]``).
    diverged: bool, the episode ended because its world blew up (``info["diverged"]``).
    ready: bool, the transition is complete: the world requests a new chunk now, or its episode
        ended. Other rows are still running and hold their values so far.
    """

    start_step: torch.Tensor
    steps: torch.Tensor
    reward: torch.Tensor
    discounted_reward: torch.Tensor
    discount: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    diverged: torch.Tensor
    ready: torch.Tensor

    @classmethod
    def zeros(cls, n: int, device: torch.device | str = "cpu") -> ChunkTransition:
        long, flag = torch.zeros(n, dtype=torch.long, device=device), torch.zeros(n, dtype=torch.bool, device=device)
        real = torch.zeros(n, device=device)
        return cls(long, long.clone(), real, real.clone(), real + 1, flag, flag.clone(), flag.clone(), flag.clone())

    def clone(self) -> ChunkTransition:
        return ChunkTransition(*(t.clone() for t in vars(self).values()))

    def start(self, worlds: torch.Tensor, step: torch.Tensor) -> None:
        """Open a new transition in ``worlds`` ((N,) bool), requested at control step ``step`` (N,)."""
        self.start_step = torch.where(worlds, step, self.start_step)
        for name in ("steps", "reward", "discounted_reward", "terminated", "truncated", "diverged", "ready"):
            running = getattr(self, name)
            setattr(self, name, torch.where(worlds, torch.zeros_like(running), running))
        self.discount = torch.where(worlds, torch.ones_like(self.discount), self.discount)

    def add_step(
        self,
        reward: torch.Tensor,
        terminated: torch.Tensor,
        truncated: torch.Tensor,
        diverged: torch.Tensor | None = None,
        gamma: float = 1.0,
    ) -> None:
        """Every world took one env step: (N,) each, float32 and bool; gamma discounts per step."""
        self.steps = self.steps + 1
        self.reward = self.reward + reward
        self.discounted_reward = self.discounted_reward + self.discount * reward
        self.discount = self.discount * gamma
        self.terminated = self.terminated | terminated
        self.truncated = self.truncated | truncated
        if diverged is not None:
            self.diverged = self.diverged | diverged


class DelayedChunkEnv:
    """A batched env seen through inference delay: the policy acts in chunks, the env in steps.

    ``reset`` and ``step`` return an observation batch and ``need`` (N,) bool: the worlds that
    request a chunk now. The observation carries each request's delay augmentation, and with the
    ``rtc`` merge ``guidance`` holds what a flow policy inpaints toward (`Policy.predict_chunk`'s
    ``inpaint``). ``step`` takes the chunks for the requesting worlds (other rows are ignored) and
    advances the env until some world requests again. Each world's transition since its request is
    ``info["transition"]`` (`ChunkTransition`).

    max_delay: D_max of the delay augmentation, at least the delay model's largest draw (a policy
    trained with a larger ``max_delay_steps`` is given its own). gamma: the per-control-step
    discount of the transitions' ``discounted_reward`` (RL). mid_fraction: where in the inference
    window the mid-inference observation is taken, in [0, 1] (None: none; see the module
    docstring); mid_cameras: the cameras it includes (its state is always in).
    """

    def __init__(
        self,
        env: BatchedEnv,
        horizon: int,
        execute_steps: int,
        delay: DelayModel,
        merge: MergeMode = "latest",
        ensemble_coeff: float = 0.01,
        max_delay: int | None = None,
        gamma: float = 1.0,
        mid_fraction: float | None = None,
        mid_cameras: Sequence[str] = (),
    ):
        if not 1 <= execute_steps:
            raise ValueError(f"execute_steps must be >= 1, got {execute_steps}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if mid_fraction is not None and not 0.0 <= mid_fraction < 1.0:
            raise ValueError(f"mid_fraction must be in [0, 1) (a point of the inference window), got {mid_fraction}")
        if mid_fraction is not None and merge == "rtc":
            raise ValueError("the mid-inference observation is for latency-aware policies; use merge=latest, not rtc")
        if mid_fraction is None and mid_cameras:
            raise ValueError("mid_cameras needs mid_fraction: the point of the inference window they are taken at")
        self.gamma = gamma
        self.mid_fraction = mid_fraction
        self.mid_cameras = list(mid_cameras)
        self.env = env
        self.num_envs = env.num_envs
        self.device = torch.device(env.device)
        self.delay = delay
        self.execute_steps = execute_steps
        executor = ActionChunkExecutor(
            env.num_envs, env.action_dim, horizon, merge=merge, ensemble_coeff=ensemble_coeff,
            max_delay=max(delay.max_steps, max_delay or 0), device=self.device,
        )  # fmt: skip
        cfg = delay.config
        self.schedule = ChunkSchedule(executor, execute_steps, estimate=cfg.estimate, window=cfg.estimate_window)
        self.executor = executor
        n, dev = env.num_envs, self.device
        self.guidance: tuple[torch.Tensor, torch.Tensor] | None = None  # the open requests' RTC guidance
        self._obs: dict[str, Any] = {}
        self._need = torch.zeros(n, dtype=torch.bool, device=dev)  # worlds whose policy is asked for a chunk
        self._pending = torch.zeros(n, dtype=torch.bool, device=dev)  # requests open, policy not asked yet
        self._request_step = torch.zeros(n, dtype=torch.long, device=dev)  # step of each world's latest request
        self._ask_step = torch.zeros(n, dtype=torch.long, device=dev)  # step its policy is asked at (t + m)
        self._request_obs: dict[str, Any] = {}  # with a mid observation: each open request's observation
        self._augmentation: dict[str, torch.Tensor] = {}  # each open request's delay augmentation
        self._true_delay = torch.zeros(n, dtype=torch.long, device=dev)  # the delay each open request will get
        self._flight_actions: torch.Tensor | None = None  # (N, H, A) the in-flight chunks
        self._flight_obs_step = torch.zeros(n, dtype=torch.long, device=dev)  # (N,)
        self._arrival = torch.zeros(n, dtype=torch.long, device=dev)  # step at which the in-flight chunk arrives
        self._transition = ChunkTransition.zeros(n, dev)  # each world's, since its latest request

    @classmethod
    def for_policy(
        cls, env: BatchedEnv, policy_config, execute_steps: int, delay: DelayModel, **kwargs
    ) -> DelayedChunkEnv:
        """The shell a policy runs in, from its config: the delay augmentation as wide as it reads
        (training-time RTC's ``max_delay_steps``, a latency-aware policy's ``latency_max_delay``) and a
        latency-aware policy's mid-inference observation. Refuses, before any step, a delay the policy
        was not trained for. kwargs: the other arguments of the constructor."""
        trained = getattr(policy_config, "max_delay_steps", 0)
        delay.check_fits(policy_config.horizon, trained)
        reads = trained
        if getattr(policy_config, "latency_aware", False):
            reads = max(trained, policy_config.latency_max_delay)
            if delay.max_steps > policy_config.latency_max_delay:
                raise ValueError(
                    f"the delay model reaches {delay.max_steps} control steps but this latency-aware policy was "
                    f"fine-tuned for delays up to {policy_config.latency_max_delay}; lower the delay or fine-tune "
                    f"it at {delay.max_steps}"
                )
            kwargs = {**kwargs, "mid_fraction": policy_config.mid_fraction, "mid_cameras": policy_config.mid_cameras}
        return cls(env, policy_config.horizon, execute_steps, delay, max_delay=reads, **kwargs)

    @property
    def obs_step(self) -> torch.Tensor:
        """(N,) long: the step of each world's latest request, to condition its chunk on (the step of
        the observation it was asked with; the mid-inference observation is later)."""
        return self._request_step.clone()

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
        mask = torch.from_numpy(selected).to(self.device)
        self.schedule.restart(mask)
        self._pending = self._pending & ~mask  # an open request of the episode they left is dropped
        self._need = self._need & ~mask
        self._transition.start(mask, torch.zeros_like(self._flight_obs_step))
        self._obs = obs
        self._open_requests(mask)
        self._need = self._need | self._take_asked()
        return self._asked_obs(), self._need.clone()

    def _open_requests(self, worlds: torch.Tensor) -> None:
        """Open a request in ``worlds`` from the current observation: draw its delay, announce it, and
        set when its policy is asked (at once, or m steps on with a mid-inference observation)."""
        drawn = self.delay.sample(self.num_envs, self.device)
        self._true_delay = torch.where(worlds, drawn, self._true_delay)
        request = self.schedule.request(worlds, true_delay=self._true_delay)
        self.guidance = request.guidance
        step = self.executor.step
        self._request_step = torch.where(worlds, step, self._request_step)
        mid = 0 if self.mid_fraction is None else mid_inference_steps(request.delay_steps, self.mid_fraction)
        self._ask_step = torch.where(worlds, step + mid, self._ask_step)
        self._pending = self._pending | worlds
        # In flight from now, but nothing can arrive before the policy is asked and answers.
        self._arrival = torch.where(worlds, torch.iinfo(torch.long).max, self._arrival)
        self._augmentation = _merge_rows(self._augmentation, request.augmentation, worlds)
        if self.mid_fraction is not None:  # the request's observation waits with it until the policy is asked
            self._request_obs = _merge_rows(self._request_obs, self._obs, worlds)

    def _take_asked(self) -> torch.Tensor:
        """(N,) bool: the open requests whose policy is asked now; they are no longer pending."""
        asked = self._pending & (self.executor.step >= self._ask_step)
        self._pending = self._pending & ~asked
        return asked

    def _asked_obs(self) -> dict[str, Any]:
        """What the asked worlds' policy sees: the request's observation and delay augmentation, and the
        mid-inference observation when configured. Rows of other worlds hold stale values."""
        if self.mid_fraction is None:
            return {**self._obs, **self._augmentation}
        mid = mid_observation(self._obs, self.mid_cameras, self.executor.step - self._request_step)
        return {**self._request_obs, **self._augmentation, **mid}

    def step(self, chunk: ActionChunk) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, dict, torch.Tensor]:
        """Submit chunks for the requesting worlds, then step until some world requests.

        chunk: (N, H, A) with ``obs_step`` the step each row was conditioned on; rows of worlds
        that did not request are ignored. Returns obs, reward (N,) summed over the steps taken,
        terminated (N,), truncated (N,), info, need (N,), on the env's device. ``info["steps"]``
        (N,) counts the env steps taken, ``info["success"]`` (N,) is True where an episode ended in
        success, ``info["delay_steps"]`` (N,) is the delay each submitted chunk got (-1 where none
        was), and ``info["transition"]`` is each world's `ChunkTransition` since its own request
        (which may predate this call), complete where it is ``ready``.
        """
        dev, submitted = self.device, self._need
        actions = chunk.actions.to(device=dev, dtype=torch.float32)
        if not (torch.isfinite(actions) | ~submitted[:, None, None]).all():
            raise ValueError("chunk actions contain NaN or inf")
        if self._flight_actions is None or self._flight_actions.shape != actions.shape:
            self._flight_actions = torch.zeros_like(actions)
        self._flight_actions = torch.where(submitted[:, None, None], actions, self._flight_actions)
        self._flight_obs_step = torch.where(submitted, chunk.obs_step.to(dev), self._flight_obs_step)
        arrival = self._request_step + self._true_delay
        if self.mid_fraction is not None:  # the fast part answers after its mid observation, a step on at least
            waited = self._ask_step > self._request_step
            arrival = torch.where(waited, torch.maximum(arrival, self._ask_step + 1), arrival)
        self._arrival = torch.where(submitted, arrival, self._arrival)
        delays = torch.where(submitted, self._true_delay, -1)
        self._transition.start(submitted, self._request_step)
        self._need = torch.zeros_like(submitted)

        n = self.num_envs
        reward = torch.zeros(n, device=dev)
        terminated = torch.zeros(n, dtype=torch.bool, device=dev)
        truncated, success = terminated.clone(), terminated.clone()
        steps = torch.zeros(n, dtype=torch.long, device=dev)
        info: dict[str, Any] = {}
        hold = getattr(self.env, "hold_actions", None)
        while True:
            arrived = self.schedule.in_flight & (self.executor.step >= self._arrival)
            self.schedule.receive(ActionChunk(self._flight_actions, self._flight_obs_step), arrived, validate=False)
            due = self.schedule.due()
            if self.mid_fraction is None:
                need = due
                if need.any():  # the one host read per control step
                    self._open_requests(need)
                    self._pending = self._pending & ~need
                    break
            else:
                if due.any():
                    self._open_requests(due)
                need = self._take_asked()
                if need.any():
                    break
            actions, valid = self.schedule.next_action()
            # On the CPU, asking which worlds have no action is free and spares the hold pose's per-world
            # loop on most steps; on an accelerator the hold is computed every step rather than read back.
            if hold is not None and (dev.type != "cpu" or not valid.all()):
                actions = torch.where(valid[:, None], actions, hold().to(device=dev, dtype=actions.dtype))
            obs, r, term, trunc, info = self.env.step(actions)
            self._obs = obs
            r, term, trunc = r.to(dev, torch.float32), term.to(dev), trunc.to(dev)
            reward += r
            steps += 1
            terminated |= term
            truncated |= trunc
            diverged = info.get("diverged")
            self._transition.add_step(r, term, trunc, None if diverged is None else diverged.to(dev), self.gamma)
            success |= info["success"].to(dev)
            # A world that starts a new episode forgets its queue, in-flight chunk and open request (the old episode's).
            ended = term | trunc
            self.schedule.restart(ended)
            self._pending = self._pending & ~ended
            if self.mid_fraction is not None and ended.any():
                # Its transition ends here; its new request's policy may be asked only m steps on, and
                # the steps before that belong to no transition of the old episode.
                need = torch.zeros_like(ended)
                break
        self._transition.ready = need | (terminated | truncated)
        self._need = need.clone()
        obs = self._asked_obs()
        info = {
            **info, "steps": steps, "success": success, "delay_steps": delays,
            "transition": self._transition.clone(),
        }  # fmt: skip
        return obs, reward, terminated, truncated, info, need.clone()
