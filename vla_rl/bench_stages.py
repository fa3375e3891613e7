"""The stages the learning benchmarks share (`bench delay`, `bench rl`, `bench latency-rl`): scripted
demonstrations, an imitation policy trained on them, and one held-out evaluation cell. The first two
are skipped or resumed when a killed run left them finished or part-done in the output folder. Each
runs through the stages API (`vla_rl.stages`).

``cfg`` is the benchmark's config; it names task, demos, num_envs, seed, train_steps, batch_size,
horizon, n_action_steps and num_threads.
"""

from __future__ import annotations

from pathlib import Path


def record_demos(cfg, dataset: Path) -> None:
    """``cfg.demos`` scripted episodes of ``cfg.task`` into ``dataset``, unless it holds them already."""
    from vla_rl.stages import EnvConfig, RecordConfig, record

    if not (dataset / "meta" / "info.json").is_file():
        record(RecordConfig(
            env=EnvConfig(task=cfg.task, num_envs=min(cfg.num_envs, cfg.demos)), num_episodes=cfg.demos,
            output_dir=str(dataset), seed=cfg.seed, repo_id=f"local/vla_rl_{cfg.task}", overwrite=True,
        ))  # fmt: skip


def train_imitation(cfg, dataset: Path, output_dir: Path, delay=None) -> None:
    """A policy of ``cfg.policy_type`` (``diffusion`` when the benchmark has no such field) trained on
    ``dataset`` for ``cfg.train_steps`` steps into ``output_dir`` (resumed when it has checkpoints); ``delay``:
    the delay augmentation (training-time RTC), None = none."""
    from vla_rl.stages import AutoregressiveVLAConfig, DatasetConfig, DelayConfig, DiffusionConfig, TrainConfig, train

    policy_config = {"diffusion": DiffusionConfig, "autoregressive_vla": AutoregressiveVLAConfig}[
        getattr(cfg, "policy_type", "diffusion")
    ]
    train(TrainConfig(
        dataset=DatasetConfig(root=str(dataset)), output_dir=str(output_dir), steps=cfg.train_steps,
        batch_size=cfg.batch_size, seed=cfg.seed, log_with="none", save_every=cfg.train_steps,
        num_threads=cfg.num_threads, delay=delay or DelayConfig(), resume=(output_dir / "checkpoints").is_dir(),
        policy=policy_config(horizon=cfg.horizon, n_action_steps=cfg.n_action_steps),
    ))  # fmt: skip


def held_out(
    cfg, checkpoint: Path, episodes: int, seed: int, output_dir: Path, num_envs: int, delay_steps: int = 0,
    merge: str = "latest",
) -> dict:  # fmt: skip
    """`vla-rl eval` of ``checkpoint`` on ``episodes`` held-out episodes of ``cfg.task`` from ``seed``,
    under a fixed delay of ``delay_steps`` and chunk merge ``merge``: its episodes, successes,
    success_rate, success_ci95 (Wilson) and mean_episode_length."""
    from vla_rl.stages import ChunkingConfig, DelayConfig, EnvConfig, EvalConfig, evaluate

    result = evaluate(EvalConfig(
        checkpoint=str(checkpoint), env=EnvConfig(task=cfg.task, num_envs=num_envs), num_episodes=episodes,
        seed=seed, video_episodes=0, chunking=ChunkingConfig(merge=merge),
        delay=DelayConfig(kind="fixed", steps=delay_steps), output_dir=str(output_dir), overwrite=True,
    ))  # fmt: skip
    return {k: result[k] for k in ("episodes", "successes", "success_rate", "success_ci95", "mean_episode_length")}
