"""What a fine-tuning run reports: one history record per iteration (also logged to the trackers), the
summary of ``finetune_summary.json`` and the success curve of ``success.png``."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch

from vla_rl.rl.sources import RolloutBatch


def _round(v):
    return round(v, 6) if isinstance(v, float) else v


def iteration_record(state: dict, batch: RolloutBatch, update_seconds: float, iteration_seconds: float,
                     update_stats: dict, tasks: list[str], curriculum, checksums: list[float] | None = None) -> dict:  # fmt: skip
    """The history entry of the iteration just done (``state`` already counts it): its rollouts, timings and
    the learner's statistics; each process's decisions and weights' checksums (``checksums``) in a
    data-parallel run; per task and the curriculum's priorities in a multi-task run.

    Throughput: ``env_steps_per_s`` is the control steps the recorded episodes executed over the
    iteration's wall-clock (rollout, or the wait for one under Ray, plus the update; evaluations and
    checkpoints excluded), comparable between a local run and a Ray run. ``rollout_env_steps_per_s``
    is the simulator's rate while rolling out: every simulated step, those of worlds holding while
    the others finish included, over the rollout's seconds (under Ray, the learner's wait)."""
    stats = batch.stats
    executed = sum(st.env_steps for st in stats)
    record = {
        "iteration": state["iteration"], "env_steps": state["env_steps"], "rollout_success": batch.success,
        "episodes": sum(st.episodes for st in stats), "diverged_episodes": sum(st.diverged for st in stats),
        "rollout_seconds": round(batch.seconds, 3), "update_seconds": round(update_seconds, 3),
        "rollout_env_steps_per_s": round(sum(st.simulated_steps for st in stats) / max(batch.seconds, 1e-9), 1),
        "iteration_seconds": round(iteration_seconds, 3), "executed_env_steps": executed,
        "env_steps_per_s": round(executed / max(iteration_seconds, 1e-9), 1),
        "skipped_updates": state["skipped_actor_updates"] + state["skipped_critic_updates"],
        **{k: _round(v) for k, v in update_stats.items()},
    }  # fmt: skip
    if checksums is not None:
        record["decisions_per_process"] = [n for n, _ in batch.per_process]
        record["weights_checksum_per_process"] = checksums
    if len(tasks) > 1:
        record["rollout_success_by_task"] = {
            tasks[t]: sum(ps[i].successes for _, ps in batch.per_process) / max(1, sum(ps[i].episodes for _, ps in batch.per_process))
            for i, t in enumerate(batch.chosen)
        }  # fmt: skip
        record["curriculum_priorities"] = dict(
            zip(tasks, [round(p, 4) for p in curriculum.priorities().tolist()], strict=True)
        )
    return record


def peak_memory(device: torch.device | str) -> dict:
    """The most memory this process held: on a CUDA device what torch allocated there, else the process's
    peak resident set (which counts everything the process mapped, not tensors only)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                "measure": f"torch.cuda.max_memory_allocated({device})"}  # fmt: skip
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    return {"gib": round(kib / 2**20, 3), "measure": "peak resident set size of the process (ru_maxrss)"}


def summary(cfg, tasks: list[str], state: dict, seconds: float, device: torch.device | str = "cpu") -> dict:
    """``finetune_summary.json``: the run's progress, its evaluations, timings, peak memory and history, and
    its config."""
    history = state["history"]
    rollout_s = sum(h["rollout_seconds"] for h in history)
    sim_steps = sum(h["rollout_env_steps_per_s"] * h["rollout_seconds"] for h in history)
    evals = state["evals"]
    shaped = {}
    if cfg.reward.process_model:  # the shaping term's mean per decision over the run (`vla_rl.rl.process_reward`)
        # weighted by each iteration's decisions: a mean over every decision of the run
        pairs = [(h["process_reward_mean"], h["decisions"]) for h in history if "process_reward_mean" in h]
        mean = sum(m * n for m, n in pairs) / max(1, sum(n for _, n in pairs))
        shaped["process_reward"] = {"model": cfg.reward.process_model, "weight": cfg.reward.process_weight,
                                    "mean_per_decision": round(mean, 6)}  # fmt: skip
    # A run begun before RL scored and credited only what runs: the first iteration of today's estimator.
    credit = {k: state[k] for k in ("executed_rows_credit_from",) if k in state}
    return {
        "algo": cfg.algo,
        "tasks": tasks,
        "iterations": state["iteration"],
        "env_steps": state["env_steps"],
        "skipped_updates": {"actor": state["skipped_actor_updates"], "critic": state["skipped_critic_updates"]},
        "initial_success": evals[0]["success_rate"] if evals else None,
        "final_success": evals[-1]["success_rate"] if evals else None,
        "evals": evals,
        "rollout_seconds": round(rollout_s, 1),
        "update_seconds": round(sum(h["update_seconds"] for h in history), 1),
        "rollout_env_steps_per_s": round(sim_steps / max(rollout_s, 1e-9), 1),
        # Executed control steps over the iterations' wall-clock (rollout + update): local and Ray compare.
        "env_steps_per_s": round(
            sum(h.get("executed_env_steps", 0) for h in history)
            / max(sum(h.get("iteration_seconds", 0) for h in history), 1e-9),
            1,
        ),
        "seconds_since_start_or_resume": round(seconds, 1),
        **credit,
        **shaped,
        "peak_memory": peak_memory(device),
        "history": history,
        "config": asdict(cfg),
    }


def plot_success(state: dict, path: Path, algo: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    history = state["history"]
    if history:
        ax.plot([h["env_steps"] for h in history], [h["rollout_success"] for h in history], ".-", alpha=0.6,
                label="rollouts (with exploration noise)")  # fmt: skip
    if state["evals"]:
        ev = state["evals"]
        x = [e["env_steps"] for e in ev]
        y = [e["success_rate"] for e in ev]
        lo = [e["success_rate"] - e["success_ci95"][0] for e in ev]
        hi = [e["success_ci95"][1] - e["success_rate"] for e in ev]
        label = "evaluation, all tasks" if "by_task" in ev[0] else "evaluation"
        ax.errorbar(x, y, yerr=[lo, hi], fmt="o-", capsize=3, label=f"{label} (95% Wilson interval)")
        for task in ev[0].get("by_task", {}):
            ax.plot(x, [e["by_task"][task]["success_rate"] for e in ev], "--", label=f"evaluation, {task}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"vla-rl finetune --algo={algo}")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
