"""`vla-rl pretrain-encoder`: SigLIP-style vision and text towers pretrained on the suite's scenes, written with
`transformers`' ``save_pretrained`` (a `SiglipModel` and its tokenizer in one folder), so
``--policy.pretrained_encoder=DIR`` loads them exactly as it loads ``google/siglip-*``.

The objective, and why: a policy on frozen towers needs two things from them, where the objects are and which
task it is. So the vision tower learns to regress, from one camera image, the end effector's position and the
task's object (its first privileged position: the cube, the reach or track ball, the drawer's handle), and to
tell the six tasks apart; the text tower learns to tell the tasks apart from the instruction. Privileged
positions cost nothing in simulation and teach localization directly, which imitation with trainable towers
teaches only through the actions (slowly: the Level-2 benchmark's trained-tower runs), and contrastive
image-instruction pairs cannot (every image of a task has the same instruction).

Data: for each task, ``images_per_task`` frames of its worlds from seeded resets, each after 0-15 control steps
of random end-effector targets in the arm's workspace (so the arm is seen away from home), with the privileged
positions of that frame. A seeded ``probe_fraction`` of frames is held out.

The probe: ridge regression (closed form) from the frozen towers' mean-pooled patch features to the task
object's position on the held-out frames, error in cm (over all held-out frames and per task), against the same
probe on towers with random weights.

Optimization: AdamW, linear warmup over 5% of the steps, then a cosine decay to zero.

Output (``output_dir``): config.json and model.safetensors (the `SiglipModel`), the tokenizer's files,
``pretrain_summary.json`` (losses, probe errors, seconds), each written atomically into a temporary folder
that replaces the output at the end. A finished output of the same config is reused.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from sim.config import EnvConfig

SUITE = ["lift", "reach", "push", "pick_place", "stack", "open_drawer"]


@dataclass
class PretrainEncoderConfig:
    """Pretrain SigLIP-style towers on the suite's scenes (object and end-effector positions, task identity)."""

    tasks: list[str] = field(default_factory=lambda: list(SUITE))
    images_per_task: int = 2000
    image_size: int = 64
    camera: str = "front"
    # The Level-2 benchmark's ``base`` encoder size: 8 layers of 384 (its ``xlarge``) take about 5.5 s a step at
    # batch 64 on one of our cores, 4.5 hours for 3,000 steps.
    vision_width: int = 192
    vision_layers: int = 4
    text_width: int = 96
    text_layers: int = 2
    patch_size: int = 8
    heads: int = 4
    steps: int = 4000
    batch_size: int = 64
    lr: float = 3e-4
    probe_fraction: float = 0.1
    seed: int = 0
    num_envs: int = 16
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    output_dir: str = "outputs/encoders/suite_siglip"


def pretrain_encoder(cfg: PretrainEncoderConfig) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    summary_file = out / "pretrain_summary.json"
    if summary_file.exists() and json.loads(summary_file.read_text())["config"] == asdict(cfg):
        return json.loads(summary_file.read_text())  # cached: the benchmarks reuse it
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    start = time.time()
    torch.manual_seed(cfg.seed)
    images, targets, task_ids, instructions = collect_frames(cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    held = torch.randperm(len(images), generator=generator)[: max(1, int(len(images) * cfg.probe_fraction))]
    train_rows = torch.ones(len(images), dtype=torch.bool)
    train_rows[held] = False
    tokenizer = build_tokenizer(instructions)
    model = build_towers(cfg, tokenizer)
    random_probe = probe_cm(model, images[train_rows], targets[train_rows], images[held], targets[held])
    heads = nn.ModuleDict({"position": nn.Linear(cfg.vision_width, 6), "task_image": nn.Linear(cfg.vision_width, len(SUITE)),
                           "task_text": nn.Linear(cfg.text_width, len(SUITE))})  # fmt: skip
    text_ids = tokenizer(instructions, padding="max_length", max_length=16, return_tensors="pt")["input_ids"]
    losses = train_towers(cfg, model, heads, images[train_rows], targets[train_rows], task_ids[train_rows], text_ids,
                          generator)  # fmt: skip
    trained_errors = probe_errors_cm(model, images[train_rows], targets[train_rows], images[held], targets[held])
    held_tasks = task_ids[held]
    per_task = {task: round(float(trained_errors[held_tasks == SUITE.index(task)].mean()), 2)
                for task in cfg.tasks if (held_tasks == SUITE.index(task)).any()}  # fmt: skip
    summary = {
        "config": asdict(cfg), "frames": len(images), "held_out": len(held),
        "loss": {"first": round(losses[0], 5), "last": round(losses[-1], 5)},
        "probe_error_cm": {"pretrained": round(float(trained_errors.mean()), 2), "random_towers": round(random_probe, 2),
                           "pretrained_per_task": per_task},
        "seconds": round(time.time() - start, 1),
    }  # fmt: skip
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "pretrain_summary.json").write_text(json.dumps(summary, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return summary


def collect_frames(cfg: PretrainEncoderConfig):
    """(images (N, 3, S, S) float [0, 1], targets (N, 6): end effector then the task's object, metres, task ids
    (N,) into SUITE, the tasks' instructions in SUITE order)."""
    from sim.factory import make_env
    from sim.tasks import get_task

    rng = np.random.default_rng(cfg.seed)
    images, targets, task_ids = [], [], []
    for task in cfg.tasks:
        env_cfg = EnvConfig(task=task, num_envs=cfg.num_envs, image_size=cfg.image_size, cameras=[cfg.camera])
        with make_env(env_cfg) as env:
            got, seed = 0, cfg.seed * 1000
            with tqdm(total=cfg.images_per_task, desc=f"frames {task}", unit="img") as bar:
                while got < cfg.images_per_task:
                    obs = env.reset(seed=seed)
                    seed += 1
                    for _ in range(int(rng.integers(0, 16))):  # random targets: the arm away from home
                        low, high = env.ACTION_LOW, env.ACTION_HIGH
                        obs = env.step(torch.from_numpy(rng.uniform(low, high, size=(env.num_envs, 4))).float())[0]
                    objects = next(iter(env.privileged_state().values()))  # (N, 3) the task's object
                    take = min(env.num_envs, cfg.images_per_task - got)
                    images.append(obs[f"observation.images.{cfg.camera}"][:take])
                    ee = obs["observation.state"][:take, -3:].double().numpy()
                    targets.append(torch.from_numpy(np.concatenate([ee, objects[:take]], axis=1)).float())
                    task_ids.append(torch.full((take,), SUITE.index(task)))
                    got += take
                    bar.update(take)
    instructions = [get_task(t).instruction for t in SUITE]
    return torch.cat(images), torch.cat(targets), torch.cat(task_ids), instructions


def build_tokenizer(instructions: list[str]):
    """A word-level tokenizer over the instructions' words (with [PAD] and [UNK]), as a `transformers` fast
    tokenizer: ``AutoTokenizer.from_pretrained`` reads it back."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for text in instructions for w in text.lower().split()})
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                                   model_input_names=["input_ids"])  # fmt: skip


def build_towers(cfg: PretrainEncoderConfig, tokenizer):
    """A `SiglipModel` of the config's sizes (random weights), its text vocabulary the tokenizer's."""
    from transformers import SiglipConfig, SiglipModel

    vision = {"hidden_size": cfg.vision_width, "intermediate_size": 4 * cfg.vision_width,
              "num_hidden_layers": cfg.vision_layers, "num_attention_heads": cfg.heads, "image_size": cfg.image_size,
              "patch_size": cfg.patch_size}  # fmt: skip
    text = {"vocab_size": len(tokenizer), "hidden_size": cfg.text_width, "intermediate_size": 4 * cfg.text_width,
            "num_hidden_layers": cfg.text_layers, "num_attention_heads": cfg.heads, "max_position_embeddings": 64,
            "pad_token_id": tokenizer.pad_token_id, "projection_size": cfg.text_width}  # fmt: skip
    return SiglipModel(SiglipConfig(text_config=text, vision_config=vision))


def features(model, images: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """(N, vision_width) mean-pooled patch features of images in [0, 1] (SigLIP's [-1, 1] range inside)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(images), batch):
            hidden = model.vision_model(pixel_values=images[i : i + batch] * 2 - 1).last_hidden_state
            out.append(hidden.mean(1))
    return torch.cat(out)


def probe_cm(model, train_images, train_targets, test_images, test_targets, ridge: float = 1e-2) -> float:
    """Mean Euclidean error (cm) of a ridge regression from frozen features to the task object's position."""
    return float(probe_errors_cm(model, train_images, train_targets, test_images, test_targets, ridge).mean())


def probe_errors_cm(model, train_images, train_targets, test_images, test_targets, ridge: float = 1e-2):
    """(N_test,) Euclidean errors (cm) of the ridge probe of `probe_cm`, one per test frame."""
    x, z = features(model, train_images).double(), features(model, test_images).double()
    mean, std = x.mean(0), x.std(0) + 1e-6
    x, z = (x - mean) / std, (z - mean) / std
    x1, z1 = (
        torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1),
        torch.cat([z, torch.ones(len(z), 1, dtype=z.dtype)], 1),
    )
    y = train_targets[:, 3:].double()
    weights = torch.linalg.solve(x1.T @ x1 + ridge * len(x1) * torch.eye(x1.shape[1], dtype=x.dtype), x1.T @ y)
    return (z1 @ weights - test_targets[:, 3:].double()).norm(dim=1) * 100


def train_towers(cfg: PretrainEncoderConfig, model, heads: nn.ModuleDict, images, targets, task_ids, text_ids,
                 generator: torch.Generator) -> list[float]:  # fmt: skip
    """The objective of the module docstring: MSE of the positions (normalized per dimension) + cross-entropy of the
    task from the image and from its instruction. Returns the loss per step."""
    params = [*model.vision_model.parameters(), *model.text_model.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    # Linear warmup, then cosine to zero: the last steps at a small rate settle the positions' fine digits.
    warmup = max(1, cfg.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, step / cfg.steps))))  # fmt: skip
    mean, std = targets.mean(0), targets.std(0) + 1e-6
    losses = []
    for _ in tqdm(range(cfg.steps), desc="pretrain", unit="step"):
        batch = torch.randint(len(images), (cfg.batch_size,), generator=generator)
        pooled = model.vision_model(pixel_values=images[batch] * 2 - 1).last_hidden_state.mean(1)
        text = model.text_model(input_ids=text_ids[task_ids[batch]]).pooler_output
        loss = (nn.functional.mse_loss(heads["position"](pooled), (targets[batch] - mean) / std)
                + nn.functional.cross_entropy(heads["task_image"](pooled), task_ids[batch])
                + nn.functional.cross_entropy(heads["task_text"](text), task_ids[batch]))  # fmt: skip
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses
