"""Rollouts for RL fine-tuning: a policy samples chunks through the latency model, one decision per chunk.

The decision is a chunk. Each world asks for a chunk when `vla_core.runtime.delayed_env.DelayedChunkEnv` says it
does (the latency protocol of `vla_core.runtime`, exactly as in ``vla-rl eval`` and on the robot);
the actor (`vla_core.rl.RLPolicy`) samples it with ``act``, which also returns the decision behind
it (a denoising chain, a token sequence, ...; the rollout never looks inside), and the chunk's
transition runs until the world's next request or the end of its episode. Its reward is the env's reward
summed over the control steps the chunk ran, discounted per control step
(``ChunkTransition.discounted_reward``), and the next decision's value is worth ``discount``
= gamma^steps of it.

Every world runs ``episodes_per_world`` whole episodes per rollout, from seeded resets; a world
that has finished its episodes holds its pose until the others finish, and nothing it does is
recorded. An iteration's rollout therefore never ends mid-episode (no value bootstrap across
iterations, and a resumed run starts its rollout exactly as the killed one would have).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from vla_core.rl import Decision, FactorLogProb, RLPolicy, cat_decisions
from vla_core.types import TASK, ActionChunk


def select_rows(obs: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The observation batch of the given rows ((R,) long); tensors and ``task`` only."""
    picked = rows.tolist()
    return {
        k: [v[i] for i in picked] if k == TASK else v[rows.to(v.device)]
        for k, v in obs.items()
        if k == TASK or torch.is_tensor(v)
    }


def to_device(obs: dict[str, Any], device) -> dict[str, Any]:
    """The observation batch with its tensors on ``device``."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in obs.items()}


def cat_obs(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate observation batches along the batch dimension."""
    return {
        k: [t for b in batches for t in b[k]] if k == TASK else torch.cat([b[k] for b in batches]) for k in batches[0]
    }


@dataclass
class Rollout:
    """M chunk decisions, grouped by world and, within a world, in the order they were made.

    obs: observation batch of M rows (with the delay augmentation each request carried), on the CPU.
    obs_step: (M,) long, the control step each chunk was conditioned on.
    decision: the M decisions behind the chunks (`vla_core.rl.Decision`: what the learner scores), on the CPU.
    world, episode: (M,) long, the world and that world's episode (0 .. episodes_per_world - 1);
        in a multi-task rollout (`cat`) each task's worlds are numbered after the previous task's.
    task: (M,) long, the index of the decision's task in the run's task list.
    reward: (M,) float, sum_i gamma^i r_i over the control steps the chunk ran.
    discount: (M,) float, gamma^steps: the weight of the next decision's value.
    steps: (M,) long, control steps the chunk ran.
    done: (M,) bool, the episode ended with this decision (success, failure, time limit or divergence).
    truncated: (M,) bool, the episode ended with this decision at the time limit, not in a terminal state: a
        value could follow it, but the rollout does not record the state it would be of. PPO and GRPO end the
        episode there all the same (CleanRL's choice); SAC leaves such transitions out (`vla_rl.rl.sac`).
    success: (M,) bool, the decision's episode ended in success (every decision of it).
    diverged: (M,) bool, the decision's episode ended because its world blew up (every decision of it).
    version: (M,) long, the policy version that sampled each decision (asynchronous rollouts,
        `vla_rl.rl.ray_runtime`); None for a rollout of the learner's own weights.
    behaviour_log_prob: the per-factor log-probabilities of the decisions under the weights that
        sampled them (asynchronous rollouts); None: the learner scores them itself.
    """

    obs: dict[str, Any]
    obs_step: torch.Tensor
    decision: Decision
    world: torch.Tensor
    episode: torch.Tensor
    task: torch.Tensor
    reward: torch.Tensor
    discount: torch.Tensor
    steps: torch.Tensor
    done: torch.Tensor
    truncated: torch.Tensor
    success: torch.Tensor
    diverged: torch.Tensor
    version: torch.Tensor | None = None
    behaviour_log_prob: FactorLogProb | None = None

    def __len__(self) -> int:
        return len(self.world)

    def select(self, rows: torch.Tensor) -> Rollout:
        """The decisions of ``rows`` ((R,) long or (M,) bool), in that order."""
        if rows.dtype == torch.bool:
            rows = rows.nonzero().flatten()
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in picked.items():
            if name == "obs":
                picked[name] = select_rows(value, rows)
            elif name in ("decision", "behaviour_log_prob") and value is not None:
                picked[name] = value.select(rows)
            elif value is not None:
                picked[name] = value[rows]
        return Rollout(**picked)

    @staticmethod
    def cat(rollouts: Sequence[Rollout], worlds_per_rollout: int) -> Rollout:
        """One rollout of several (one per task): rollout r's worlds become r * worlds_per_rollout + w."""
        parts = {f.name: [getattr(r, f.name) for r in rollouts] for f in fields(Rollout)}
        parts["world"] = [r.world + i * worlds_per_rollout for i, r in enumerate(rollouts)]
        for name in ("version", "behaviour_log_prob"):  # kept only where every part has it
            if any(v is None for v in parts[name]):
                parts[name] = None
        return Rollout(**{
            name: v if v is None else cat_obs(v) if name == "obs" else cat_decisions(v) if name == "decision"
            else FactorLogProb.cat(v) if name == "behaviour_log_prob" else torch.cat(v)
            for name, v in parts.items()
        })  # fmt: skip


@dataclass
class RolloutStats:
    episodes: int  # episodes recorded
    successes: int
    diverged: int  # episodes whose world blew up (left out of the update)
    env_steps: int  # control steps of the recorded episodes
    simulated_steps: int  # control steps simulated, with those of worlds waiting for the others
    seconds: float

    @property
    def success_rate(self) -> float:
        return self.successes / max(1, self.episodes)


@torch.no_grad()
def collect(
    actor: RLPolicy,
    env,
    *,
    episodes_per_world: int,
    seed: int | Sequence[int],
    task: int = 0,
) -> tuple[Rollout, RolloutStats]:
    """Roll ``actor`` out in ``env`` (a `DelayedChunkEnv`) for ``episodes_per_world`` episodes per world.

    seed: the reset's seed (`BatchedEnv.reset`: an int, or one per world; equal seeds give equal
    initial states, which is how GRPO makes its groups). task: the task's index in the run, stored with
    every decision.
    """
    start = time.perf_counter()
    n = env.num_envs
    obs, need = env.reset(seed=seed)
    done_episodes = np.zeros(n, dtype=np.int64)  # episodes each world has finished
    open_decision = np.full(n, -1)  # index into `records` of each world's running decision
    records: list[dict[str, Any]] = []  # one per decision, filled when its transition completes
    decisions: list[Decision] = []
    observations: list[dict[str, Any]] = []
    episode_success = {}  # (world, episode) -> success
    episode_diverged = {}
    env_steps = simulated = 0
    horizon, action_dim = actor.policy.config.horizon, actor.policy.config.action_dim
    while (done_episodes < episodes_per_world).any():
        need_cpu = need.cpu().numpy()
        active = need_cpu & (done_episodes < episodes_per_world)
        rows = torch.from_numpy(np.flatnonzero(active))
        obs_step = env.obs_step
        actions = torch.zeros(n, horizon, action_dim)
        waiting = torch.from_numpy(need_cpu & ~active)  # done with their episodes: they wait in place
        hold = env.hold_actions() if waiting.any() else None
        if hold is not None:
            actions[waiting] = hold.to(torch.float32)[waiting][:, None]
        if len(rows):
            sub = select_rows(obs, rows)
            chunk, decision = actor.act(
                to_device(sub, actor.device), obs_step[rows.to(obs_step.device)].to(actor.device)
            )
            actions[rows] = chunk.actions.to(actions)
            observations.append({k: v.cpu() if torch.is_tensor(v) else v for k, v in sub.items()})
            decisions.append(decision.to("cpu"))
            for w in rows.tolist():
                open_decision[w] = len(records)
                records.append({"world": w, "episode": int(done_episodes[w]), "obs_step": int(obs_step[w])})
        obs, _, terminated, truncated, info, need = env.step(ActionChunk(actions.to(env.device), obs_step))
        transition = info["transition"]
        steps = info["steps"].cpu().numpy()
        simulated += int(steps.sum())
        env_steps += int(steps[done_episodes < episodes_per_world].sum())
        ready = transition.ready.cpu().numpy()
        cut = (truncated & ~terminated).cpu().numpy()
        ended = (terminated | truncated).cpu().numpy()
        for w in np.flatnonzero(ready & (open_decision >= 0)):
            rec = records[open_decision[w]]
            rec.update(
                reward=float(transition.discounted_reward[w]), discount=float(transition.discount[w]),
                steps=int(transition.steps[w]), done=bool(ended[w]), truncated=bool(cut[w]),
            )  # fmt: skip
            open_decision[w] = -1
        for w in np.flatnonzero(ended & (done_episodes < episodes_per_world)):
            key = (int(w), int(done_episodes[w]))
            episode_success[key] = bool(info["success"][w])
            episode_diverged[key] = bool(transition.diverged[w])
            done_episodes[w] += 1
    m = len(records)
    if m == 0:
        raise RuntimeError("the rollout recorded no decision")
    as_long = lambda name: torch.tensor([r[name] for r in records], dtype=torch.long)
    key = [(r["world"], r["episode"]) for r in records]
    rollout = Rollout(
        obs=cat_obs(observations),
        obs_step=as_long("obs_step"),
        decision=cat_decisions(decisions),
        world=as_long("world"),
        episode=as_long("episode"),
        task=torch.full((m,), task, dtype=torch.long),
        reward=torch.tensor([r["reward"] for r in records], dtype=torch.float32),
        discount=torch.tensor([r["discount"] for r in records], dtype=torch.float32),
        steps=as_long("steps"),
        done=torch.tensor([r["done"] for r in records]),
        truncated=torch.tensor([r["truncated"] for r in records]),
        success=torch.tensor([episode_success[k] for k in key]),
        diverged=torch.tensor([episode_diverged[k] for k in key]),
    )
    # Decisions were recorded in time order across worlds; the algorithms read each world's in order.
    order = torch.from_numpy(np.lexsort((np.arange(m), rollout.episode.numpy(), rollout.world.numpy())))
    stats = RolloutStats(
        episodes=len(episode_success),
        successes=sum(episode_success.values()),
        diverged=sum(episode_diverged.values()),
        env_steps=env_steps,
        simulated_steps=simulated,
        seconds=time.perf_counter() - start,
    )
    return rollout.select(order), stats
