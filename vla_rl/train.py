"""`vla-rl train`: imitation learning of a diffusion policy on a LeRobotDataset, with accelerate.

Checkpoints are atomic and hold everything ``--resume=true`` needs to continue the same run:
step count, optimizer and LR schedule, EMA and raw weights, the sampling RNG and the loss
curve. SIGINT (Ctrl-C) or SIGTERM ends the run at the next step boundary with a checkpoint there,
however the process was started, and the command exits 130 or 143 (see ``vla_core.interrupt``).

Level-2 minibatching (``--l2_copies=K``, Mini-Diffuser): each step draws batch_size / K frames,
encodes each observation once and denoises K independently noised copies of its action chunk,
so a step still has batch_size denoising samples but runs the encoder K times less.

With ``--val_episodes=N`` the last N episodes are held out and a validation denoising loss (fixed
frames, fixed noise and timesteps) is tracked; ``--stop_at_val_loss`` ends training once it is reached.

Training-time RTC (``--delay.kind=uniform --delay.high=8``, or fixed / histogram): every frame gets an
inference delay d drawn from the delay model and the delay augmentation of its demonstration, the
chunk's first d actions as committed actions (``committed_prefix``); the policy is built with
``max_delay_steps`` = the model's largest delay and learns to continue a committed prefix. Under
delay d the chunk's rows j < d are given, not predicted, so the rows zero delay runs first would be
trained on few frames (row 0 only on those with d = 0); each frame is therefore also denoised at
zero delay (nothing committed, every row in the loss, the same noise and timestep, one more denoiser
pass on the same encoded observation), and the loss is the mean of that pass's and the delayed
pass's: every row gets at least the supervision plain training gives it, whatever the delays. The
default delay (fixed, 0 steps) adds nothing.

The file reads top to bottom: the configs, the saved progress, the building blocks (batches, checks,
the policy, the validation loss), then `train`, the run's outline, and its parts in the order it calls
them: `start_run` (data, policy, optimizer, EMA, generators), `resume`, `start_logging`, `train_steps`
(each `train_step`, then `log_loss`, `validate` and `checkpoint` on their periods) and `finish`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from tqdm import tqdm

from policies import DiffusionConfig, PolicyConfig
from vla_core import crash_log, interrupt
from vla_core.data import random_shift
from vla_core.files import temporary_beside, write_text_atomic
from vla_core.runtime import DelayConfig, DelayModel, LatencySpec, committed_prefix
from vla_core.types import ACTION, OBS_IMAGES, ZERO_DELAY_PASS
from vla_rl.accelerator import make_accelerator
from vla_rl.checkpoint import (
    POLICY_DIR,
    TRAINING_STATE_DIR,
    begin_checkpoint,
    check_resume,
    commit_checkpoint,
    resolve_checkpoint,
    temporary_checkpoint_dir,
    write_policy,
)
from vla_rl.config_json import config_dict, flat_dict

Sampling = Literal["task_balanced", "uniform"]


@dataclass
class DatasetConfig:
    root: str = "outputs/quickstart/dataset"  # local LeRobotDataset directory (meta/info.json inside)
    repo_id: str = ""  # dataset name; empty = local/<directory name>
    cameras: list[str] = field(default_factory=list)  # cameras to train on; empty = every camera in the dataset
    # Frame sampling: task_balanced draws a task uniformly, then one of its frames (multi-task
    # datasets); uniform draws any frame. Identical on a single-task dataset.
    sampling: Sampling = "task_balanced"


@dataclass
class TrainConfig:
    """Train a diffusion policy by imitation on a LeRobotDataset."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # the LeRobotDataset to imitate
    # The policy and its architecture: --policy.type=diffusion (small CNN + MLP, the default) or
    # diffusion_vla (SigLIP encoders + DiT, DDPM or flow matching).
    policy: PolicyConfig = field(default_factory=DiffusionConfig)
    output_dir: str = "outputs/quickstart/train"  # checkpoints, logs and the loss curve go here
    steps: int = 5000  # optimizer steps in total (a resumed run continues up to this number)
    batch_size: int = 64  # denoising samples per step per process (= frames x l2_copies)
    # Level-2 minibatching: noised copies of each frame's action chunk per step; the encoder runs
    # on batch_size / l2_copies frames. 1 = conventional training. Needs a diffusion_vla policy
    # when above 1.
    l2_copies: int = 1
    lr: float = 1e-3  # peak learning rate (AdamW), reached after warmup; see lr_schedule
    warmup_steps: int = 200  # linear LR warmup
    # LR after warmup: cosine (decays to 0 at `steps`) or constant_with_warmup (any diffusers schedule name)
    lr_schedule: str = "cosine"
    weight_decay: float = 1e-6  # AdamW weight decay
    ema_decay: float = 0.995  # EMA of weights used for evaluation; 0 disables it
    save_every: int = 1000  # checkpoint period in steps
    log_every: int = 50  # loss logging period in steps
    seed: int = 0  # seed of batch sampling, augmentation and diffusion noise
    resume: bool = False  # continue from output_dir/checkpoints/last
    num_threads: int = 0  # torch CPU threads; 0 = all cores
    log_with: Literal["tensorboard", "wandb", "none"] = "tensorboard"  # accelerate tracker: tensorboard, wandb, or none
    val_episodes: int = 0  # episodes held out (the dataset's last ones) for a validation loss; 0 = none
    val_every: int = 250  # validation period in steps
    val_frames: int = 256  # held-out frames in the validation loss (evenly spaced)
    stop_at_val_loss: float = 0.0  # stop once the validation loss is at or below this; 0 = run all steps
    # ... for this many consecutive validations (one validation at the target can be noise); 1 = the first
    stop_consecutive: int = 1
    # Inference delays simulated in training (training-time RTC): each frame's chunk comes with its
    # first d demonstrated actions as committed actions. Sets policy.max_delay_steps to the largest d;
    # the default (fixed, 0 steps) trains without the delay augmentation. delay.seed seeds the draws.
    delay: DelayConfig = field(default_factory=DelayConfig)


@dataclass
class TrainingProgress:
    """Where a run stands, beyond what accelerate's ``save_state`` keeps: saved as ``progress.pt`` in
    the checkpoint's ``training_state/``.

    generator: this process's sampling generator (batches, augmentation, diffusion noise); every
    process's state is saved, so each resumes its own stream. delay_generator: the delay model's
    generator (the delays of the delay augmentation) when training with one; saved and resumed the same way.
    """

    generator: torch.Generator
    delay_generator: torch.Generator | None = None
    step: int = 0
    history: list = field(default_factory=list)  # [[step, mean loss]] at each log step
    loss_window: list = field(default_factory=list)  # losses since the last logged mean, so a resumed curve is the same
    val_history: list = field(default_factory=list)  # [[step, training seconds, validation loss]]
    train_seconds: float = 0.0  # time in training steps (validation excluded)

    FILE = "progress.pt"

    def gather_generators(self, accelerator) -> dict[str, torch.Tensor]:
        """Every process's generator states by ``progress.pt`` key, each (processes, state bytes): ``generators``,
        and ``delay_generators`` when there is a delay generator (a collective call)."""
        states = {"generators": self.generator.get_state()[None]}
        if self.delay_generator is not None:
            states["delay_generators"] = self.delay_generator.get_state()[None]
        if accelerator.num_processes == 1:
            return states
        # NCCL gathers device tensors only.
        return {key: accelerator.gather(state.to(accelerator.device)).cpu() for key, state in states.items()}

    def save(self, directory: Path, lr: float, generators: dict[str, torch.Tensor]) -> None:
        """Write ``progress.pt``; ``lr`` is the schedule's peak, so a resumed run can say when it changes.
        generators: what ``gather_generators`` returned."""
        torch.save(
            {"step": self.step, "lr": lr, "history": self.history, "loss_window": self.loss_window,
             "val_history": self.val_history, "train_seconds": self.train_seconds, **generators},
            directory / self.FILE,
        )  # fmt: skip

    def load(self, directory: Path, process_index: int) -> float:
        """Restore from ``progress.pt``; returns the peak LR the saved run used."""
        saved = torch.load(directory / self.FILE, weights_only=False)
        if process_index >= len(saved["generators"]):
            raise ValueError(f"the checkpoint was written by {len(saved['generators'])} processes; resume with as many")
        self.generator.set_state(saved["generators"][process_index])
        if self.delay_generator is not None:  # `check_delay` made sure the checkpoint trained with delays too
            self.delay_generator.set_state(saved["delay_generators"][process_index])
        self.step, self.history, self.loss_window = saved["step"], saved["history"], saved["loss_window"]
        self.val_history, self.train_seconds = saved["val_history"], saved["train_seconds"]
        return saved["lr"]


def check_delay(cfg: TrainConfig, control_dt: float | None, checkpoint: Path | None = None) -> DelayModel:
    """The delay model of ``cfg.delay``, checked before the policy is built.

    control_dt: the dataset's seconds per frame (a latency file must have been measured at it; only
    ``histogram`` needs it).
    Refused: a delay of a whole chunk or more (nothing is left to predict); a hand-set
    ``--policy.max_delay_steps`` other than the delay model's largest delay (it is set from
    ``--delay``); resuming a ``checkpoint`` trained for another largest delay (its network differs).
    """
    delay = DelayModel(cfg.delay, control_dt)
    LatencySpec(horizon=cfg.policy.horizon).check_delay(delay.max_steps)  # a chunk must outlast every delay
    if cfg.policy.max_delay_steps not in (0, delay.max_steps):
        raise ValueError(
            f"policy.max_delay_steps={cfg.policy.max_delay_steps} but the delay model reaches {delay.max_steps} "
            f"steps; drop --policy.max_delay_steps (it is set from --delay)"
        )
    if checkpoint is not None:
        trained = json.loads((checkpoint / POLICY_DIR / "config.json").read_text()).get("max_delay_steps", 0)
        if trained != delay.max_steps:
            raise ValueError(
                f"{checkpoint} trained with delays up to {trained} control steps but --delay reaches "
                f"{delay.max_steps}; resume with the run's own --delay settings (see its train_config.json)"
            )
    return delay


def with_delay_augmentation(batch: dict, delays: torch.Tensor, max_delay: int) -> dict:
    """A training batch with the delay augmentation of per-frame ``delays`` (B,) added (``committed_prefix``),
    its frames also trained at zero delay (``ZERO_DELAY_PASS``: see the module docstring)."""
    prefix = committed_prefix(batch[ACTION], batch["action_is_pad"], delays, max_delay)
    return {**batch, **prefix, ZERO_DELAY_PASS: True}


def build_policy(cfg: TrainConfig, demos, dataset, max_delay_steps: int = 0, frames: torch.Tensor | None = None):
    """The policy of ``cfg.policy`` sized from the dataset's features and tasks, with its normalization
    statistics (``PreTrainedPolicy.from_dataset``), reading the delay augmentation up to
    ``max_delay_steps``, and what it fits on the demonstrations of ``frames`` (the training frames; all when
    None). Raises ValueError naming the fix when the config and the dataset disagree."""
    from policies import policy_class

    pcfg = copy.deepcopy(cfg.policy)
    pcfg.max_delay_steps = max_delay_steps
    policy = policy_class(pcfg.type).from_dataset(
        pcfg, dataset.meta.features, dataset.meta.stats, demos.tasks, cameras=list(demos.cameras)
    )
    policy.fit_to_demonstrations(demos, frames)  # e.g. an action tokenizer, on the training frames' chunks
    return policy


def check_batching(cfg: TrainConfig) -> int:
    """Validate batch_size / l2_copies before anything is loaded; returns frames per step."""
    k = cfg.l2_copies
    if k < 1:
        raise ValueError(f"l2_copies must be >= 1, got {k}")
    if cfg.batch_size % k:
        raise ValueError(
            f"l2_copies={k} does not divide batch_size={cfg.batch_size}; batch_size counts denoising samples "
            f"(frames x copies), so choose a batch_size that is a multiple of {k}"
        )
    if k > 1:
        from policies import policy_class

        if not policy_class(cfg.policy.type).supports_copies:
            raise ValueError(
                f"l2_copies={k} needs a policy with Level-2 minibatching, such as --policy.type=diffusion_vla "
                f"(the {cfg.policy.type} policy has no copies)"
            )
    if cfg.dataset.sampling not in get_args(Sampling):  # a config built in code skips the parser's check
        raise ValueError(f"dataset.sampling must be one of {get_args(Sampling)}, got {cfg.dataset.sampling!r}")
    return cfg.batch_size // k


def split_episodes(demos, val_episodes: int, val_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train frame indices, validation frame indices): the last ``val_episodes`` episodes are held out."""
    episodes = demos.episode.unique()
    if val_episodes >= len(episodes):
        raise ValueError(f"val_episodes={val_episodes} leaves no training episodes (the dataset has {len(episodes)})")
    held_out = torch.isin(demos.episode, episodes[len(episodes) - val_episodes :]) if val_episodes else None
    all_frames = torch.arange(len(demos))
    if held_out is None:
        return all_frames, all_frames[:0]
    val = all_frames[held_out]
    keep = torch.linspace(0, len(val) - 1, min(val_frames, len(val))).round().long()
    return all_frames[~held_out], val[keep]


@torch.no_grad()
def validation_loss(
    policy, demos, frames: torch.Tensor, horizon: int, seed: int = 1234, delays: torch.Tensor | None = None
) -> float:
    """Denoising loss on fixed frames with fixed noise and timesteps (one copy each), batched by 64.

    delays: (len(frames),) fixed delays of the frames' delay augmentation (None: without it); the loss is
    training's, the zero-delay pass included (`with_delay_augmentation`).
    """
    generator = torch.Generator().manual_seed(seed)
    was_training = policy.training
    policy.eval()
    total, count = 0.0, 0
    parts = frames.split(64)
    for part, part_delays in zip(parts, delays.split(64) if delays is not None else [None] * len(parts), strict=True):
        batch = demos.batch(part, horizon)
        if part_delays is not None:
            batch = with_delay_augmentation(batch, part_delays, policy.config.max_delay_steps)
        batch = {k: v.to(policy.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        total += policy(batch, generator).item() * len(part)
        count += len(part)
    policy.train(was_training)
    return total / max(count, 1)


@dataclass
class Run:
    """One training run's parts, assembled by `start_run` and shared by the steps, validation and checkpoints."""

    cfg: TrainConfig
    accelerator: Any
    trackers: list[str]
    out: Path  # cfg.output_dir
    resume_from: Path | None  # the checkpoint `--resume=true` continues from (None: a new run)
    dataset: Any  # the LeRobotDataset
    demos: Any  # its frames as chunks (vla_core.data.ChunkedDemos)
    sampler: Any  # draws the training frames (vla_core.data.FrameSampler)
    val_frames: torch.Tensor  # the held-out frames of the validation loss (empty: no validation)
    val_delays: torch.Tensor | None  # their fixed delays (None: training without the delay augmentation)
    delay: DelayModel  # the delays of the delay augmentation; max_steps 0 = none
    policy: Any  # as accelerate prepared it (DDP-wrapped with several processes): the one to step
    raw_policy: Any  # the policy itself: what checkpoints and validation use
    trainable: list  # its parameters that train (frozen ones need neither optimizer state nor an EMA copy)
    optimizer: Any
    scheduler: Any
    ema: Any  # diffusers' EMAModel of the trainable weights, or None
    progress: TrainingProgress
    saved_step: int | None = None  # the step of the checkpoint on disk

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"


def train(cfg: TrainConfig) -> dict:
    """Train ``cfg.policy`` on ``cfg.dataset`` for ``cfg.steps`` steps; returns the summary, also written as
    ``train_summary.json`` (keys: checkpoint, steps, final_loss, loss_curve, val_curve, train_seconds,
    seconds_this_run, dataset_frames, dataset_episodes)."""
    frames_per_step = check_batching(cfg)
    torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
    run = start_run(cfg)
    if cfg.resume:
        resume(run)
    start_logging(run)
    start = time.time()
    bar = tqdm(total=cfg.steps, initial=run.progress.step, desc="train", unit="step",
               disable=not run.accelerator.is_main_process)  # fmt: skip
    # SIGINT and SIGTERM are only noted during a step or a checkpoint write: the loop stops at the
    # next step boundary and writes a checkpoint there (see vla_core.interrupt).
    with interrupt.deferred(), crash_log.into(run.out, run.accelerator.process_index):
        step = train_steps(run, frames_per_step, bar)
        summary = finish(run, step, start)
    return summary


def start_run(cfg: TrainConfig) -> Run:
    """Check the run can start, then open the dataset and build the policy, optimizer, LR schedule, EMA
    and sampling generators, each process seeded for its own streams."""
    from vla_core.data import open_dataset

    out = Path(cfg.output_dir)
    resumed = check_resume(out / "checkpoints", cfg.resume)
    # A latency file needs the dataset's frame period; the other delay kinds are checked before any data is read.
    delay = None if cfg.delay.kind == "histogram" else check_delay(cfg, None, resumed)

    trackers = [] if cfg.log_with == "none" else [cfg.log_with]
    accelerator = make_accelerator(trackers, out)
    dataset = open_dataset(cfg.dataset.root, cfg.dataset.repo_id or None)
    delay = delay or check_delay(cfg, 1.0 / dataset.meta.fps, resumed)
    demos, sampler, val_frames = load_frames(cfg, dataset)
    policy, raw_policy, trainable, optimizer, scheduler, ema = build_learner(
        cfg, accelerator, demos, dataset, delay.max_steps, sampler.frames
    )
    # Each process draws its own delays, as it draws its own frames; the stream resumes with `progress`.
    delay.use_stream(accelerator.process_index)
    progress = TrainingProgress(
        generator=torch.Generator().manual_seed(cfg.seed + accelerator.process_index),
        delay_generator=delay.generator if delay.max_steps else None,
    )
    # Validation frames get fixed delays of the same model, drawn from a stream of their own.
    val_delays = DelayModel(cfg.delay, 1.0 / dataset.meta.fps).sample(len(val_frames)) if delay.max_steps else None
    # accelerate's save_state / load_state keep the prepared model and optimizer, every process's
    # RNG, and these registered objects; `progress` travels beside them (see TrainingProgress).
    accelerator.register_for_checkpointing(scheduler, *([ema] if ema is not None else []))
    return Run(
        cfg=cfg, accelerator=accelerator, trackers=trackers, out=out, resume_from=resumed, dataset=dataset,
        demos=demos, sampler=sampler, val_frames=val_frames, val_delays=val_delays, delay=delay, policy=policy,
        raw_policy=raw_policy, trainable=trainable, optimizer=optimizer, scheduler=scheduler, ema=ema,
        progress=progress,
    )  # fmt: skip


def load_frames(cfg: TrainConfig, dataset):
    """(demos, sampler of the training frames, validation frames) of the opened ``dataset``."""
    from vla_core.data import ChunkedDemos, FrameSampler

    demos = ChunkedDemos(dataset, cfg.dataset.cameras or None)
    train_frames, val_frames = split_episodes(demos, cfg.val_episodes, cfg.val_frames)
    sampler = FrameSampler(train_frames, demos.task_index, balanced=cfg.dataset.sampling == "task_balanced")
    return demos, sampler, val_frames


def build_learner(cfg: TrainConfig, accelerator, demos, dataset, max_delay: int, frames: torch.Tensor):
    """(prepared policy, raw policy, trainable parameters, optimizer, LR scheduler, EMA or None), the
    weights initialized from ``cfg.seed``, fitted to the training ``frames``."""
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    torch.manual_seed(cfg.seed)  # weight initialization; the same seed builds the same network
    policy = build_policy(cfg, demos, dataset, max_delay, frames)
    # Frozen parameters (e.g. fixed encoder towers) need neither optimizer state nor an EMA copy.
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(
        cfg.lr_schedule, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.steps
    )
    policy, optimizer = accelerator.prepare(policy, optimizer)
    raw_policy = accelerator.unwrap_model(policy)
    # diffusers' EMA of the trainable weights. min_decay = decay keeps the decay constant after the
    # first step (diffusers' default warm-up would average over far fewer steps early on); at the
    # first step the EMA takes the weights as they are.
    ema = EMAModel(trainable, decay=cfg.ema_decay, min_decay=cfg.ema_decay) if cfg.ema_decay > 0 else None
    return policy, raw_policy, trainable, optimizer, scheduler, ema


def resume(run: Run) -> None:
    """Load ``run.resume_from``: weights, optimizer, schedule, EMA, every RNG and ``run.progress``; this
    run's ``--lr`` and ``--ema_decay`` take over from the saved ones."""
    cfg, accelerator, ema, optimizer, scheduler = run.cfg, run.accelerator, run.ema, run.optimizer, run.scheduler
    ckpt = run.resume_from
    accelerator.load_state(str(ckpt / TRAINING_STATE_DIR))
    run.raw_policy.load_assets(ckpt / POLICY_DIR)  # what it fitted on the data (a tokenizer), as it was saved
    was = run.progress.load(ckpt / TRAINING_STATE_DIR, accelerator.process_index)
    if ema is not None:
        ema.to(accelerator.device)  # accelerate loads registered objects onto the CPU
        if ema.decay != cfg.ema_decay and accelerator.is_main_process:
            print(f"--ema_decay={cfg.ema_decay:g} (the checkpoint ran at {ema.decay:g}): the EMA continues "
                  f"with the new decay", file=sys.stderr)  # fmt: skip
        ema.decay = ema.min_decay = cfg.ema_decay
    # The schedule continues with this run's --lr as its peak: lowering --lr on resume is the fix
    # the non-finite-loss stop names, and the loaded states would otherwise keep the old one.
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, lr_at in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"], group["lr"] = cfg.lr, cfg.lr * lr_at(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    if was != cfg.lr and accelerator.is_main_process:
        print(f"--lr={cfg.lr:g} (the checkpoint ran at {was:g}): the schedule continues from the new peak",
              file=sys.stderr)  # fmt: skip
    if accelerator.is_main_process:
        print(f"resumed from {ckpt} at step {run.progress.step}", file=sys.stderr)


def start_logging(run: Run) -> None:
    """Start the trackers and write ``train_config.json``; note which step is on disk already."""
    cfg = run.cfg
    if run.trackers:
        run.accelerator.init_trackers("train", config=flat_dict(config_dict(cfg)))
    run.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run.out / "train_config.json", json.dumps(config_dict(cfg), indent=2))
    run.saved_step = run.progress.step if cfg.resume else None


def train_steps(run: Run, frames_per_step: int, bar) -> int:
    """Step from ``run.progress.step`` to ``cfg.steps`` (or to the validation target), logging, validating and
    checkpointing on their periods; returns the step reached. A stop signal ends it at a step boundary
    with a checkpoint there (re-raised as KeyboardInterrupt)."""
    cfg, accelerator, progress = run.cfg, run.accelerator, run.progress
    step = progress.step
    try:
        while step < cfg.steps:
            step_start = time.perf_counter()
            loss = train_step(run, frames_per_step, step)
            step += 1
            progress.train_seconds += time.perf_counter() - step_start
            progress.loss_window.append(loss.item())
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.steps:
                log_loss(run, step, bar)
            if len(run.val_frames) and (step % cfg.val_every == 0 or step == cfg.steps) and validate(run, step):
                bar.set_postfix(val_loss=f"{progress.val_history[-1][2]:.4f}", stop="target reached")
                break
            if step % cfg.save_every == 0 and step < cfg.steps:
                checkpoint(run, step)
            stop_if_signalled(accelerator)
    except KeyboardInterrupt:
        bar.close()
        path = checkpoint(run, step)
        if accelerator.is_main_process:
            print(
                f"\ninterrupted at step {step}; checkpoint written to {path}. Continue with --resume=true",
                file=sys.stderr,
            )
        raise
    bar.close()
    return step


def train_step(run: Run, frames_per_step: int, step: int) -> torch.Tensor:
    """One optimizer step on a freshly drawn batch (image shifts, delay augmentation); returns its loss."""
    cfg, accelerator, generator = run.cfg, run.accelerator, run.progress.generator
    device, config, max_delay = accelerator.device, run.raw_policy.config, run.delay.max_steps
    idx = run.sampler.sample(frames_per_step, generator)
    batch = run.demos.batch(idx, config.horizon)
    for key in [k for k in batch if k.startswith(OBS_IMAGES)]:
        batch[key] = random_shift(batch[key], config.crop_shift, generator)
    if max_delay:
        batch = with_delay_augmentation(batch, run.delay.sample(frames_per_step), max_delay)
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    policy = run.policy
    policy.train()
    loss = policy(batch, generator, copies=cfg.l2_copies)  # forward() is the training loss, so DDP syncs gradients
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"loss became {loss.item()} at step {step}; lower --lr and --resume=true")
    run.optimizer.zero_grad(set_to_none=True)
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(policy.parameters(), 1.0)
    run.optimizer.step()
    run.scheduler.step()
    if run.ema is not None:
        run.ema.step(run.trainable)
    return loss


def log_loss(run: Run, step: int, bar) -> None:
    """The mean loss since the last log step joins the loss curve (and the trackers)."""
    progress, scheduler = run.progress, run.scheduler
    mean = sum(progress.loss_window) / len(progress.loss_window)
    progress.history.append([step, mean])
    progress.loss_window = []
    bar.set_postfix(loss=f"{mean:.4f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
    if run.trackers:
        run.accelerator.log({"loss": mean, "lr": scheduler.get_last_lr()[0]}, step=step)


def stop_if_signalled(accelerator) -> None:
    """The step boundary: model, optimizer and RNG agree here, so a noted stop signal is raised here."""
    # With several processes all stop at the same step, or the ones that got no signal would wait in
    # DDP's all-reduce forever.
    if accelerator.num_processes > 1:
        noted = torch.tensor([float(interrupt.received() is not None)], device=accelerator.device)
        if accelerator.reduce(noted, reduction="max").item():
            raise interrupt.Interrupted(interrupt.received() or signal.SIGTERM)
    interrupt.raise_if_stopped()


@contextlib.contextmanager
def ema_weights(run: Run):
    """Inside, the policy holds the EMA weights (when EMA is on): what checkpoints and validation use."""
    ema, trainable = run.ema, run.trainable
    if ema is None:
        yield
        return
    ema.store(trainable)
    ema.copy_to(trainable)
    try:
        yield
    finally:
        ema.restore(trainable)


def validate(run: Run, step: int) -> bool:
    """Log the validation loss (EMA weights when EMA is on); True when it reached the stopping target."""
    cfg, raw_policy, progress = run.cfg, run.raw_policy, run.progress
    with ema_weights(run):
        loss = validation_loss(raw_policy, run.demos, run.val_frames, raw_policy.config.horizon, delays=run.val_delays)
    progress.val_history.append([step, round(progress.train_seconds, 3), loss])
    if run.trackers:
        run.accelerator.log({"val_loss": loss}, step=step)
    return cfg.stop_at_val_loss > 0 and reached_target(progress.val_history, cfg.stop_at_val_loss,
                                                       max(1, cfg.stop_consecutive)) is not None  # fmt: skip


def reached_target(val_curve: list, target: float, consecutive: int = 1) -> int | None:
    """The index in ``val_curve`` ([step, seconds, loss] rows) of the first of ``consecutive`` validations in a
    row at or below ``target``: where a run reached it; None if it never did."""
    run = 0
    for i, (_, _, loss) in enumerate(val_curve):
        run = run + 1 if loss <= target else 0
        if run == consecutive:
            return i - consecutive + 1
    return None


def checkpoint(run: Run, at_step: int) -> Path | None:
    """Every process takes part (accelerate writes each one's RNG); the main one commits."""
    cfg, accelerator, progress, ckpt_dir = run.cfg, run.accelerator, run.progress, run.ckpt_dir
    if at_step == run.saved_step:  # already on disk: rewriting would briefly remove it
        return resolve_checkpoint(ckpt_dir)
    progress.step = at_step
    generators = progress.gather_generators(accelerator)
    if accelerator.is_main_process:
        begin_checkpoint(ckpt_dir, at_step)
    accelerator.wait_for_everyone()
    tmp = temporary_checkpoint_dir(ckpt_dir, at_step)
    accelerator.save_state(str(tmp / TRAINING_STATE_DIR))
    path = None
    if accelerator.is_main_process:
        progress.save(tmp / TRAINING_STATE_DIR, lr=cfg.lr, generators=generators)
        meta = {"step": at_step, "dataset": str(cfg.dataset.root), "dataset_frames": len(run.demos),
                "train_config": config_dict(cfg)}  # fmt: skip
        with ema_weights(run):
            write_policy(tmp, run.raw_policy, meta)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        path = commit_checkpoint(ckpt_dir, tmp, at_step)
    run.saved_step = at_step
    return path


def finish(run: Run, step: int, start: float) -> dict:
    """The final checkpoint, then the summary (written as ``train_summary.json``) and the loss plot."""
    accelerator, progress = run.accelerator, run.progress
    final = checkpoint(run, step)
    if run.trackers:
        accelerator.end_training()
    summary = {
        "checkpoint": str(final),
        "steps": step,
        "final_loss": progress.history[-1][1] if progress.history else None,
        "loss_curve": progress.history,
        "val_curve": progress.val_history,  # [step, training seconds, validation loss]
        "train_seconds": round(progress.train_seconds, 2),
        "seconds_this_run": round(time.time() - start, 1),
        "dataset_frames": len(run.demos),
        "dataset_episodes": run.dataset.num_episodes,
        **run.raw_policy.training_report(),  # e.g. an autoregressive policy's clipped action values
    }
    if accelerator.is_main_process:
        write_text_atomic(run.out / "train_summary.json", json.dumps(summary, indent=2))
        _plot_loss(progress.history, run.out / "loss.png")
    return summary


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
    tmp = temporary_beside(path)
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    plt.close(fig)
