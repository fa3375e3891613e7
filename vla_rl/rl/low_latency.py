"""RL of a policy's low-latency part (ARLI's fast policy, `policies.low_latency`) at the control-step level.

The slow policy (the VLA) is frozen: it answers every request with its deterministic chunk, through the same
latency protocol as evaluation and the robot. The low-latency part acts at every control step of every world
(the shell's step policy): it samples a correction delta ~ N(mu, sigma^2) from the freshest observation and
the protocol's context and the world runs the corrected action. Each control step is one decision, and the
process it acts in is Markov (fresh state, the plan, its ages): its reward is the env's reward of that step,
its next value is worth gamma. PPO (`vla_rl.rl.ppo`) learns from these decisions as from chunk decisions: one
factor per decision, the log-density of its correction; the critic reads the part's own features, the
episode's progress and, with ``--ppo.privileged_critic``, the simulator's privileged state at that step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from policies.low_latency import LowLatencyInputs
from vla_core.rl import FactorLogProb
from vla_core.types import OBS_PRIVILEGED, ActionChunk
from vla_rl.rl.rollout import Rollout, RolloutStats, privileged_features, select_rows, to_device

PREFIX = "low_latency."  # the rollout's observation keys of the part's inputs


def inputs_as_obs(inputs: LowLatencyInputs) -> dict[str, torch.Tensor]:
    """A `LowLatencyInputs` as observation-batch keys (``low_latency.*``), so rollouts select and move them."""
    obs = {
        f"{PREFIX}{name}": getattr(inputs, name) for name in ("state", "plan", "plan_mask", "plan_age", "since_request")
    }
    return obs | {f"{PREFIX}images.{cam}": image for cam, image in inputs.images.items()}


def obs_as_inputs(obs: dict[str, Any], device) -> LowLatencyInputs:
    """The inverse of `inputs_as_obs`, on ``device``."""
    get = lambda name: obs[f"{PREFIX}{name}"].to(device)
    images = {
        k.removeprefix(f"{PREFIX}images."): v.to(device) for k, v in obs.items() if k.startswith(f"{PREFIX}images.")
    }
    return LowLatencyInputs(get("state"), images, get("plan"), get("plan_mask"), get("plan_age"), get("since_request"))


@dataclass
class Corrections:
    """B control-step decisions of a low-latency part: ``delta`` (B, A), the sampled corrections
    (`vla_core.rl.Decision`)."""

    delta: torch.Tensor

    def __len__(self) -> int:
        return len(self.delta)

    def select(self, rows: torch.Tensor) -> Corrections:
        return Corrections(self.delta[rows.to(self.delta.device)])

    def to(self, device) -> Corrections:
        return Corrections(self.delta.to(device))

    @staticmethod
    def cat(parts: Sequence[Corrections]) -> Corrections:
        return Corrections(torch.cat([p.delta.to(parts[0].delta.device) for p in parts]))


class LowLatencyActor:
    """The RL actor (`vla_core.rl.RLPolicy`) of ``policy``'s low-latency part: ``module`` (what trains) is the part;
    ``policy`` (what checkpoints save, evaluation and serving run) is the whole policy. ``step_policy`` is the
    shells' step policy during rollouts: it samples, and records what it read while ``recording``."""

    num_factors = 1

    def __init__(self, policy):
        if policy.low_latency is None:
            raise ValueError("this policy has no low-latency part; fine-tune it with --low_latency=true")
        self.policy, self.module = policy, policy.low_latency
        self.value_dim = self.module.mean.in_features
        self.recorded: list[dict[str, torch.Tensor]] | None = None  # a list while a rollout records
        self.privileged_env = None  # the simulator whose privileged state each recorded step keeps, or None

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @torch.no_grad()
    def step_policy(self, obs: dict, base: torch.Tensor, context) -> torch.Tensor:
        """(N, A): the corrected actions of a control step, the correction sampled with the part's sigma."""
        inputs = self.policy.low_latency_inputs(obs, base, context)
        mean, _ = self.module(inputs)
        delta = mean + self.module.log_std.exp() * torch.randn_like(mean)
        if self.recorded is not None:
            step = {k: v.cpu() for k, v in inputs_as_obs(inputs).items()} | {"delta": delta.cpu()}
            if self.privileged_env is not None:
                step[OBS_PRIVILEGED] = privileged_features(self.privileged_env)
            self.recorded.append(step)
        return self.policy.corrected_action(base, delta)

    def act(self, obs: dict, obs_step: torch.Tensor):
        raise NotImplementedError("a low-latency part acts every control step (step_policy), not per chunk")

    def score(self, obs: dict, decision: Corrections, executed: torch.Tensor | None = None) -> FactorLogProb:
        """(B, 1): the log-density of each step's correction under the current weights, with autograd."""
        return FactorLogProb(
            self.module.log_prob(obs_as_inputs(obs, self.device), decision.delta.to(self.device))[:, None]
        )

    def value_features(self, obs: dict) -> torch.Tensor:
        """(B, hidden): the part's own features of the step's inputs."""
        return self.module(obs_as_inputs(obs, self.device))[1]


@torch.no_grad()
def collect_steps(
    actor: LowLatencyActor,
    shell,
    *,
    episodes_per_world: int,
    seed: int | Sequence[int],
    task: int = 0,
    gamma: float = 1.0,
    privileged: bool = False,
) -> tuple[Rollout, RolloutStats]:
    """Roll the frozen slow policy and ``actor``'s low-latency part out in ``shell`` (a `DelayedChunkEnv` whose
    step policy is ``actor.step_policy``) for ``episodes_per_world`` episodes per world: one decision per control
    step of every world's recorded episodes, grouped by world and episode in time order (as `collect`'s)."""
    if shell.step_policy != actor.step_policy:
        raise ValueError(
            "the shell's step policy must be the actor's (DelayedChunkEnv(..., step_policy=actor.step_policy))"
        )
    start, n, slow = time.perf_counter(), shell.num_envs, actor.policy
    obs, need = shell.reset(seed=seed)
    done_episodes, step_in_episode = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    parts: list[dict[str, Any]] = []
    episode_success, episode_diverged = {}, {}
    env_steps = simulated = 0
    actor.privileged_env = shell.env if privileged else None
    horizon, action_dim = slow.config.horizon, slow.config.action_dim
    while (done_episodes < episodes_per_world).any():
        asked = need.cpu().numpy()
        obs_step = shell.obs_step
        actions = torch.zeros(n, horizon, action_dim)
        if asked.any():  # every asked world gets the slow policy's chunk (finished worlds' steps are not recorded)
            rows = torch.from_numpy(np.flatnonzero(asked))
            sub = to_device(select_rows(obs, rows), actor.device)
            actions[rows] = slow.predict_chunk(sub, obs_step[rows.to(obs_step.device)].to(actor.device)).actions.cpu()
        actor.recorded = []
        try:
            obs, _, terminated, truncated, info, need = shell.step(ActionChunk(actions.to(shell.device), obs_step))
            steps = actor.recorded
        finally:
            actor.recorded = None
        trace = info["trace"].numpy()
        simulated += int(info["steps"].sum())
        ended = (terminated | truncated).cpu().numpy()
        for w in np.flatnonzero(done_episodes < episodes_per_world):
            count = len(steps)  # every world took every step of the call; an episode's end is its last
            index = np.arange(count)
            parts.append({"world": w, "episode": int(done_episodes[w]), "first": int(step_in_episode[w]),
                          "steps": [{k: v[w] for k, v in s.items()} for s in steps],
                          "reward": trace["reward"][w], "terminated": trace["terminated"][w],
                          "truncated": trace["truncated"][w] & ~trace["terminated"][w], "index": index})  # fmt: skip
            env_steps += count
            step_in_episode[w] += count
            if ended[w]:
                episode_success[(int(w), int(done_episodes[w]))] = bool(info["success"][w])
                episode_diverged[(int(w), int(done_episodes[w]))] = bool(trace["diverged"][w].any())
                done_episodes[w] += 1
                step_in_episode[w] = 0
    actor.privileged_env = None
    stats = RolloutStats(episodes=len(episode_success), successes=sum(episode_success.values()),
                         diverged=sum(episode_diverged.values()), env_steps=env_steps, simulated_steps=simulated,
                         seconds=time.perf_counter() - start)  # fmt: skip
    return _step_rollout(parts, episode_success, episode_diverged, task, gamma), stats


def _step_rollout(parts: list[dict[str, Any]], success: dict, diverged: dict, task: int, gamma: float) -> Rollout:
    """The recorded steps of finished episodes as one `Rollout` of step decisions, per world and episode in order."""
    parts = [p for p in parts if (p["world"], p["episode"]) in success and len(p["steps"])]
    if not parts:
        raise RuntimeError("the rollout recorded no control step of a finished episode")
    steps = [s for p in parts for s in p["steps"]]
    obs = {k: torch.stack([s[k] for s in steps]) for k in steps[0] if k != "delta"}
    flat = lambda key: np.concatenate([p[key] for p in parts])
    world = np.concatenate([np.full(len(p["steps"]), p["world"]) for p in parts])
    episode = np.concatenate([np.full(len(p["steps"]), p["episode"]) for p in parts])
    step = np.concatenate([p["first"] + p["index"] for p in parts])
    keys = list(zip(world.tolist(), episode.tolist(), strict=True))
    m = len(steps)
    rollout = Rollout(
        obs=obs, obs_step=torch.from_numpy(step), decision=Corrections(torch.stack([s["delta"] for s in steps])),
        executed=torch.ones(m, 1, dtype=torch.bool), world=torch.from_numpy(world), episode=torch.from_numpy(episode),
        task=torch.full((m,), task, dtype=torch.long), reward=torch.from_numpy(flat("reward")).float(),
        discount=torch.full((m,), gamma), steps=torch.ones(m, dtype=torch.long),
        done=torch.from_numpy(flat("terminated") | flat("truncated")), truncated=torch.from_numpy(flat("truncated")),
        success=torch.tensor([success[k] for k in keys]), diverged=torch.tensor([diverged[k] for k in keys]),
    )  # fmt: skip
    order = torch.from_numpy(np.lexsort((step, episode, world)))
    return rollout.select(order)
