"""Asynchronous rollouts on Ray (``vla-rl finetune --runtime=ray``): workers keep collecting while the learner updates.

Layout: ``ray.num_workers`` rollout workers, each a Ray actor (one CPU) with its own batch of
``env.num_envs`` worlds behind the same delay shell as the local runtime
(`vla_core.runtime.delayed_env.DelayedChunkEnv`: the latency protocol of ``vla-rl eval`` and of the
robot), and its own copy of the policy and its RL actor. The learner, the ``vla-rl finetune`` process, owns the weights, the
optimizer and the critic. On one machine the run starts a local Ray instance and stops it at the
end; ``--ray.address=host:port`` joins a running cluster instead (the same code).

Versions: the learner's policy version counts its updates (a resumed run starts at its iteration).
A worker rolls out with the newest weights the learner has published when the rollout starts, and
every decision of that rollout carries that version (`Rollout.version`) and the per-denoising-step
log-probabilities of its decisions under those weights (`Rollout.behaviour_log_prob`).

Staleness, bounded and corrected. Bounded: the update that makes version v + 1 takes rollouts of
version >= v - ``max_staleness`` and drops older ones, counted (``dropped_rollouts`` in the history).
Corrected (decoupled PPO, Hilton et al. 2021; `vla_rl.rl.update.Anchors`): the update's ratios are
taken against the learner's weights at the start of the update (the proximal policy), so PPO's clip
bounds how far the update moves the policy, however old the data; a stale sample is weighted by
pi_prox / pi_behaviour per factor, truncated at ``rho_bar`` (1: a stale sample never weighs more
than a fresh one, whatever the sign of its advantage), and PPO's GAE traces its episode with the
same truncated weights of whole decisions (V-trace). ``staleness_kl`` and ``staleness_truncated``
in the history measure the staleness apart from the update's own ``approx_kl`` and ``clip_fraction``.

Flow: with ``max_staleness`` >= 1 a worker starts its next rollout the moment it hands one in, so it
collects while the learner updates; an update takes the first ``num_workers`` usable rollouts to
arrive. With ``max_staleness`` = 0 that overlap would make every rollout stale, so the workers wait
for each update and collect on-policy, in parallel.

Not reproducible bit for bit: which rollout arrives first depends on timing. A resumed run goes on
from its checkpoint with fresh workers.
"""

from __future__ import annotations

import copy
import os
import socket
from dataclasses import dataclass, replace
from typing import Any

import torch

from vla_rl.rl.rollout import Rollout, RolloutStats


@dataclass
class RayConfig:
    """Where the rollout workers run and how stale their data may be."""

    address: str = ""  # host:port of a running Ray cluster; empty = a local instance started for the run
    num_workers: int = 2  # rollout actors, each with env.num_envs worlds and one CPU
    max_staleness: int = 1  # an update takes rollouts at most this many versions old (0 = synchronous)
    # The largest importance weight pi_now / pi_behaviour a stale sample gets in the update (V-trace's
    # rho-bar; decoupled PPO, `vla_rl.rl.update.Anchors`).
    rho_bar: float = 1.0

    def validate(self) -> None:
        if self.num_workers < 1 or self.max_staleness < 0:
            raise ValueError(
                f"--ray.num_workers must be >= 1 and --ray.max_staleness >= 0, got {self.num_workers}, {self.max_staleness}"
            )
        if not self.rho_bar > 0:
            raise ValueError(f"--ray.rho_bar must be > 0 (the largest weight of a stale sample), got {self.rho_bar}")


def usable(learner_version: int, rollout_version: int, max_staleness: int) -> bool:
    """Whether a rollout sampled at ``rollout_version`` may enter the update of ``learner_version``."""
    return learner_version - rollout_version <= max_staleness


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Raise ValueError naming the fix unless a TCP connection to ``address`` (host:port) opens."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or address, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot reach the Ray cluster at --ray.address={address} ({err}); start it there with "
            f"`ray start --head --port={port or 6379}`, or drop --ray.address to run on a local instance"
        ) from err


class RolloutWorker:
    """One rollout worker (made a Ray actor by `AsyncRollouts`): an env batch, its delay shell, a policy copy."""

    def __init__(self, policy, env_config, chunking, delay_config, delay_stream: int, gamma: float,
                 noise, version: int, num_threads: int = 1):  # fmt: skip
        from sim.factory import make_env
        from vla_core.runtime import DelayModel, LatencySpec
        from vla_core.runtime.delayed_env import DelayedChunkEnv

        torch.set_num_threads(num_threads)
        self.policy = policy.eval()
        self.env = make_env(env_config)
        delay = DelayModel(delay_config, control_dt=self.env.control_dt, stream=delay_stream)
        spec = LatencySpec.of(policy)
        self.shell = DelayedChunkEnv(self.env, spec, chunking, delay, use="finetune", gamma=gamma)
        self.actor = policy.rl_actor(noise, augmentation_width=self.shell.protocol.width)
        self.version = version

    def collect(self, version: int, weights: dict | None, seed, episodes_per_world: int, sampling_seed: int):
        """Roll out with the weights of ``version`` (``weights`` when they are new to this worker)."""
        from vla_rl.rl.rollout import collect
        from vla_rl.rl.update import batched_score

        if weights is not None:
            self.policy.load_state_dict(weights)
        self.version = version
        torch.manual_seed(sampling_seed)
        rollout, stats = collect(self.actor, self.shell, episodes_per_world=episodes_per_world, seed=seed)
        rollout.version = torch.full((len(rollout),), version, dtype=torch.long)
        rollout.behaviour_log_prob = batched_score(self.actor, rollout.obs, rollout.decision, 64)
        return rollout, stats

    def close(self) -> None:
        self.env.close()


class AsyncRollouts:
    """The learner's side: starts the workers, hands out seeds and weights, collects usable rollouts.

    seeds(launch) -> (reset seed, episodes_per_world, sampling seed) of the launch-th rollout since
    the run started or resumed (every launch its own seeds, as the local runtime's iterations have).
    """

    def __init__(self, policy, cfg, gamma: float, version: int, seeds):
        import ray

        ray_cfg = cfg.ray
        self.ray, self.max_staleness, self.seeds = ray, ray_cfg.max_staleness, seeds
        self.num_envs = cfg.env.num_envs
        self.started_ray = False
        if not ray.is_initialized():
            if ray_cfg.address:
                check_reachable(ray_cfg.address)
                ray.init(address=ray_cfg.address, log_to_driver=False)
            else:
                cpus = max(os.cpu_count() or 1, ray_cfg.num_workers)
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            self.started_ray = True
        worker = ray.remote(num_cpus=1)(RolloutWorker)
        copy_on_cpu = ray.put(copy.deepcopy(policy).to("cpu"))
        # The cores are shared among the workers: torch and render threads split them.
        threads = max(1, (cfg.num_threads or os.cpu_count() or 1) // ray_cfg.num_workers)
        env_cfg = replace(cfg.env, render_threads=cfg.env.render_threads or threads)
        # Each worker its own delay stream, a new one on resume (version = the iteration resumed at).
        streams = [1 + i + 1000 * version for i in range(ray_cfg.num_workers)]
        self.workers = [
            worker.remote(copy_on_cpu, env_cfg, cfg.chunking, cfg.delay, stream, gamma, cfg.noise, version, threads)
            for stream in streams
        ]
        self.version = version
        self.worker_version = [version] * len(self.workers)  # the weights each worker holds
        self.weights = None  # ObjectRef of the newest published weights
        self.launches = 0
        self.in_flight: dict[Any, int] = {}  # ObjectRef of a rollout -> its worker
        self.idle: list[int] = []
        for i in range(len(self.workers)):
            self._launch(i)

    def _launch(self, i: int) -> None:
        weights = self.weights if self.worker_version[i] != self.version else None
        seed, episodes, sampling_seed = self.seeds(self.launches)
        ref = self.workers[i].collect.remote(self.version, weights, seed, episodes, sampling_seed)
        self.worker_version[i] = self.version
        self.launches += 1
        self.in_flight[ref] = i

    def next_batch(self) -> tuple[Rollout, list[RolloutStats], dict[str, Any]]:
        """The next update's rollouts: one per worker, the first usable ones to arrive. Returns them
        concatenated (each worker's worlds numbered after the previous one's), the stats of every
        rollout handed in (dropped ones too: their env steps were spent) and the bookkeeping."""
        parts: list[Rollout] = []
        stats: list[RolloutStats] = []
        dropped = 0
        while len(parts) < len(self.workers):
            (ref,), _ = self.ray.wait(list(self.in_flight), num_returns=1)
            i = self.in_flight.pop(ref)
            rollout, st = self.ray.get(ref)
            stats.append(st)
            if usable(self.version, int(rollout.version[0]), self.max_staleness):
                parts.append(rollout)
            else:
                dropped += 1
            if self.max_staleness >= 1:
                self._launch(i)  # collects while the learner updates
            else:
                self.idle.append(i)  # on-policy: waits for the update
        batch = Rollout.cat(parts, self.num_envs)
        versions = batch.version
        info = {"policy_version": self.version, "dropped_rollouts": dropped,
                "data_version_min": int(versions.min()), "data_version_max": int(versions.max())}  # fmt: skip
        return batch, stats, info

    def publish(self, policy) -> None:
        """The learner's new weights: version + 1, taken by every rollout launched from now on."""
        self.version += 1
        self.weights = self.ray.put({k: v.detach().to("cpu") for k, v in policy.state_dict().items()})
        for i in self.idle:
            self._launch(i)
        self.idle.clear()

    def close(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        self.workers.clear()
        if self.started_ray:
            self.ray.shutdown()
