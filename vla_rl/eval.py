"""`vla-rl eval`: batched closed-loop rollouts of a checkpoint.

Chunks from the policy are executed through `vla_rl.runtime.ActionChunkExecutor`, the same
object the robot bridge drives. Each world runs one episode per round; round r resets with
seed ``seed + r``, so the same seed always evaluates the same initial states.

Writes ``eval.json`` (per-episode results, success rate with a 95% Wilson interval),
``summary.md`` and ``rollouts.mp4`` (a grid of the first few episodes).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from sim.config import EnvConfig
from vla_rl.checkpoint import load_policy
from vla_rl.runtime import ActionChunkExecutor, MergeMode


@dataclass
class EvalConfig:
    """Evaluate a policy checkpoint in closed loop in the batched simulator."""

    checkpoint: str = "outputs/quickstart/train"  # checkpoint dir, or a training output dir (uses its last)
    env: EnvConfig = field(default_factory=lambda: EnvConfig(num_envs=50))  # simulated task; num_envs worlds per round (default here: 50)
    num_episodes: int = 50  # episodes in total
    seed: int = 1000  # seed of the evaluation initial states (kept apart from the recording seed)
    n_action_steps: int = 0  # steps executed per chunk before replanning; 0 = the policy's own setting
    merge: str = "latest"  # how overlapping chunks merge: latest or ensemble (temporal ensembling)
    ensemble_coeff: float = 0.01  # temporal-ensembling weight decay, w_i = exp(-coeff * i)
    video_episodes: int = 4  # episodes shown in rollouts.mp4 (0 = no video)
    video_size: int = 192  # pixels per episode tile in the video
    output_dir: str = "outputs/quickstart/eval"  # eval.json, summary.md and rollouts.mp4 go here
    device: str = "cpu"  # torch device of the policy (cpu, cuda, cuda:1, ...)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate(cfg: EvalConfig) -> dict:
    from sim.mujoco_env import MujocoBatchedEnv

    if cfg.merge not in ("latest", "ensemble"):
        raise ValueError(f"merge must be 'latest' or 'ensemble', got {cfg.merge!r}")
    policy, ckpt = load_policy(cfg.checkpoint, device=cfg.device)
    torch.manual_seed(cfg.seed)  # diffusion sampling noise: the same seed gives the same rollouts
    pcfg = policy.config
    n_action_steps = cfg.n_action_steps or pcfg.n_action_steps
    if cfg.env.image_size != pcfg.image_size or list(cfg.env.cameras) != list(pcfg.cameras):
        raise ValueError(
            f"the policy expects cameras {pcfg.cameras} at {pcfg.image_size}px but the env renders "
            f"{cfg.env.cameras} at {cfg.env.image_size}px; set --env.image_size={pcfg.image_size}"
        )
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    episodes: list[dict] = []
    video_frames: list[np.ndarray] = []
    start = time.time()
    with MujocoBatchedEnv(cfg.env) as env:
        n = env.num_envs
        rounds = math.ceil(cfg.num_episodes / n)
        merge: MergeMode = cfg.merge  # type: ignore[assignment]
        executor = ActionChunkExecutor(n, env.action_dim, pcfg.horizon, merge=merge, ensemble_coeff=cfg.ensemble_coeff)
        bar = tqdm(total=cfg.num_episodes, desc="eval", unit="ep")
        for r in range(rounds):
            want = min(n, cfg.num_episodes - r * n)
            obs = env.reset(seed=cfg.seed + r)
            executor.reset()
            finished = np.zeros(n, dtype=bool)
            finished[want:] = True  # worlds beyond the episode quota run but are not counted
            results: list[dict | None] = [None] * n
            for t in range(env.max_episode_steps):
                # Replan when fewer than (horizon - n_action_steps) actions remain; in "ensemble" mode
                # with n_action_steps=1 this asks for a new chunk every step, as ACT does.
                need = executor.queue_length() <= pcfg.horizon - n_action_steps
                if need.any():
                    chunk = policy.predict_chunk(obs, executor.step.clone())
                    executor.add_chunk(chunk, env_mask=need)
                actions, _ = executor.next_action()
                if r == 0 and cfg.video_episodes > 0:
                    video_frames.append(_grid(env, min(cfg.video_episodes, want), cfg.video_size, finished))
                obs, _, terminated, truncated, info = env.step(actions)
                done = (terminated | truncated).numpy()
                for i in np.flatnonzero(done & ~finished):
                    results[i] = {"round": r, "world": int(i), "seed": cfg.seed + r,
                                  "success": bool(info["success"][i]), "length": t + 1}  # fmt: skip
                    bar.update(1)
                finished |= done
                executor.reset(torch.from_numpy(done))
                if finished.all():
                    break
            episodes.extend(results[:want])  # truncation at max_episode_steps ends every episode
        bar.close()
    successes = sum(e["success"] for e in episodes)
    lo, hi = wilson_interval(successes, len(episodes))
    lengths = [e["length"] for e in episodes]
    result = {
        "checkpoint": str(ckpt),
        "task": cfg.env.task,
        "episodes": len(episodes),
        "successes": successes,
        "success_rate": successes / len(episodes),
        "success_ci95": [lo, hi],
        "mean_episode_length": float(np.mean(lengths)),
        "mean_success_length": float(np.mean([e["length"] for e in episodes if e["success"]] or [0])),
        "seed": cfg.seed,
        "n_action_steps": n_action_steps,
        "merge": cfg.merge,
        "seconds": round(time.time() - start, 1),
        "per_episode": episodes,
        "config": asdict(cfg),
    }
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    if video_frames:
        _write_video(out / "rollouts.mp4", video_frames, fps=round(1 / env.control_dt))
        result["video"] = str(out / "rollouts.mp4")
    (out / "summary.md").write_text(_summary_md(result))
    return result


def _grid(env, count: int, size: int, finished: np.ndarray) -> np.ndarray:
    """One video frame: the first ``count`` worlds side by side; finished worlds are greyed out."""
    tiles = []
    for i in range(count):
        frame = env.render(i, size=size)
        tiles.append(frame // 3 if finished[i] else frame)
    return np.concatenate(tiles, axis=1)


def _write_video(path: Path, frames: list[np.ndarray], fps: int) -> None:
    import imageio.v2 as imageio

    with imageio.get_writer(path, fps=fps, codec="libx264", quality=7, macro_block_size=1) as writer:
        for f in frames:
            writer.append_data(f)


def _summary_md(r: dict) -> str:
    lo, hi = r["success_ci95"]
    return (
        f"# Evaluation: {r['task']}\n\n"
        f"- checkpoint: `{r['checkpoint']}`\n"
        f"- success: **{r['success_rate']:.1%}** ({r['successes']}/{r['episodes']}), 95% CI [{lo:.1%}, {hi:.1%}]\n"
        f"- mean episode length: {r['mean_episode_length']:.1f} steps "
        f"(successful: {r['mean_success_length']:.1f})\n"
        f"- seed {r['seed']}, {r['n_action_steps']} action steps per chunk, merge `{r['merge']}`\n"
        f"- time: {r['seconds']} s\n"
    )
