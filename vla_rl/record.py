"""`vla-rl record`: roll out a scripted expert in the batched env and write a LeRobotDataset (v3).

The dataset is written into a temporary directory beside the target and renamed into place
only when complete, so an interrupted recording (SIGINT, SIGTERM, an error) never leaves a
half-written dataset behind: the temporary directory is removed and the target is untouched.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from sim.config import EnvConfig
from sim.tasks.variety import ExpertVariety, VariedExpert
from vla_core import interrupt
from vla_core.data import discard_dataset, quiet_datasets
from vla_core.files import replace_directory
from vla_core.types import ACTION, ENVIRONMENT_STATE, OBS_STATE


@dataclass
class RecordConfig:
    """Record scripted demonstrations into a LeRobotDataset."""

    env: EnvConfig = field(default_factory=EnvConfig)  # the simulated task and batch size
    num_episodes: int = 200  # successful episodes to record (per task when `tasks` is given)
    # Several tasks into one multi-task dataset, num_episodes each, e.g. [lift,reach,push]; the tasks
    # share the arm, cameras and features. Empty = env.task only.
    tasks: list[str] = field(default_factory=list)
    output_dir: str = "outputs/quickstart/dataset"  # dataset root; must not exist unless overwrite=true
    repo_id: str = "local/vla_rl_lift"  # dataset name stored in its metadata
    seed: int = 0  # seed of the initial-state distribution
    overwrite: bool = False  # replace an existing dataset at output_dir
    # the expert varied per episode within the workspace (`sim.tasks.variety`: approach detours, pace,
    # noise); the defaults record the expert as written. Kept in meta/vla_rl_record.json's config.
    variety: ExpertVariety = field(default_factory=ExpertVariety)
    # Also record the task's true state (the object's position, the ball's velocity: what its scripted expert reads)
    # as LeRobot's observation.environment_state, each frame's from the moment of its observation: labels for an
    # auxiliary objective or a probe. Every task recorded must have the same privileged entries.
    environment_state: bool = False


def environment_state_names(env) -> list[str]:
    """The flat names of the task's privileged state (`privileged_state`: name -> (N, d)), ``<name>_<x|y|z|i>``."""
    names = []
    for key, value in env.privileged_state().items():
        width = int(np.prod(value.shape[1:]))
        axes = "xyz" if width == 3 else [str(i) for i in range(width)]
        names += [f"{key}_{axis}" for axis in axes]
    return names


def environment_state(privileged: dict[str, np.ndarray]) -> np.ndarray:
    """(N, E) float32: each world's privileged entries flattened in `environment_state_names`' order."""
    return np.concatenate([v.reshape(len(v), -1) for v in privileged.values()], axis=1).astype(np.float32)


def dataset_features(env, with_environment_state: bool = False) -> dict:
    """The dataset's features: the env's own (`vla_core.types.BatchedEnv.features`), the task's true state when asked,
    then each frame's reward and success."""
    feats = {key: dict(feature) for key, feature in env.features.items()}
    if with_environment_state:
        names = environment_state_names(env)
        feats[ENVIRONMENT_STATE] = {"dtype": "float32", "shape": (len(names),), "names": names}
    feats["next.reward"] = {"dtype": "float32", "shape": (1,), "names": None}
    feats["next.success"] = {"dtype": "bool", "shape": (1,), "names": None}
    return feats


def record(cfg: RecordConfig) -> dict:
    """Record ``cfg.num_episodes`` successful expert episodes of each task; returns a summary dict."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from sim.factory import make_env
    from sim.tasks import EXPERTS, TASKS
    from vla_core.data import video_backend

    tasks = cfg.tasks or [cfg.env.task]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; valid tasks: {', '.join(TASKS)}")

    out = Path(cfg.output_dir)
    if out.exists() and not cfg.overwrite:
        raise FileExistsError(
            f"{out} already exists; pass --overwrite=true to replace it or choose another --output_dir"
        )
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)

    quiet_datasets()
    start = time.time()
    ds, saved, failed, lengths = None, 0, 0, []
    # A stop signal is noted and acted on between env steps (vla_core.interrupt); then, as on any
    # error, the partial dataset is removed.
    try:
        with interrupt.deferred():
            for task_number, task in enumerate(tasks):
                with make_env(replace(cfg.env, task=task)) as env:
                    if ds is None:
                        ds = LeRobotDataset.create(
                            cfg.repo_id, fps=round(1 / env.control_dt),
                            features=dataset_features(env, cfg.environment_state), root=tmp,
                            robot_type="panda", use_videos=False, video_backend=video_backend(),
                        )  # fmt: skip
                    elif (
                        cfg.environment_state
                        and environment_state_names(env) != ds.meta.features[ENVIRONMENT_STATE]["names"]
                    ):
                        raise ValueError(f"--environment_state=true: task {task!r} has other privileged entries "
                                         f"({environment_state_names(env)}) than the first task's; record it alone")  # fmt: skip
                    # Each task gets its own seed range, so tasks never share initial-state draws.
                    expert = EXPERTS[task](env.num_envs)
                    if cfg.variety.active:
                        expert = VariedExpert(expert, cfg.variety, env.num_envs, cfg.seed + 1000 * task_number)
                    task_saved, task_failed = _record_task(env, expert, ds, cfg, cfg.seed + 1000 * task_number, lengths)
                    saved, failed = saved + task_saved, failed + task_failed
            ds.finalize()
        summary = {
            "dataset": str(out),
            "episodes": saved,
            "tasks": tasks,
            "frames": int(sum(lengths)),
            "expert_failures_discarded": failed,
            "expert_success_rate": saved / max(1, saved + failed),
            "mean_episode_length": float(np.mean(lengths)) if lengths else 0.0,
            "seconds": round(time.time() - start, 1),
            "config": asdict(cfg),
        }
        (tmp / "meta" / "vla_rl_record.json").write_text(json.dumps(summary, indent=2))
    except BaseException:
        discard_dataset(ds, tmp)
        raise
    replace_directory(tmp, out)
    return summary


def _record_task(env, expert, ds, cfg: RecordConfig, seed: int, lengths: list) -> tuple[int, int]:
    """Add ``cfg.num_episodes`` successful episodes of env's task to ds; returns (saved, failed)."""
    buffers: list[list[dict]] = [[] for _ in range(env.num_envs)]
    obs = env.reset(seed=seed)
    saved, failed = 0, 0
    with tqdm(total=cfg.num_episodes, desc=f"record {env.config.task}", unit="ep") as bar:
        while saved < cfg.num_episodes:
            privileged = env.privileged_state()  # the true state at the observation's moment
            actions = expert.act(env.ee_positions(), privileged)
            true_state = environment_state(privileged) if cfg.environment_state else None
            next_obs, reward, terminated, truncated, info = env.step(torch.from_numpy(actions))
            for i in range(env.num_envs):
                frame = {k: obs[k][i].permute(1, 2, 0).mul(255).round().to(torch.uint8).cpu().numpy()
                         for k in obs if k.startswith("observation.images.")}  # fmt: skip
                frame[OBS_STATE] = obs[OBS_STATE][i].cpu().numpy()
                frame[ACTION] = actions[i].astype(np.float32)
                if true_state is not None:
                    frame[ENVIRONMENT_STATE] = true_state[i]
                frame["next.reward"] = np.array([float(reward[i])], dtype=np.float32)
                frame["next.success"] = np.array([bool(info["success"][i])])
                frame["task"] = obs["task"][i]
                buffers[i].append(frame)
            done = (terminated | truncated).cpu().numpy()
            for i in np.flatnonzero(done):
                if info["success"][i] and saved < cfg.num_episodes:
                    for frame in buffers[i]:
                        ds.add_frame(frame)
                    ds.save_episode()
                    lengths.append(len(buffers[i]))
                    saved += 1
                    bar.update(1)
                elif not info["success"][i]:
                    failed += 1
                buffers[i] = []
            expert.reset(done)
            obs = next_obs
            interrupt.raise_if_stopped()
    return saved, failed
