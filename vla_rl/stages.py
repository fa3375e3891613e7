"""The stages of the pipeline as functions, for compositions (``vla-rl quickstart``, the benchmarks):
each takes its command's config and returns the summary that command returns.

    from vla_rl import stages

    data = stages.record(stages.RecordConfig(num_episodes=50, output_dir="out/dataset"))
    run = stages.train(stages.TrainConfig(dataset=stages.DatasetConfig(root=data["dataset"]), output_dir="out/train"))
    result = stages.evaluate(stages.EvalConfig(checkpoint="out/train", output_dir="out/eval"))

A stage is the command's own entry point, called as it is: same seeds, same draws, same files
written, so a composition gives the numbers the commands give one by one. Importing this module is
light: each stage imports its command when called, and the config classes below are imported on
first use (``from vla_rl.stages import TrainConfig`` imports ``vla_rl.train`` then).

The keys a composition may rely on (every command also returns others, and writes its summary to
its ``output_dir``):

- ``record``: ``dataset`` (the directory written), ``episodes``, ``frames``, ``tasks``,
  ``expert_success_rate``, ``mean_episode_length``, ``seconds``, ``config``.
- ``train``: ``checkpoint`` (the final one), ``steps`` (reached; fewer than ``cfg.steps`` when
  ``stop_at_val_loss`` was reached), ``final_loss`` (None if no step was logged), ``loss_curve``
  ([step, mean loss]), ``val_curve`` ([step, training seconds, validation loss]), ``train_seconds``,
  ``seconds_this_run``, ``dataset_frames``, ``dataset_episodes``. ``output_dir/train_config.json``
  holds ``config_dict(cfg)``.
- ``evaluate``: ``checkpoint``, ``task``, ``episodes``, ``successes``, ``success_rate``,
  ``success_ci95`` ([low, high], Wilson), ``mean_episode_length``, ``mean_success_length``, ``seed``,
  ``per_episode``, ``seconds``.
- ``train_prm``: ``held_out`` (the held-out episodes' figures, or None), ``train``, ``seconds``, ``config``.
- ``finetune``: ``algo``, ``tasks``, ``iterations``, ``env_steps``, ``skipped_updates``,
  ``initial_success`` / ``final_success`` (None without periodic evaluations), ``evals`` (the
  periodic evaluations), ``history`` (one entry per iteration, with ``rollout_success``),
  ``rollout_env_steps_per_s``; ``output_dir/initial_checkpoint.txt`` names the policy it started from.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.autoregressive_vla import AutoregressiveVLAConfig
    from policies.diffusion import DiffusionConfig
    from policies.diffusion_vla import DiffusionVLAConfig
    from policies.diffusion_vla.condition_encoder import check_siglip_folder
    from sim.config import EnvConfig
    from vla_core.runtime import ChunkingConfig, DelayConfig
    from vla_rl.checkpoint import load_policy, resolve_policy_dir, write_policy
    from vla_rl.config_json import config_dict
    from vla_rl.dsrl import DSRLConfig, load_noise_policy
    from vla_rl.eval import EvalConfig, SteerEvalConfig
    from vla_rl.eval_record import EpisodePlan
    from vla_rl.finetune import FinetuneConfig
    from vla_rl.latency_warmup import LatencyWarmupConfig
    from vla_rl.processes import last_json, start_command, stop_command
    from vla_rl.record import RecordConfig
    from vla_rl.rl.grpo import GRPOConfig
    from vla_rl.rl.ppo import PPOConfig
    from vla_rl.rl.process_reward import RewardConfig
    from vla_rl.rl.ray_runtime import WORKER_NAME_PREFIX, RayConfig
    from vla_rl.rl.sac import SACConfig
    from vla_rl.statistics import mcnemar_exact, pooled_rate, rate_ratio_interval, wilson_interval
    from vla_rl.steer import SteerConfig
    from vla_rl.steering import SteeredPolicy, Steering
    from vla_rl.train import DatasetConfig, TrainConfig, build_policy, reached_target
    from vla_rl.train_prm import PRMDatasetConfig, TrainPRMConfig


def record(cfg: RecordConfig) -> dict[str, Any]:
    """``vla-rl record``: scripted expert episodes written as a LeRobotDataset to ``cfg.output_dir``."""
    from vla_rl.record import record as run

    return run(cfg)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """``vla-rl train``: imitation learning on ``cfg.dataset.root``, checkpoints in ``cfg.output_dir``."""
    from vla_rl.train import train as run

    return run(cfg)


def evaluate(cfg: EvalConfig, policy=None) -> dict[str, Any]:
    """``vla-rl eval`` of ``cfg.checkpoint``; or, given ``policy`` (in eval mode), of that policy as it is
    in memory, ``cfg.checkpoint`` naming where it is saved."""
    from vla_rl.eval import evaluate as run

    return run(cfg, policy)


def train_prm(cfg: TrainPRMConfig) -> dict[str, Any]:
    """``vla-rl train-prm``: a process reward model fitted on ``cfg.dataset.root`` into ``cfg.output_dir``."""
    from vla_rl.train_prm import train_prm as run

    return run(cfg)


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """``vla-rl finetune``: RL fine-tuning of ``cfg.checkpoint`` in simulation, into ``cfg.output_dir``."""
    from vla_rl.finetune import finetune as run

    return run(cfg)


def steer(cfg: SteerConfig) -> dict[str, Any]:
    """``vla-rl steer``: latent steering of ``cfg.checkpoint``, into ``cfg.output_dir`` (its steering/ folder)."""
    from vla_rl.steer import run_steer

    return run_steer(cfg)


def dsrl(cfg: DSRLConfig) -> dict[str, Any]:
    """``vla-rl dsrl``: noise-space steering of ``cfg.checkpoint``, into ``cfg.output_dir`` (its dsrl/ folder)."""
    from vla_rl.dsrl import run_dsrl

    return run_dsrl(cfg)


# What a composition configures the stages with, by name -> the module defining it (imported on first use).
_EXPORTS = {
    "RecordConfig": "vla_rl.record",
    "TrainConfig": "vla_rl.train",
    "DatasetConfig": "vla_rl.train",
    "EvalConfig": "vla_rl.eval",
    "FinetuneConfig": "vla_rl.finetune",
    "PPOConfig": "vla_rl.rl.ppo",
    "GRPOConfig": "vla_rl.rl.grpo",
    "RayConfig": "vla_rl.rl.ray_runtime",
    # The name every Ray rollout worker's actor name starts with: a composition that watches or kills
    # workers (`vla-rl bench ray`) finds them by it.
    "WORKER_NAME_PREFIX": "vla_rl.rl.ray_runtime",
    "LatencyWarmupConfig": "vla_rl.latency_warmup",
    "TrainPRMConfig": "vla_rl.train_prm",
    "PRMDatasetConfig": "vla_rl.train_prm",
    "RewardConfig": "vla_rl.rl.process_reward",
    "SteerConfig": "vla_rl.steer",
    "SteerEvalConfig": "vla_rl.eval",
    "DSRLConfig": "vla_rl.dsrl",
    "SACConfig": "vla_rl.rl.sac",
    # The steered policies for a composition that evaluates them itself (`bench steering`).
    "SteeredPolicy": "vla_rl.steering",
    "Steering": "vla_rl.steering",
    "load_noise_policy": "vla_rl.dsrl",
    "EnvConfig": "sim.config",
    "DelayConfig": "vla_core.runtime",
    "ChunkingConfig": "vla_core.runtime",
    "DiffusionConfig": "policies.diffusion",
    "DiffusionVLAConfig": "policies.diffusion_vla",
    "AutoregressiveVLAConfig": "policies.autoregressive_vla",
    # The one-line check of a pretrained SigLIP folder, for a composition that reads it before training.
    "check_siglip_folder": "policies.diffusion_vla.condition_encoder",
    # The JSON form of a TrainConfig that `train` saves as train_config.json: a composition reusing a
    # finished run compares it with the config it would run.
    "config_dict": "vla_rl.config_json",
    # The policy `train` builds for a config and an opened dataset (seed torch first, as train does),
    # for a composition that times training steps outside `train`.
    "build_policy": "vla_rl.train",
    # Where a validation curve first reaches a loss for some validations in a row (`--stop_consecutive`).
    "reached_target": "vla_rl.train",
    # The 95% interval every evaluation reports (success_ci95), for a composition that pools cells.
    "wilson_interval": "vla_rl.statistics",
    # Success counts pooled over runs (training seeds) with their interval.
    "pooled_rate": "vla_rl.statistics",
    # The interval of a ratio of two success rates (a comparison's success_ratio).
    "rate_ratio_interval": "vla_rl.statistics",
    # McNemar's exact test of paired outcomes, for a composition that pairs episodes (`bench robot-parity`).
    "mcnemar_exact": "vla_rl.statistics",
    # A checkpoint's policy directory, loading a policy and writing one as a checkpoint, for a composition
    # that makes or inspects a checkpoint itself (`bench robot-parity --quick`'s latency-aware toy).
    "resolve_policy_dir": "vla_rl.checkpoint",
    "load_policy": "vla_rl.checkpoint",
    "write_policy": "vla_rl.checkpoint",
    # `vla-rl` commands as child processes in a ROS domain of their own (serve and sim-robot, for a composition
    # that runs a served robot).
    "start_command": "vla_rl.processes",
    "stop_command": "vla_rl.processes",
    "last_json": "vla_rl.processes",
    # The initial states `evaluate` runs (round r: batch seed seed + r), for a composition that runs its own agent on
    # the same episodes (`bench switch`'s expert bound).
    "EpisodePlan": "vla_rl.eval_record",
}

__all__ = [
    "WORKER_NAME_PREFIX",
    "AutoregressiveVLAConfig",
    "ChunkingConfig",
    "DSRLConfig",
    "DatasetConfig",
    "DelayConfig",
    "DiffusionConfig",
    "DiffusionVLAConfig",
    "EnvConfig",
    "EpisodePlan",
    "EvalConfig",
    "FinetuneConfig",
    "GRPOConfig",
    "LatencyWarmupConfig",
    "PPOConfig",
    "PRMDatasetConfig",
    "RayConfig",
    "RecordConfig",
    "RewardConfig",
    "SACConfig",
    "SteerConfig",
    "SteerEvalConfig",
    "SteeredPolicy",
    "Steering",
    "TrainConfig",
    "TrainPRMConfig",
    "build_policy",
    "check_siglip_folder",
    "config_dict",
    "dsrl",
    "evaluate",
    "finetune",
    "last_json",
    "load_noise_policy",
    "load_policy",
    "mcnemar_exact",
    "pooled_rate",
    "rate_ratio_interval",
    "reached_target",
    "record",
    "resolve_policy_dir",
    "start_command",
    "steer",
    "stop_command",
    "train",
    "train_prm",
    "wilson_interval",
    "write_policy",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
