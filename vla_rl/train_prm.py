"""`vla-rl train-prm`: fit VLA-RL's process reward model, a progress estimator, on a LeRobotDataset.

    vla-rl train-prm --dataset.root=outputs/quickstart/dataset --output_dir=outputs/quickstart/prm
    vla-rl finetune --checkpoint=outputs/quickstart/train --reward.process_model=outputs/quickstart/prm

Labels: frame t of a successful episode of T frames is t / (T - 1); every frame of a failed episode is 0
(an episode is failed when the dataset has ``next.success`` and none of its frames set it; a dataset
without that column, LIBERO's say, is all demonstrations). The model (`vla_rl.rl.process_reward.ProgressModel`)
reads the normalized state, the instruction's words and, with ``--camera``, one camera image; it learns
binary cross-entropy against the labels with AdamW, the learning rate cosine-decayed to 0.

Held-out episodes: a seeded draw (``--held_out`` of the episodes, at least one, by ``--seed``) is left out
of training, and the summary measures on them what shaping needs: that the predicted progress rises
along each successful episode (Spearman's rank correlation with time, the last frame above the first).

Writes ``output_dir/`` (``config.json``, ``model.safetensors``, ``prm_summary.json``) into a temporary
directory beside it, renamed into place when complete: an interrupted run leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from vla_core.files import replace_directory
from vla_core.types import OBS_IMAGES, OBS_STATE, TASK
from vla_rl.rl.process_reward import ProgressModel, ProgressModelConfig

SUMMARY_FILE = "prm_summary.json"


@dataclass
class PRMDatasetConfig:
    root: str = "outputs/quickstart/dataset"  # local LeRobotDataset directory (meta/info.json inside)
    repo_id: str = ""  # dataset name; empty = local/<directory name>


@dataclass
class TrainPRMConfig:
    """Train a process reward model on a LeRobotDataset: a progress estimator in [0, 1] that `vla-rl finetune
    --reward.process_model=<output_dir>` turns into a dense reward for PPO. Frame t of a successful episode of
    T frames is labelled t / (T - 1), every frame of a failed one 0 (failed: the dataset has next.success
    and no frame of the episode sets it). Episodes held out (--held_out, drawn by --seed) measure whether
    the progress rises along each successful episode; prm_summary.json holds the figures."""

    dataset: PRMDatasetConfig = field(default_factory=PRMDatasetConfig)  # successful (and failed) episodes
    output_dir: str = "outputs/quickstart/prm"  # config.json, model.safetensors and prm_summary.json go here
    overwrite: bool = False  # replace an existing model at output_dir
    # One camera the model reads through a small CNN, as named in observation.images.<camera>; "" = the state
    # and the instruction only (fast; enough where the arm's own state shows the task's phases).
    camera: str = ""
    held_out: float = 0.2  # fraction of episodes held out of training for the summary's metrics (at least one)
    steps: int = 2000  # optimizer steps
    batch_size: int = 256  # frames per step, drawn uniformly from the training episodes
    lr: float = 1e-3  # peak learning rate (AdamW), cosine-decayed to 0
    weight_decay: float = 1e-4  # AdamW's weight decay
    hidden_dim: int = 128  # width of the model's two hidden layers
    seed: int = 0  # the held-out draw, the initial weights and the frames of each step
    device: str = "cpu"  # torch device of the training (cuda, cuda:1, ...)
    num_threads: int = 0  # torch CPU threads; 0 = all cores

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.hidden_dim < 1:
            raise ValueError("--steps, --batch_size and --hidden_dim must be >= 1")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"--lr={self.lr} must be > 0 and --weight_decay={self.weight_decay} >= 0")
        if not 0 <= self.held_out < 1:
            raise ValueError(f"--held_out={self.held_out} must be in [0, 1) (a fraction of the episodes)")


@dataclass
class Frames:
    """Every frame of a dataset that the model reads, in the dataset's order. state: (N, S); task: N instruction
    strings; images: (N, 3, H, W) uint8 or None; episode: (N,) long; step, length: (N,) long, the frame's index
    in its episode and the episode's frames; success: (N,) bool, whether its episode succeeded."""

    state: torch.Tensor
    task: list[str]
    images: torch.Tensor | None
    episode: torch.Tensor
    step: torch.Tensor
    length: torch.Tensor
    success: torch.Tensor

    @property
    def label(self) -> torch.Tensor:
        """(N,) t / (T - 1) in a successful episode (1 for a single frame), 0 in a failed one."""
        progress = torch.where(self.length > 1, self.step.float() / (self.length - 1).clamp_min(1).float(), 1.0)
        return torch.where(self.success, progress, 0.0)

    def obs(self, rows: torch.Tensor, camera: str) -> dict:
        """The observation batch of ``rows`` (R,), as the env emits it (images float in [0, 1])."""
        obs = {OBS_STATE: self.state[rows], TASK: [self.task[i] for i in rows.tolist()]}
        if self.images is not None:
            obs[f"{OBS_IMAGES}.{camera}"] = self.images[rows].float() / 255.0
        return obs


def read_frames(dataset, camera: str) -> Frames:
    """The frames of an opened LeRobotDataset; one line naming the fix when a column is missing."""
    features = dataset.meta.features
    cameras = sorted(k.removeprefix(OBS_IMAGES + ".") for k in features if k.startswith(OBS_IMAGES + "."))
    if OBS_STATE not in features:
        raise ValueError(f"dataset {dataset.root} has no {OBS_STATE}; the process reward model reads it")
    if camera and camera not in cameras:
        raise ValueError(f"dataset {dataset.root} has no camera {camera!r}; choose --camera from {cameras} or ''")
    columns = [OBS_STATE, "episode_index", "task_index"] + [f"{OBS_IMAGES}.{camera}"] * bool(camera)
    columns += ["next.success"] * ("next.success" in features)
    table = dataset.hf_dataset.select_columns(columns).with_format("torch")[:]
    tasks = dataset.meta.tasks  # pandas frame indexed by task string
    names = {int(tasks.loc[t, "task_index"]): str(t) for t in tasks.index}
    episode = table["episode_index"].long()
    start = torch.cat([torch.tensor([True]), episode[1:] != episode[:-1]])  # frames are stored episode by episode
    first = torch.nonzero(start).flatten()
    run = torch.cumsum(start.long(), 0) - 1  # (N,) which run of frames each belongs to
    lengths = torch.diff(torch.cat([first, torch.tensor([len(episode)])]))
    if "next.success" in table:
        done = table["next.success"].bool().reshape(len(episode), -1).any(-1)
        success = (torch.zeros(len(first), dtype=torch.long).index_add_(0, run, done.long()) > 0)[run]
    else:
        success = torch.ones(len(episode), dtype=torch.bool)
    images = None
    if camera:
        images = table[f"{OBS_IMAGES}.{camera}"]
        images = images if images.dtype == torch.uint8 else (images * 255).round().clamp(0, 255).to(torch.uint8)
    state = table[OBS_STATE].float()
    if not torch.isfinite(state).all():
        raise ValueError(f"dataset {dataset.root} has NaN or inf in {OBS_STATE}")
    return Frames(state=state, task=[names[i] for i in table["task_index"].long().tolist()], images=images,
                  episode=episode, step=torch.arange(len(episode)) - first[run], length=lengths[run],
                  success=success)  # fmt: skip


def split_episodes(episodes: torch.Tensor, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    """(training episodes, held-out episodes), sorted: max(1, round(held_out E)) of the E episode indices drawn by
    ``torch.randperm(E)`` from a generator seeded with ``seed`` (none when ``held_out`` is 0)."""
    ids = episodes.unique().tolist()
    count = max(1, round(held_out * len(ids))) if held_out > 0 else 0
    if count >= len(ids):
        raise ValueError(
            f"--held_out={held_out} leaves no training episode (the dataset has {len(ids)}); lower it or record more"
        )
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    held = sorted(ids[i] for i in order[:count])
    return sorted(set(ids) - set(held)), held


def ranks(x: torch.Tensor) -> torch.Tensor:
    """(N,) ranks 0 .. N-1 of ``x`` (N,), tied values sharing their mean rank."""
    order = torch.argsort(x, stable=True)
    rank = torch.empty(len(x), dtype=torch.float64)
    rank[order] = torch.arange(len(x), dtype=torch.float64)
    _, tie, counts = torch.unique(x, return_inverse=True, return_counts=True)
    return torch.zeros(len(counts), dtype=torch.float64).index_add_(0, tie, rank)[tie] / counts[tie]


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation of two (N,) series: Pearson's of their ranks (0 when either is constant)."""
    a, b = ranks(x), ranks(y)
    a, b = a - a.mean(), b - b.mean()
    scale = float(a.norm() * b.norm())
    return float((a * b).sum()) / scale if scale > 0 else 0.0


def held_out_metrics(model: ProgressModel, frames: Frames, episodes: list[int], camera: str) -> dict:
    """How the model's progress runs along each held-out episode: for the successful ones, Spearman's rank
    correlation with time, the first and last frames' progress and the mean absolute error against the
    labels; for failed ones, their mean progress."""
    per_episode, errors, failed = [], [], []
    for e in episodes:
        rows = torch.nonzero(frames.episode == e).flatten()
        progress = model.progress(frames.obs(rows, camera))
        if not bool(frames.success[rows[0]]):
            failed.append(float(progress.mean()))
            continue
        per_episode.append({"episode": e, "frames": len(rows), "spearman": round(spearman(progress, frames.step[rows]), 4),
                            "first": round(float(progress[0]), 4), "last": round(float(progress[-1]), 4)})  # fmt: skip
        errors.append((progress - frames.label[rows]).abs())
    rhos = [p["spearman"] for p in per_episode]
    return {
        "episodes": episodes,
        "successful": len(per_episode),
        "spearman_mean": round(sum(rhos) / len(rhos), 4) if rhos else None,
        "spearman_min": min(rhos) if rhos else None,
        "last_above_first": sum(p["last"] > p["first"] for p in per_episode),
        "mean_abs_error": round(float(torch.cat(errors).mean()), 4) if errors else None,
        "failed_mean_progress": round(sum(failed) / len(failed), 4) if failed else None,
        "per_episode": per_episode,
    }


def fit(model: ProgressModel, frames: Frames, rows: torch.Tensor, cfg: TrainPRMConfig) -> list[list[float]]:
    """``cfg.steps`` AdamW steps of binary cross-entropy against the labels, on frames drawn uniformly from
    ``rows`` (R,); returns the loss curve, [step, mean loss] every tenth of the run."""
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    labels, curve, window = frames.label, [], []
    every = max(1, cfg.steps // 10)
    model.train()
    with tqdm(range(cfg.steps), desc="train-prm", unit="step") as bar:
        for step in bar:
            batch = rows[torch.randint(0, len(rows), (cfg.batch_size,), generator=generator)]
            logits = model(frames.obs(batch, cfg.camera))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[batch].to(logits.device))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the loss became {loss.item()} at step {step}; lower --lr (now {cfg.lr})")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            window.append(loss.item())
            if (step + 1) % every == 0 or step + 1 == cfg.steps:
                curve.append([step + 1, round(sum(window) / len(window), 6)])
                bar.set_postfix(loss=f"{curve[-1][1]:.4f}")
                window = []
    return curve


def train_prm(cfg: TrainPRMConfig) -> dict:
    """Fit the model of ``cfg`` and write it into ``cfg.output_dir``; returns the summary it writes there."""
    from policies.tokenizer import word_vocabulary
    from vla_core.data import open_dataset

    cfg.validate()
    out = Path(cfg.output_dir)
    if out.exists() and not cfg.overwrite:
        raise FileExistsError(
            f"{out} already exists; pass --overwrite=true to replace it or choose another --output_dir"
        )
    torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
    start = time.time()
    dataset = open_dataset(cfg.dataset.root, cfg.dataset.repo_id or None)
    frames = read_frames(dataset, cfg.camera)
    train_episodes, held_episodes = split_episodes(frames.episode, cfg.held_out, cfg.seed)
    if not bool(frames.success[torch.isin(frames.episode, torch.tensor(train_episodes))].any()):
        raise ValueError(
            f"the training episodes of {cfg.dataset.root} hold no successful episode; record demonstrations"
        )
    tasks = sorted(set(frames.task))
    torch.manual_seed(cfg.seed)  # the initial weights
    model = ProgressModel(ProgressModelConfig(
        state_dim=frames.state.shape[1], vocabulary=word_vocabulary(tasks), tasks=tasks, camera=cfg.camera,
        image_size=0 if frames.images is None else frames.images.shape[-1], hidden_dim=cfg.hidden_dim,
        dataset=str(cfg.dataset.root),
    ))  # fmt: skip
    stats = dataset.meta.stats[OBS_STATE]
    model.set_normalization(stats["mean"], stats["std"])
    model.to(cfg.device)
    rows = torch.nonzero(torch.isin(frames.episode, torch.tensor(train_episodes))).flatten()
    curve = fit(model, frames, rows, cfg)
    model.eval()
    failed = len(frames.episode[rows][~frames.success[rows]].unique())  # training episodes labelled 0 throughout
    summary = {
        "dataset": str(cfg.dataset.root),
        "frames": len(frames.episode),
        "train": {
            "episodes": train_episodes,
            "frames": len(rows),
            "failed_episodes": failed,
            "first_loss": curve[0][1],
            "final_loss": curve[-1][1],
        },
        "held_out": held_out_metrics(model, frames, held_episodes, cfg.camera) if held_episodes else None,
        "loss_curve": curve,
        "seconds": round(time.time() - start, 1),
        "config": asdict(cfg),
    }
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save(tmp)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        replace_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary
