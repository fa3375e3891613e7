"""The simulation's shell around the latency protocol (`vla_core.runtime.protocol`): a batched env seen
through inference delay, in simulated time. What only simulation does is stand in for inference: each
request draws its delay from a `DelayModel` (fixed, uniform, or from latencies a robot measured: drawn
at random, or replayed in the robot's order), and its chunk is held until ``LatencyProtocol.arrival_step``.
Each world's request is numbered within its episode (``request_index``), and a reset may number the
episodes it starts (``episode``, an evaluation plan's): a trace delay and a per-request noise seed
(`vla_core.runtime.noise`) are looked up by the two.

Host reads per control step: whether any world requests now (which ends the call); with a
mid-inference observation also whether a policy is asked and whether an episode ended (which ends
the call too: the ended world's episode is over, and its new request is asked only m steps
on). A call reads once more, to refuse a submitted chunk with NaN or inf (and, replaying a trace, once per
request opened, to look its delay up). For RL, each call also returns what every control step did
(`StepTrace`, ``info["trace"]``: the reward and which chunk's row ran), from which RL credits each decision
with the steps its own rows ran (`vla_core.runtime.transition.ExecutionCredit`); it costs no host read.

An instruction that changes mid-episode (the observation's ``task``, compared per world after every step; an
episode's start is no change) goes to the protocol's ``new_instruction``: with ``chunking.on_new_instruction=replan``
the world drops its plan and what is in flight and requests at once, so the call ends there. In simulation the
abandoned inference stops at once (the request is cancelled), so the new one starts without waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vla_core.runtime.config import ChunkingConfig
from vla_core.runtime.delay import DelayModel
from vla_core.runtime.protocol import LatencyProtocol, LatencySpec, StepContext, Use, merge_rows
from vla_core.runtime.transition import StepTrace
from vla_core.types import TASK, ActionChunk, BatchedEnv, Worlds, WorldState, world_indices

# A low-latency part's step policy: (the freshest observation of N worlds, the queue's actions (N, A) for this step,
# the protocol's context) -> the actions (N, A) to run (`policies.pretrained.PreTrainedPolicy.low_latency_step`).
StepPolicy = Callable[[dict[str, Any], torch.Tensor, StepContext], torch.Tensor]


def window_layout(
    tau: torch.Tensor, delay: int, steps_per_chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This shell's timeline under a fixed ``delay`` d with ``steps_per_chunk`` s, from an episode's first step: a
    request every P = max(s, d) steps (one inference at a time), the chunk of the request at step iP runs steps
    iP + d .. iP + d + P - 1 (its rows d .. d + P - 1), and before step d the arm holds. For in-episode steps ``tau``
    (B,) long: (the step of the request whose chunk runs at tau (B,) long, -1 before step d; the plan's age k = tau
    minus that step (B,), -1 before step d; the steps since the latest request, tau mod P (B,))."""
    period = max(steps_per_chunk, delay)
    planned = tau >= delay
    request = torch.where(planned, torch.div(tau - delay, period, rounding_mode="floor") * period, -1)
    return request, torch.where(planned, tau - request, -1), tau % period


def step_policy_of(policy) -> StepPolicy | None:
    """A policy's step policy (its low-latency part's mean correction), or None when it has no low-latency part."""
    return policy.low_latency_step if getattr(policy, "low_latency", None) is not None else None


class DelayedChunkEnv:
    """``reset`` / ``step`` return an observation batch and ``need`` (N,) bool, the worlds whose policy is
    asked now: their rows hold the request's observation, its augmentation and (latency-aware)
    ``observation.mid.*``. ``step`` takes their chunks and steps until some world is asked again; a
    step with nothing queued sends the env's ``hold_actions()``. step_policy: a policy with a low-latency part
    (``spec.low_latency_rows``) corrects every control step's action with it, from the freshest observation.
    """

    def __init__(self, env: BatchedEnv, spec: LatencySpec, chunking: ChunkingConfig, delay: DelayModel, *,
                 use: Use = "eval", step_policy: StepPolicy | None = None):  # fmt: skip
        if bool(spec.low_latency_rows) != (step_policy is not None):
            raise ValueError(
                "a policy with a low-latency part acts every control step: give the shell its step policy "
                "(policy.low_latency_step)" if spec.low_latency_rows else
                "a step policy corrects a low-latency policy's actions; this policy has no low-latency part"
            )  # fmt: skip
        self.step_policy, self.step_rows = step_policy, spec.low_latency_rows
        self.env, self.delay, self.num_envs = env, delay, env.num_envs
        self.device = dev = torch.device(env.device)
        self.protocol = LatencyProtocol(
            spec, chunking, use=use, num_worlds=env.num_envs, action_dim=env.action_dim, max_delay=delay.max_steps,
            estimate=delay.config.estimate, device=dev,
        )  # fmt: skip
        self.execute_steps = self.protocol.execute_steps
        self._obs: dict[str, Any] = {}
        self._request_obs: dict[str, Any] = {}  # with a mid observation: each open request's observation
        self._need = torch.zeros(env.num_envs, dtype=torch.bool, device=dev)  # worlds whose policy is asked
        self._true_delay = torch.zeros(env.num_envs, dtype=torch.long, device=dev)  # of each open request
        self._flight: ActionChunk | None = None  # (N, H, A) the chunks in flight
        self._arrival = torch.zeros(env.num_envs, dtype=torch.long, device=dev)  # when each in-flight one lands
        # Each world's episode number (-1: none; None until a reset numbers episodes) and its latest request's
        # index within the episode (-1: none yet).
        self._episode: torch.Tensor | None = None
        self._request_index = torch.full((env.num_envs,), -1, dtype=torch.long, device=dev)
        self._instructions: list[str] | None = None  # each world's instruction in force (its latest observation's)

    @property
    def obs_step(self) -> torch.Tensor:
        """(N,) long: each world's latest request step, to condition its chunk on (the mid observation is later)."""
        return self.protocol.request_step.clone()

    @property
    def episode(self) -> torch.Tensor | None:
        """(N,) long: the number a reset gave each world's episode (-1: none, as after an autoreset), or None
        when no reset numbered episodes."""
        return None if self._episode is None else self._episode.clone()

    @property
    def request_index(self) -> torch.Tensor:
        """(N,) long: the index within its episode (from 0) of each world's latest request, the one its policy
        answers when asked; -1 before its first."""
        return self._request_index.clone()

    @property
    def guidance(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RTC guidance (target (N, H, A), weights (N, H)) of the asked worlds, for `Policy.predict_chunk`'s
        ``inpaint``; None unless the merge is ``rtc`` and the policy takes guidance."""
        return self.protocol.guidance

    def hold_actions(self) -> torch.Tensor | None:
        """(N, A) the env's actions that keep each world still (None when it has none)."""
        return self.env.hold_actions() if hasattr(self.env, "hold_actions") else None

    def reset(
        self, seed: int | Sequence[int] | None = None, *, worlds: Worlds = None, episodes: Sequence[int] | None = None
    ) -> tuple[dict, torch.Tensor]:
        """New episodes in ``worlds`` (all when None; ``seed`` as in `BatchedEnv.reset`), which request at
        once; the others keep their queues and in-flight chunks. episodes: one number per
        reset world (-1: none), which a trace delay and per-request noise look up (``episode``); None:
        unnumbered. Returns (obs, need)."""
        return self._restart(self.env.reset(seed=seed, worlds=worlds), worlds, episodes)

    def set_state(self, states: Sequence[WorldState], worlds: Worlds = None) -> tuple[dict, torch.Tensor]:
        """Load saved world states (`BatchedEnv.set_state`) into ``worlds``, which start afresh as after
        ``reset`` (GRPO's group of worlds starting from one state). Returns (obs, need)."""
        return self._restart(self.env.set_state(states, worlds=worlds), worlds)

    def _restart(
        self, obs: dict[str, Any], worlds: Worlds, episodes: Sequence[int] | None = None
    ) -> tuple[dict, torch.Tensor]:
        indices = world_indices(worlds, self.num_envs)
        selected = np.zeros(self.num_envs, dtype=bool)
        selected[indices] = True
        mask = torch.from_numpy(selected).to(self.device)
        if episodes is not None or self._episode is not None:
            numbers = np.full(self.num_envs, -1, dtype=np.int64)
            if episodes is not None:
                if len(episodes) != len(indices):
                    raise ValueError(
                        f"{len(indices)} reset worlds need {len(indices)} episode numbers, got {len(episodes)}"
                    )
                numbers[indices] = episodes
            if self._episode is None:
                self._episode = torch.full_like(self._request_index, -1)
            self._episode = torch.where(mask, torch.from_numpy(numbers).to(self.device), self._episode)
        self._request_index = torch.where(mask, -1, self._request_index)
        self.protocol.restart(mask)
        self._need = self._need & ~mask
        self._obs = obs
        self._instructions = list(obs[TASK]) if TASK in obs else None
        self._open(mask)
        self._need = self._need | self.protocol.take_asked()
        return self._asked_obs(), self._need.clone()

    def _open(self, worlds: torch.Tensor) -> None:
        """Open a request in ``worlds``: draw the delay it will get, and keep its observation until its
        policy is asked. Nothing arrives before the policy is asked and answers."""
        self._request_index = torch.where(worlds, self._request_index + 1, self._request_index)
        drawn = self.delay.request_delays(worlds, self._episode, self._request_index, self.device)
        self._true_delay = torch.where(worlds, drawn, self._true_delay)
        self.protocol.open(worlds, true_delay=self._true_delay)
        self._arrival = torch.where(worlds, torch.iinfo(torch.long).max, self._arrival)
        if self.protocol.mid_fraction is not None:
            self._request_obs = merge_rows(self._request_obs, self._obs, worlds)

    def _new_instruction(self, ended: torch.Tensor, final_obs: dict[str, Any] | None) -> torch.Tensor:
        """(N,) bool: the worlds whose observation after this step carries another instruction than the one before it
        in their episode. An ended world's is its episode's last observation (``final_obs``, the env's), so a switch at
        an episode's last step counts, and the next episode's first instruction is no switch; an env that gives no
        final observation has ended worlds read as unswitched (``ended`` (N,) bool)."""
        now = self._obs.get(TASK)
        if now is None or self._instructions is None:
            return torch.zeros_like(ended)
        final = (final_obs or {}).get(TASK)
        seen = now if final is None else final
        changed = [new != old for new, old in zip(seen, self._instructions, strict=True)]
        self._instructions = list(now)
        if not any(changed):  # the common case: no tensor made, nothing copied to the device
            return torch.zeros_like(ended)
        flags = torch.tensor(changed, dtype=torch.bool, device=self.device)
        return flags if final is not None else flags & ~ended

    def _asked_obs(self) -> dict[str, Any]:
        """What the asked worlds' policy sees (rows of other worlds hold stale values)."""
        if self.protocol.mid_fraction is None:
            return {**self._obs, **self.protocol.augmentation}
        return {**self._request_obs, **self.protocol.augmentation, **self.protocol.mid_observation(self._obs)}

    def step(self, chunk: ActionChunk) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, dict, torch.Tensor]:
        """Submit the asked worlds' chunks (N, H, A) and step until some world is asked: obs, reward (N,) summed,
        terminated, truncated, info, need. ``info``: ``steps`` (N,), ``success`` (N,) an episode ended in
        success, ``delay_steps`` (N,) each submitted chunk's delay (-1: none), ``requests`` (N,) the requests
        opened in the episode that ended (0 where none did) and ``trace``, the call's `StepTrace`."""
        p, dev, submitted = self.protocol, self.device, self._need
        actions = chunk.actions.to(device=dev, dtype=torch.float32)
        if not (torch.isfinite(actions) | ~submitted[:, None, None]).all():
            raise ValueError("chunk actions contain NaN or inf")
        old = self._flight or ActionChunk(torch.zeros_like(actions), torch.zeros_like(self._arrival))
        self._flight = ActionChunk(torch.where(submitted[:, None, None], actions, old.actions),
                                   torch.where(submitted, chunk.obs_step.to(dev), old.obs_step))  # fmt: skip
        self._arrival = torch.where(submitted, p.arrival_step(self._true_delay), self._arrival)
        delays = torch.where(submitted, self._true_delay, -1)
        n = self.num_envs
        reward, steps = torch.zeros(n, device=dev), torch.zeros(n, dtype=torch.long, device=dev)
        terminated = torch.zeros(n, dtype=torch.bool, device=dev)
        truncated, success, info = terminated.clone(), terminated.clone(), {}
        requests = torch.zeros_like(steps)
        hold = getattr(self.env, "hold_actions", None)
        trace: list[dict[str, torch.Tensor]] = []
        while True:
            p.receive(self._flight, p.in_flight & (p.step >= self._arrival), validate=False)
            due = p.due()
            if p.mid_fraction is None:  # asked at once: the one host read per control step
                if due.any():
                    self._open(due)
                    need = p.take_asked()
                    break
            else:
                if due.any():
                    self._open(due)
                need = p.take_asked()
                if need.any():
                    break
            context = None if self.step_policy is None else p.step_context(self.step_rows)
            actions, valid = p.next_action()
            # On the CPU, asking which worlds have no action is free and spares the hold pose's per-world
            # loop on most steps; on an accelerator the hold is computed every step rather than read back.
            if hold is not None and (dev.type != "cpu" or not valid.all()):
                actions = torch.where(valid[:, None], actions, hold().to(device=dev, dtype=actions.dtype))
            if context is not None:  # the low-latency part, on the freshest observation
                actions = self.step_policy(self._obs, actions, context).to(device=dev, dtype=actions.dtype)
            source, row = p.executor.emitted_source, p.executor.emitted_row  # the chunk and row just emitted
            self._obs, r, term, trunc, info = self.env.step(actions)
            r, term, trunc = r.to(dev, torch.float32), term.to(dev), trunc.to(dev)
            reward, steps = reward + r, steps + 1
            terminated, truncated = terminated | term, truncated | trunc
            diverged = info.get("diverged")
            diverged = torch.zeros_like(term) if diverged is None else diverged.to(dev)
            trace.append({"reward": r, "source": source, "row": row, "terminated": term, "truncated": trunc,
                          "diverged": diverged})  # fmt: skip
            success |= info["success"].to(dev)
            ended = term | trunc  # a new episode forgets the old one's queue, chunk in flight and open request
            new_instruction = self._new_instruction(ended, info.get("final_obs"))
            trace[-1]["new_instruction"] = new_instruction
            p.restart(ended)
            p.new_instruction(new_instruction & ~ended)  # an ended world's new episode starts afresh anyway
            requests = torch.where(ended, self._request_index + 1, requests)
            self._request_index = torch.where(ended, -1, self._request_index)
            if self._episode is not None:  # an autoreset's episode is not one a reset numbered
                self._episode = torch.where(ended, -1, self._episode)
            if p.mid_fraction is not None and ended.any():
                need = torch.zeros_like(ended)  # its new episode's policy is asked only m steps on
                break
        self._need = need.clone()
        info = {
            **info,
            "steps": steps,
            "success": success,
            "delay_steps": delays,
            "requests": requests,
            "trace": StepTrace.stack(trace, self.num_envs, dev),
        }
        return self._asked_obs(), reward, terminated, truncated, info, need.clone()
