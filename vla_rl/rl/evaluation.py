"""A fine-tuning run's periodic evaluations: `vla-rl eval`'s own stage on the policy as it is in memory,
on every task, from the run's ``eval_seed``, under the run's chunking and delay. The training streams
go on untouched: evaluation seeds torch itself, and the state it found is given back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from sim.libero_protocol import INITIAL_STATES_PER_TASK, is_libero_task
from vla_rl import stages
from vla_rl.statistics import wilson_interval


class PeriodicEvaluation:
    """``__call__(policy, checkpoint, state)`` evaluates ``policy`` (saved at ``checkpoint``) and appends the
    result to ``state["evals"]``; ``env_cfgs``: one env config per task of ``tasks``."""

    def __init__(self, cfg, tasks: list[str], env_cfgs: list, out: Path, device, log=None):
        self.cfg, self.tasks, self.env_cfgs, self.out, self.device, self.log = cfg, tasks, env_cfgs, out, device, log

    def __call__(self, policy, checkpoint: Path, state: dict) -> None:
        cfg = self.cfg
        rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        by_task = {}
        for task, env_cfg in zip(self.tasks, self.env_cfgs, strict=True):
            folder = self.out / "eval" / f"iter-{state['iteration']:04d}"
            episodes = {"num_episodes": cfg.eval_episodes}
            eval_env = replace(env_cfg, num_envs=min(env_cfg.num_envs * 2, cfg.eval_episodes))
            if is_libero_task(task):  # LIBERO's protocol fixes the episodes: as many per task as make eval_episodes
                from sim.libero_env import resolve_libero_task

                tasks_here = len(resolve_libero_task(task).task_ids)
                episodes = {"num_episodes": 0, "episodes_per_task": max(1, min(INITIAL_STATES_PER_TASK,
                                                                              -(-cfg.eval_episodes // tasks_here)))}  # fmt: skip
                # ... and the step limit and settle steps, whatever the rollouts use
                eval_env = replace(eval_env, max_episode_steps=0, settle_steps=-1)
            result = stages.evaluate(
                stages.EvalConfig(
                    checkpoint=str(checkpoint), env=eval_env,
                    **episodes, seed=cfg.eval_seed, chunking=cfg.chunking, delay=cfg.delay,
                    video_episodes=0, device=str(self.device), output_dir=str(folder / task if len(self.tasks) > 1 else folder),
                    overwrite=True,  # a resumed run evaluates again an iteration whose checkpoint was never written
                ),
                policy=policy,
            )  # fmt: skip
            by_task[task] = {k: result[k] for k in ("episodes", "successes", "success_rate", "success_ci95")}
        torch.set_rng_state(rng)
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)
        successes = sum(r["successes"] for r in by_task.values())
        episodes = sum(r["episodes"] for r in by_task.values())
        entry = {"iteration": state["iteration"], "env_steps": state["env_steps"],
                 "success_rate": successes / episodes, "success_ci95": list(wilson_interval(successes, episodes)),
                 "episodes": episodes}  # fmt: skip
        if len(self.tasks) > 1:
            entry["by_task"] = by_task
        state["evals"].append(entry)
        if self.log is not None:
            self.log({"eval/success_rate": entry["success_rate"]}, step=state["iteration"])
