"""`vla-rl train`: imitation learning of a diffusion policy on a LeRobotDataset, with accelerate.

Checkpoints are atomic and hold everything ``--resume=true`` needs to continue the same run:
step count, optimizer and LR schedule, EMA and raw weights, the sampling RNG and the loss
curve. Ctrl-C writes a checkpoint at the current step before exiting.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from policies.diffusion import DiffusionConfig, DiffusionPolicy
from vla_rl.checkpoint import resolve_checkpoint, save_checkpoint
from vla_rl.types import OBS_IMAGES, OBS_STATE


@dataclass
class DatasetConfig:
    root: str = "outputs/quickstart/dataset"  # local LeRobotDataset directory (meta/info.json inside)
    repo_id: str = ""  # dataset name; empty = local/<directory name>
    cameras: list[str] = field(default_factory=list)  # cameras to train on; empty = every camera in the dataset


@dataclass
class TrainConfig:
    """Train a diffusion policy by imitation on a LeRobotDataset."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # the LeRobotDataset to imitate
    policy: DiffusionConfig = field(default_factory=DiffusionConfig)  # the diffusion policy's architecture
    output_dir: str = "outputs/quickstart/train"  # checkpoints, logs and the loss curve go here
    steps: int = 5000  # optimizer steps in total (a resumed run continues up to this number)
    batch_size: int = 64  # samples per step per process
    lr: float = 1e-3  # peak learning rate (AdamW), cosine decay after warmup
    warmup_steps: int = 200  # linear LR warmup
    weight_decay: float = 1e-6  # AdamW weight decay
    ema_decay: float = 0.995  # EMA of weights used for evaluation; 0 disables it
    save_every: int = 1000  # checkpoint period in steps
    log_every: int = 50  # loss logging period in steps
    seed: int = 0  # seed of batch sampling, augmentation and diffusion noise
    resume: bool = False  # continue from output_dir/checkpoints/last
    num_threads: int = 0  # torch CPU threads; 0 = all cores
    log_with: str = "tensorboard"  # accelerate tracker: tensorboard, wandb, or none


def random_shift(images: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """(B, C, S, S) -> same shape, each image translated by up to ``shift`` pixels (edge padding)."""
    if shift <= 0:
        return images
    b, _, s, _ = images.shape
    padded = torch.nn.functional.pad(images, (shift,) * 4, mode="replicate")
    dx, dy = torch.randint(0, 2 * shift + 1, (2, b), generator=generator).tolist()
    return torch.stack([padded[i, :, dy[i] : dy[i] + s, dx[i] : dx[i] + s] for i in range(b)])


def build_policy(cfg: TrainConfig, demos, dataset) -> DiffusionPolicy:
    from policies.diffusion.modeling import build_vocabulary

    pcfg = copy.deepcopy(cfg.policy)
    pcfg.state_dim = demos.state.shape[1]
    pcfg.action_dim = demos.action.shape[1]
    pcfg.cameras = list(demos.cameras)
    pcfg.vocabulary = build_vocabulary(demos.tasks)
    size = demos.images[demos.cameras[0]].shape[-1]
    if pcfg.image_size != size:
        raise ValueError(
            f"dataset images are {size}x{size} but policy.image_size={pcfg.image_size}; "
            f"set --policy.image_size={size}"
        )
    if pcfg.n_action_steps > pcfg.horizon:
        raise ValueError(f"policy.n_action_steps={pcfg.n_action_steps} exceeds policy.horizon={pcfg.horizon}")
    policy = DiffusionPolicy(pcfg)
    stats = dataset.meta.stats
    policy.set_normalization(
        stats[OBS_STATE]["mean"], stats[OBS_STATE]["std"], stats["action"]["min"], stats["action"]["max"]
    )
    return policy


def train(cfg: TrainConfig) -> dict:
    from accelerate import Accelerator
    from diffusers.optimization import get_scheduler

    from vla_rl.data import ChunkedDemos, open_dataset

    torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
    out = Path(cfg.output_dir)
    ckpt_dir = out / "checkpoints"
    has_checkpoint = (ckpt_dir / "last").exists()
    if has_checkpoint and not cfg.resume:
        raise FileExistsError(f"{out} already holds checkpoints; pass --resume=true to continue, or a new --output_dir")
    if cfg.resume and not has_checkpoint:
        raise FileNotFoundError(f"--resume=true but {ckpt_dir}/last does not exist; start without --resume")

    trackers = [] if cfg.log_with == "none" else [cfg.log_with]
    accelerator = Accelerator(log_with=trackers or None, project_dir=str(out))
    dataset = open_dataset(cfg.dataset.root, cfg.dataset.repo_id or None)
    demos = ChunkedDemos(dataset, cfg.dataset.cameras or None)
    torch.manual_seed(cfg.seed)  # weight initialization; the same seed builds the same network
    policy = build_policy(cfg, demos, dataset)
    ema = copy.deepcopy(policy).requires_grad_(False) if cfg.ema_decay > 0 else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.steps)
    generator = torch.Generator().manual_seed(cfg.seed + accelerator.process_index)
    step, history = 0, []

    if cfg.resume:
        ckpt = resolve_checkpoint(ckpt_dir)
        state = torch.load(ckpt / "training_state.pt", weights_only=False)
        policy.load_state_dict(state["model"])
        if ema is not None:
            ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(state["generator"])
        step, history = state["step"], state["history"]
        if accelerator.is_main_process:
            print(f"resumed from {ckpt} at step {step}", file=sys.stderr)

    policy, optimizer = accelerator.prepare(policy, optimizer)
    raw_policy = accelerator.unwrap_model(policy)
    if trackers:
        accelerator.init_trackers("train", config=_flat(asdict(cfg)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))

    def checkpoint(at_step: int) -> Path | None:
        if not accelerator.is_main_process:
            return None
        state = {
            "model": raw_policy.state_dict(),
            "ema": ema.state_dict() if ema is not None else None,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "generator": generator.get_state(),
            "step": at_step,
            "history": history,
        }
        meta = {"dataset": str(cfg.dataset.root), "dataset_frames": len(demos), "train_config": asdict(cfg)}
        return save_checkpoint(ckpt_dir, at_step, ema if ema is not None else raw_policy, meta, state)

    device = accelerator.device
    start, window = time.time(), []
    bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", disable=not accelerator.is_main_process)
    try:
        while step < cfg.steps:
            idx = torch.randint(0, len(demos), (cfg.batch_size,), generator=generator)
            batch = demos.batch(idx, raw_policy.config.horizon)
            for key in [k for k in batch if k.startswith(OBS_IMAGES)]:
                batch[key] = random_shift(batch[key], raw_policy.config.crop_shift, generator)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            policy.train()
            loss = policy(batch, generator)  # forward() is the training loss, so DDP syncs gradients
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss became {loss.item()} at step {step}; lower --lr and --resume=true")
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if ema is not None:
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), raw_policy.parameters()):
                        e.lerp_(p, 1.0 - cfg.ema_decay)
            step += 1
            window.append(loss.item())
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.steps:
                mean = sum(window) / len(window)
                history.append([step, mean])
                window = []
                bar.set_postfix(loss=f"{mean:.4f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
                if trackers:
                    accelerator.log({"loss": mean, "lr": scheduler.get_last_lr()[0]}, step=step)
            if step % cfg.save_every == 0 and step < cfg.steps:
                checkpoint(step)
    except KeyboardInterrupt:
        bar.close()
        path = checkpoint(step)
        if accelerator.is_main_process:
            print(f"\ninterrupted at step {step}; checkpoint written to {path}. Continue with --resume=true", file=sys.stderr)
        raise
    bar.close()
    final = checkpoint(step)
    if trackers:
        accelerator.end_training()
    summary = {
        "checkpoint": str(final),
        "steps": step,
        "final_loss": history[-1][1] if history else None,
        "loss_curve": history,
        "seconds_this_run": round(time.time() - start, 1),
        "dataset_frames": len(demos),
        "dataset_episodes": dataset.num_episodes,
    }
    if accelerator.is_main_process:
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
        _plot_loss(history, out / "loss.png")
    return summary


def _flat(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return flat


def _plot_loss(history: list, path: Path) -> None:
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, losses = zip(*history)
    ax.plot(steps, losses)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("denoising loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
