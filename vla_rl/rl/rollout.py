"""Rollouts for RL fine-tuning: a policy samples chunks through the latency model, one decision per chunk.

The decision is a chunk. Each world asks for a chunk when `vla_core.runtime.delayed_env.DelayedChunkEnv` says it
does (the latency protocol of `vla_core.runtime`, exactly as in ``vla-rl eval`` and on the robot);
the actor (`vla_core.rl.RLPolicy`) samples it with ``act``, which also returns the decision behind
it (a denoising chain, a token sequence, ...; the rollout never looks inside). The decision is credited with
the control steps its own rows ran (`vla_core.runtime.transition.ExecutionCredit`): from the step its chunk's
first row runs to the step the next decision's first row runs, or the end of its episode. Its reward is the
env's reward over those steps, discounted per control step from the first, and the next decision's value is
worth ``discount`` = gamma^steps of it. Under a delay of d steps that window starts about d steps after the
request: the steps right after a request run the previous decision's rows, and are the previous decision's.
``executed`` records which rows of each chunk ran, the only ones the learner scores (`vla_core.rl`). A
decision none of whose rows ran (in flight when its episode ended) changed nothing and is left out.

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
from vla_core.runtime.transition import ExecutionCredit
from vla_core.types import OBS_PRIVILEGED, TASK, ActionChunk


def select_rows(obs: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The observation batch of the given rows ((R,) long); tensors and ``task`` only."""
    picked = rows.tolist()
    return {
        k: [v[i] for i in picked] if k == TASK else v[rows.to(v.device)]
        for k, v in obs.items()
        if k == TASK or torch.is_tensor(v)
    }


def privileged_features(env) -> torch.Tensor:
    """(N, P) float32: each world's privileged state (`BatchedEnv.privileged_state`, the facts a scripted expert
    reads: the task's arrays in name order, flattened) and its end effector's position, for an asymmetric
    critic. ``env``: a simulator with both (the MuJoCo and MuJoCo Warp backends)."""
    if not (hasattr(env, "privileged_state") and hasattr(env, "ee_positions")):
        raise ValueError(
            f"--ppo.privileged_critic reads the simulator's privileged state, which {type(env).__name__} does not "
            f"give (the cpu and warp backends of vla-rl's own tasks do); drop --ppo.privileged_critic"
        )
    state = env.privileged_state()
    parts = [np.asarray(state[name], dtype=np.float32).reshape(env.num_envs, -1) for name in sorted(state)]
    return torch.from_numpy(np.concatenate([*parts, np.asarray(env.ee_positions(), dtype=np.float32)], axis=1))


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
    executed: (M, H) bool, the rows of each chunk that ran (contiguous: from the row that ran first to the row
        that ran last); the learner scores only these rows (`vla_core.rl.RLPolicy.score`).
    world, episode: (M,) long, the world and that world's episode (0 .. episodes_per_world - 1);
        in a multi-task rollout (`cat`) each task's worlds are numbered after the previous task's.
    task: (M,) long, the index of the decision's task in the run's task list.
    reward: (M,) float, sum_i gamma^i r_i over the decision's window (the control steps its rows ran).
    discount: (M,) float, gamma^steps: the weight of the next decision's value.
    steps: (M,) long, control steps of the decision's window.
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
    executed: torch.Tensor
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
    gamma: float = 1.0,
    privileged: bool = False,
) -> tuple[Rollout, RolloutStats]:
    """Roll ``actor`` out in ``env`` (a `DelayedChunkEnv`) for ``episodes_per_world`` episodes per world.

    seed: the reset's seed (`BatchedEnv.reset`: an int, or one per world; equal seeds give equal
    initial states, which is how GRPO makes its groups). task: the task's index in the run, stored with
    every decision. gamma: the discount per control step of each decision's window. privileged: record the
    simulator's privileged state at each decision (``observation.privileged``, `privileged_features`), which an
    asymmetric critic reads and the actor never sees.
    """
    start = time.perf_counter()
    n = env.num_envs
    obs, need = env.reset(seed=seed)
    credit = ExecutionCredit(n, gamma)
    done_episodes = np.zeros(n, dtype=np.int64)  # episodes each world has finished
    asked: list[dict[int, int]] = [{} for _ in range(n)]  # per world, its episode's decisions: obs_step -> record
    records: list[dict[str, Any]] = []  # one per decision, filled when its window closes
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
            recorded = {k: v.cpu() if torch.is_tensor(v) else v for k, v in sub.items()}
            if privileged:  # after the actor acted: it never sees the critic's inputs
                recorded[OBS_PRIVILEGED] = privileged_features(env.env)[rows]
            observations.append(recorded)
            decisions.append(decision.to("cpu"))
            for w in rows.tolist():
                asked[w][int(obs_step[w])] = len(records)
                records.append({"world": w, "episode": int(done_episodes[w]), "obs_step": int(obs_step[w])})
        obs, _, terminated, truncated, info, need = env.step(ActionChunk(actions.to(env.device), obs_step))
        steps = info["steps"].cpu().numpy()
        simulated += int(steps.sum())
        env_steps += int(steps[done_episodes < episodes_per_world].sum())
        for window in credit.add(info["trace"]):
            index = asked[window.world].get(window.source)  # None: a finished world's hold, no decision
            if index is not None and done_episodes[window.world] < episodes_per_world:
                records[index].update(window=window)
        ended = (terminated | truncated).cpu().numpy()
        for w in np.flatnonzero(ended & (done_episodes < episodes_per_world)):
            key = (int(w), int(done_episodes[w]))
            episode_success[key] = bool(info["success"][w])
            episode_diverged[key] = bool(info["trace"].diverged[w].any())
            done_episodes[w] += 1
            asked[w] = {}
    return _rollout(records, observations, decisions, episode_success, episode_diverged, task, horizon), RolloutStats(
        episodes=len(episode_success),
        successes=sum(episode_success.values()),
        diverged=sum(episode_diverged.values()),
        env_steps=env_steps,
        simulated_steps=simulated,
        seconds=time.perf_counter() - start,
    )


def _rollout(records, observations, decisions, episode_success, episode_diverged, task, horizon) -> Rollout:
    """The decisions that ran (those with a window), grouped by world and episode in time order."""
    ran = [i for i, r in enumerate(records) if "window" in r]
    if not ran:
        raise RuntimeError("the rollout recorded no decision whose chunk ran")
    records = [records[i] for i in ran]
    m = len(records)
    windows = [r["window"] for r in records]
    as_long = lambda values: torch.tensor(values, dtype=torch.long)
    key = [(r["world"], r["episode"]) for r in records]
    executed = torch.zeros(m, horizon, dtype=torch.bool)
    for i, w in enumerate(windows):
        executed[i, w.first_row : w.last_row + 1] = True
    rollout = Rollout(
        obs=select_rows(cat_obs(observations), as_long(ran)),
        obs_step=as_long([r["obs_step"] for r in records]),
        decision=cat_decisions(decisions).select(as_long(ran)),
        executed=executed,
        world=as_long([r["world"] for r in records]),
        episode=as_long([r["episode"] for r in records]),
        task=torch.full((m,), task, dtype=torch.long),
        reward=torch.tensor([w.reward for w in windows], dtype=torch.float32),
        discount=torch.tensor([w.discount for w in windows], dtype=torch.float32),
        steps=as_long([w.steps for w in windows]),
        done=torch.tensor([w.terminated or w.truncated for w in windows]),
        truncated=torch.tensor([w.truncated and not w.terminated for w in windows]),
        success=torch.tensor([episode_success[k] for k in key]),
        diverged=torch.tensor([episode_diverged[k] for k in key]),
    )
    # Decisions were recorded in time order across worlds; the algorithms read each world's in order.
    order = torch.from_numpy(np.lexsort((np.arange(m), rollout.episode.numpy(), rollout.world.numpy())))
    return rollout.select(order)
