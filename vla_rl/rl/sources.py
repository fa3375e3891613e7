"""Where a fine-tuning run's rollouts come from: this process's own batch of worlds (``LocalRollouts``,
reproducible bit for bit, data parallel under ``accelerate launch``) or asynchronous Ray workers
(``RayRollouts``, `vla_rl.rl.ray_runtime`). Both hand the learner one `RolloutBatch` per iteration.

Seeds: rollout r of a run resets with seeds from ``seed + TRAINING_SEED_OFFSET`` upward, so they never
meet an evaluation seed (``eval_seed``, 1000 by default, one per evaluation round as in ``vla-rl eval``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vla_core.files import process_file
from vla_core.rl import RLPolicy
from vla_rl.rl import grpo
from vla_rl.rl.curriculum import TaskCurriculum
from vla_rl.rl.rollout import Rollout, RolloutStats, collect
from vla_rl.rl.update import Processes

TRAINING_SEED_OFFSET = 1_000_000  # rollout seeds start here, far from every evaluation seed
REFILL_SEED_OFFSET = 100_000_000  # GRPO's refills reset from here up (DAPO), apart from the rollouts' own


@dataclass
class RolloutBatch:
    """One iteration's rollouts: this process's, which its update takes (`vla_rl.rl.update.Processes`), the
    stats of every rollout collected (each process's, each task's), the seconds the learner spent waiting
    for them, the tasks rolled out (indices into the run's task list), every process's (decisions, stats
    per chosen task), and the source's own bookkeeping."""

    rollout: Rollout
    stats: list[RolloutStats]
    seconds: float
    chosen: list[int]
    per_process: list[tuple[int, list[RolloutStats]]]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def success(self) -> float:
        return sum(st.successes for st in self.stats) / max(1, sum(st.episodes for st in self.stats))


def reset_seeds(cfg, run: int) -> tuple[int | list[int], int]:
    """(reset seed, episodes per world) of the ``run``-th rollout of a run: PPO's worlds each run
    ``ppo.episodes_per_world`` episodes from one batch seed; GRPO's groups share a seed, one episode each."""
    seed_base = cfg.seed + TRAINING_SEED_OFFSET + run * cfg.env.num_envs
    if cfg.algo == "grpo":
        return grpo.group_seeds(cfg.env.num_envs, cfg.grpo.group_size, seed_base), 1
    return seed_base, cfg.ppo.episodes_per_world


def refill_seeds(cfg, run: int, refill: int) -> list[int]:
    """The group seeds of GRPO's ``refill``-th (1, 2, ...) extra rollout for the ``run``-th rollout."""
    seed_base = cfg.seed + REFILL_SEED_OFFSET + (run * cfg.grpo.max_refills + refill - 1) * cfg.env.num_envs
    return grpo.group_seeds(cfg.env.num_envs, cfg.grpo.group_size, seed_base)


def summed(stats: list[RolloutStats]) -> RolloutStats:
    """The stats of several rollouts of one task, as one."""
    return RolloutStats(*(sum(getattr(s, f) for s in stats) for f in
                          ("episodes", "successes", "diverged", "env_steps", "simulated_steps", "seconds")))  # fmt: skip


class LocalRollouts:
    """This process's worlds: one delay shell per task (``shells``), rolled out between updates. Under
    ``accelerate launch`` every process rolls out its own worlds (its own seeds, delays and sampling
    noise) and updates on them; only their statistics are gathered."""

    def __init__(self, actor: RLPolicy, shells: list, cfg, gamma: float, curriculum: TaskCurriculum,
                 processes: Processes, collector=None):  # fmt: skip
        self.actor, self.shells, self.cfg, self.curriculum, self.processes = actor, shells, cfg, curriculum, processes
        self.collector = collector  # per control step of a low-latency part; None: per chunk decision
        self.gamma = gamma  # the credit windows' discount per control step
        self.privileged = cfg.algo == "ppo" and cfg.ppo.privileged_critic  # what an asymmetric critic reads

    def _collect(self, *args, **kwargs) -> tuple[Rollout, RolloutStats]:
        # `collect` is looked up when called, so one definition serves the module and whoever replaces it.
        return (self.collector or collect)(*args, **kwargs)

    def next(self, iteration: int) -> RolloutBatch:
        cfg, processes, tasks = self.cfg, self.processes, len(self.shells)
        chosen = self.curriculum.choose(cfg.curriculum_tasks or tasks)
        parts, stats, refills = [], [], 0
        for t in chosen:
            # Distinct seeds for every (iteration, process, task).
            run = (iteration * processes.count + processes.index) * tasks + t
            seed, episodes = reset_seeds(cfg, run)
            part, part_stats = self._collect(self.actor, self.shells[t], episodes_per_world=episodes, seed=seed,
                                             task=t, gamma=self.gamma, privileged=self.privileged)  # fmt: skip
            if cfg.algo == "grpo" and cfg.grpo.dynamic_sampling and cfg.grpo.max_refills:
                part, part_stats, extra = self._refill(part, part_stats, run, t)
                refills += extra
            parts.append(part)
            stats.append(part_stats)
        local = Rollout.cat(parts, cfg.env.num_envs)
        seconds = sum(st.seconds for st in stats)
        # Each process updates on its own rollouts; the statistics are every process's.
        per_process = processes.gather((len(local), stats))
        for i, t in enumerate(chosen):  # the same curriculum update in every process: every process's success
            task_stats = [process_stats[i] for _, process_stats in per_process]
            episodes_t = sum(st.episodes for st in task_stats)
            self.curriculum.update(t, sum(st.successes for st in task_stats) / max(1, episodes_t))
        info = {"refills": int(sum(processes.gather(refills)))} if cfg.algo == "grpo" else {}
        return RolloutBatch(local, [st for _, ps in per_process for st in ps], seconds, chosen, per_process, info)

    def _refill(self, part: Rollout, stats: RolloutStats, run: int, task: int) -> tuple[Rollout, RolloutStats, int]:
        """DAPO's dynamic sampling: roll task ``task`` out again, from new initial states, until the rollouts
        hold ``num_envs / G`` informative groups (`grpo.informative_groups`) or ``grpo.max_refills`` are
        spent; keep that many (the first found), numbered as one batch. Every env step counts in the stats.
        Returns (the rollout, its stats, the refills taken)."""
        cfg, g = self.cfg, self.cfg.grpo.group_size
        target, parts, all_stats = cfg.env.num_envs // g, [part], [stats]
        while len(all_stats) <= cfg.grpo.max_refills:
            found = grpo.informative_groups(Rollout.cat(parts, cfg.env.num_envs), g)
            if int(found.sum()) >= target:
                break
            seeds = refill_seeds(cfg, run, len(all_stats))
            extra, extra_stats = self._collect(self.actor, self.shells[task], episodes_per_world=1, seed=seeds,
                                               task=task, gamma=self.gamma, privileged=self.privileged)  # fmt: skip
            parts.append(extra)
            all_stats.append(extra_stats)
        batch = Rollout.cat(parts, cfg.env.num_envs)
        found = grpo.informative_groups(batch, g).nonzero().flatten()[:target]
        if len(parts) == 1 and len(found) == target:
            return part, stats, 0  # nothing to refill: the rollout as it came
        if len(found) == 0:  # every group uniform even after the refills: GRPO drops them all anyway
            return part, summed(all_stats), len(parts) - 1
        return grpo.keep_groups(batch, found, g), summed(all_stats), len(parts) - 1

    def updated(self, actor: RLPolicy) -> None:
        """The learner updated the weights: the next rollout samples with them (they are shared here)."""

    def close(self) -> None:
        """The shells' envs are closed by whoever opened them."""


class RayRollouts:
    """Ray workers that keep collecting while the learner updates (`vla_rl.rl.ray_runtime.AsyncRollouts`).
    ``first_iteration``: where the run starts or resumes; launch k's reset seeds come from
    TRAINING_SEED_OFFSET + ((i * 10_000 + k) * P + p) * num_envs, its sampling noise from the run's seed and
    that index, for learner process p of P (under ``accelerate launch`` each process has workers of its own
    and updates on their rollouts, `vla_rl.rl.update.Processes`)."""

    def __init__(self, actor: RLPolicy, cfg, gamma: float, first_iteration: int, curriculum: TaskCurriculum,
                 processes: Processes):  # fmt: skip
        from vla_rl.rl.ray_runtime import AsyncRollouts

        def seeds(launch: int):
            index = (first_iteration * 10_000 + launch) * processes.count + processes.index
            seed, episodes = reset_seeds(cfg, index)
            return seed, episodes, cfg.seed * 1_000_003 + index

        self.curriculum, self.first_iteration, self.processes = curriculum, first_iteration, processes
        self.timeline = Path(cfg.output_dir) / process_file("ray_timeline.json", processes.index)
        self.workers = AsyncRollouts(actor.policy, cfg, gamma, version=first_iteration, seeds=seeds,
                                     learner=(processes.index, processes.count))  # fmt: skip

    def next(self, iteration: int) -> RolloutBatch:
        start = time.perf_counter()
        rollout, stats, info = self.workers.next_batch()
        seconds = time.perf_counter() - start  # the learner's wait: collection overlaps updates
        per_process = self.processes.gather((len(rollout), stats))
        every = [st for _, ps in per_process for st in ps]
        self.curriculum.update(0, sum(st.successes for st in every) / max(1, sum(st.episodes for st in every)))
        if self.processes.count > 1:  # over every process's workers
            every_info = self.processes.gather(info)
            info = {**info, "data_version_min": min(i["data_version_min"] for i in every_info),
                    "data_version_max": max(i["data_version_max"] for i in every_info),
                    **{k: sum(i[k] for i in every_info) for k in ("dropped_rollouts", "worker_restarts")}}  # fmt: skip
        return RolloutBatch(rollout, every, seconds, [0], per_process, info)

    def updated(self, actor: RLPolicy) -> None:
        """Publish the learner's new weights: version + 1, taken by every rollout launched from now on."""
        self.workers.publish(actor.policy)

    def close(self) -> None:
        """Stop the workers, after writing what they did (`ray_runtime.AsyncRollouts.write_timeline`)."""
        self.workers.write_timeline(self.timeline, self.first_iteration)
        self.workers.close()
