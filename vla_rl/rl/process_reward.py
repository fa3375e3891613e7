"""VLA-RL's robotic process reward: a progress estimator Phi(o) in [0, 1] and the dense reward it adds to RL.

The model (`ProgressModel`) reads one observation as a policy sees it: ``observation.state`` normalized with
its dataset's statistics, the instruction's words (a bag of words over the vocabulary of its dataset's
instructions) and, optionally, one camera through the small keypoint CNN of `policies.keypoints`.
``vla-rl train-prm`` (`vla_rl.train_prm`) fits it on demonstrations: frame t of a successful episode of T
frames is labelled t / (T - 1), and every frame of a failed one (where the dataset says so) 0, since that
episode never got to success; the loss is binary cross-entropy against those soft labels. It is saved as a
directory of ``config.json`` and ``model.safetensors``.

Shaping (``vla-rl finetune --reward.process_model=DIR --reward.process_weight=w``). The rollout's decisions
are chunks (`vla_rl.rl.rollout`): decision i of an episode is requested at observation o_i, runs steps_i
control steps until the next request's observation o_{i+1}, earns the env's sparse reward R_i (summed with
gamma per control step) and its next value is worth g_i = gamma^steps_i. Potential-based shaping (Ng,
Harada and Russell 1999) adds

    F_i  = g_i Phi(o_{i+1}) - Phi(o_i)          R'_i = R_i + w F_i
    Phi(o_{i+1}) = 0 when decision i ended its episode (success, failure, time limit or divergence)

Over an episode's decisions, discounted as GAE discounts them (decision i by gamma^{t_i}, t_i its start
step), the terms telescope:

    sum_i gamma^{t_i} R'_i = sum_i gamma^{t_i} R_i - w Phi(o_0)

so every episode's shaped return is its sparse return less a function of its first observation alone:
every policy is ranked as before and the optimal policy is unchanged; the model only moves credit earlier,
to the decisions that made progress. Why 0 at the end rather than Phi of the final observation: with
Phi(o_T) the return would gain w gamma^T Phi(o_T), a reward for *where an episode stops*. A failed episode
that stops in a state the learned model overrates (an empty gripper held high) would then earn it, and RL
would learn to fool the model instead of to succeed. Zero at every end is also what the episodic proof
needs (Grzes 2017), and matches how PPO treats an episode at its time limit (no bootstrap, `vla_rl.rl.ppo`).

Only PPO reads per-decision rewards; GRPO's advantage is each episode's success against its group's, and
its group shares one initial state, so shaping would add the same -w Phi(o_0) to every member: nothing.
``--reward.process_model`` is refused under ``--algo=grpo``. The shaping reads only the observations the
rollout recorded, so it works for any policy kind and for local or Ray rollouts alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from policies.keypoints import ImageEncoder
from policies.tokenizer import PAD_WORD, UNKNOWN_WORD, words
from vla_core.types import OBS_IMAGES, OBS_STATE, TASK
from vla_rl.rl.rollout import select_rows

MODEL_TYPE = "vla_rl_progress"  # config.json's "type", so a policy directory given by mistake is named as such
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclass
class RewardConfig:
    """Rewards added to the env's sparse success reward during RL fine-tuning."""

    # A process reward model (a `vla-rl train-prm` output directory) whose progress estimate Phi shapes
    # every chunk decision's reward: + w (gamma^steps Phi(next observation) - Phi(observation)), Phi = 0 at
    # an episode's end, so the optimal policy is unchanged (`vla_rl.rl.process_reward`). PPO only. "" = none.
    process_model: str = ""
    process_weight: float = 1.0  # w, the weight of the shaping term (success is worth 1)

    def validate(self, algo: str) -> None:
        if not self.process_model:
            if self.process_weight != RewardConfig().process_weight:
                raise ValueError(
                    "--reward.process_weight does nothing without --reward.process_model=<vla-rl train-prm output>"
                )
            return
        if not 0 < self.process_weight < float("inf"):
            raise ValueError(f"--reward.process_weight={self.process_weight} must be a finite number > 0")
        if algo != "ppo":
            raise ValueError(
                "--reward.process_model shapes PPO's per-decision rewards; GRPO compares whole episodes from one "
                "initial state by success, where the shaping adds the same constant to every episode of a group "
                "and changes nothing: use --algo=ppo, or drop --reward.process_model"
            )


@dataclass
class ProgressModelConfig:
    """What a `ProgressModel` reads and its size; saved as its ``config.json``."""

    state_dim: int
    vocabulary: list[str]  # the words of its instructions, ids 0 and 1 padding and unknown (`policies.tokenizer`)
    tasks: list[str] = field(default_factory=list)  # the instructions it was trained on
    camera: str = ""  # the one camera it reads through a small CNN; "" = state and instruction only
    image_size: int = 0  # that camera's square image side (pixels)
    hidden_dim: int = 128
    text_dim: int = 32
    vision_channels: int = 16  # a multiple of 8 (the CNN's group norm)
    num_keypoints: int = 16
    dataset: str = ""  # the dataset it was trained on, for the record


class ProgressModel(nn.Module):
    """Phi: an observation batch (``observation.state`` (B, S), ``task`` B strings and, with a camera,
    ``observation.images.<camera>`` (B, 3, H, W) in [0, 1]) -> (B,) logits; ``progress`` is their sigmoid."""

    def __init__(self, config: ProgressModelConfig):
        super().__init__()
        c = self.config = config
        if c.vocabulary[:2] != [PAD_WORD, UNKNOWN_WORD]:
            raise ValueError(
                "the vocabulary must start with <pad>, <unk>; build it with policies.tokenizer.word_vocabulary"
            )
        self.register_buffer("state_mean", torch.zeros(c.state_dim))
        self.register_buffer("state_std", torch.ones(c.state_dim))
        self.index = {w: i for i, w in enumerate(c.vocabulary)}
        self.words = nn.EmbeddingBag(len(c.vocabulary), c.text_dim, mode="mean")
        self.image = ImageEncoder(c.vision_channels, c.num_keypoints) if c.camera else None
        width = c.state_dim + c.text_dim + (2 * c.num_keypoints if c.camera else 0)
        self.head = nn.Sequential(
            nn.Linear(width, c.hidden_dim), nn.Mish(), nn.Linear(c.hidden_dim, c.hidden_dim), nn.Mish(),
            nn.Linear(c.hidden_dim, 1),
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.state_mean.device

    def set_normalization(self, mean, std) -> None:
        """The dataset's ``observation.state`` statistics; near-constant dimensions guarded as the policies do."""
        self.state_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.state_std.copy_(torch.as_tensor(std, dtype=torch.float32).clamp_min(1e-3))

    def encode_instructions(self, instructions: list[str]) -> torch.Tensor:
        """B instruction strings -> (B, text_dim): the mean embedding of their words (unknown words: id 1)."""
        unique = sorted(set(instructions))
        bags = [torch.tensor([self.index.get(w, 1) for w in words(t)] or [1]) for t in unique]
        offsets = torch.tensor([0] + [len(b) for b in bags[:-1]]).cumsum(0)
        encoded = self.words(torch.cat(bags).to(self.device), offsets.to(self.device))  # (U, text_dim)
        row = {t: i for i, t in enumerate(unique)}
        return encoded[torch.tensor([row[t] for t in instructions], device=self.device)]

    def forward(self, obs: dict[str, Any]) -> torch.Tensor:
        state = (obs[OBS_STATE].to(self.device, torch.float32) - self.state_mean) / self.state_std
        parts = [state, self.encode_instructions(list(obs[TASK]))]
        if self.image is not None:
            parts.append(self.image(obs[f"{OBS_IMAGES}.{self.config.camera}"].to(self.device, torch.float32)))
        return self.head(torch.cat(parts, -1)).squeeze(-1)

    @torch.no_grad()
    def progress(self, obs: dict[str, Any], batch_size: int = 256) -> torch.Tensor:
        """(B,) Phi(o) in [0, 1] on the CPU, in batches of ``batch_size``."""
        reads = [OBS_STATE, TASK] + [f"{OBS_IMAGES}.{self.config.camera}"] * bool(self.config.camera)
        obs = {k: obs[k] for k in reads}  # not the rest (other cameras, the delay augmentation) batch by batch
        n = len(obs[OBS_STATE])
        out = [torch.zeros(0)]
        for start in range(0, n, batch_size):
            rows = torch.arange(start, min(start + batch_size, n))
            out.append(torch.sigmoid(self(select_rows(obs, rows))).float().cpu())
        return torch.cat(out)

    def save(self, directory: Path) -> None:
        """``config.json`` and ``model.safetensors`` into ``directory`` (made if missing)."""
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(directory / WEIGHTS_FILE)
        )
        (directory / CONFIG_FILE).write_text(json.dumps({"type": MODEL_TYPE, **asdict(self.config)}, indent=2))

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu") -> ProgressModel:
        """The model saved in ``directory``, in eval mode on ``device``; one line naming the fix when there is none."""
        directory = Path(directory)
        fix = f"train one with `vla-rl train-prm --dataset.root=<demonstrations> --output_dir={directory}`"
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(
                f"no process reward model at {directory} (missing {CONFIG_FILE} or {WEIGHTS_FILE}); {fix}"
            )
        saved = json.loads((directory / CONFIG_FILE).read_text())
        kind = saved.pop("type", None)
        if kind != MODEL_TYPE:
            raise ValueError(f"{directory} holds a {kind!r} model, not a process reward model; {fix}")
        model = cls(ProgressModelConfig(**saved))
        model.load_state_dict(load_file(str(directory / WEIGHTS_FILE)))
        return model.to(device).eval()


def next_in_episode(world: torch.Tensor, episode: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """(M,) bool: decision i's episode goes on to decision i + 1 (the next row is the same world and episode,
    and decision i did not end it). Rows grouped by world and episode, in order, as `collect` returns them."""
    same = torch.zeros_like(done, dtype=torch.bool)
    same[:-1] = (world[1:] == world[:-1]) & (episode[1:] == episode[:-1])
    return same & ~done.bool()


def potential_shaping(potential: torch.Tensor, discount: torch.Tensor, going_on: torch.Tensor) -> torch.Tensor:
    """(M,) F_i = g_i Phi(o_{i+1}) - Phi(o_i), with Phi(o_{i+1}) = 0 where the episode ended (see the module
    docstring). potential: (M,) Phi(o_i); discount: (M,) g_i = gamma^steps_i; going_on: (M,) bool,
    `next_in_episode`."""
    following = torch.zeros_like(potential)
    following[:-1] = potential[1:]
    return discount * torch.where(going_on, following, torch.zeros_like(following)) - potential


class ProcessReward:
    """The dense reward of ``--reward.process_model``: ``shape`` adds w F_i to each decision's reward."""

    def __init__(self, model: ProgressModel, weight: float, directory: str):
        self.model, self.weight, self.directory = model, weight, directory

    def shape(self, rollout, processes=None) -> dict[str, float]:
        """Replace ``rollout.reward`` (a `vla_rl.rl.rollout.Rollout`) by R + w F; returns what the history records:
        the mean shaping term w F and the mean progress Phi per decision (over every process of a data-parallel
        run, `vla_rl.rl.update.Processes`)."""
        potential = self.model.progress(rollout.obs) if len(rollout) else torch.zeros(0)
        going_on = next_in_episode(rollout.world, rollout.episode, rollout.done)
        shaping = self.weight * potential_shaping(potential, rollout.discount, going_on)
        rollout.reward = rollout.reward + shaping
        parts = [(float(shaping.sum()), float(potential.sum()), len(rollout))]
        if processes is not None and processes.count > 1:
            parts = processes.gather(parts[0])
        n = max(1, sum(p[2] for p in parts))
        return {"process_reward_mean": sum(p[0] for p in parts) / n, "progress_mean": sum(p[1] for p in parts) / n}


def load_process_reward(cfg: RewardConfig, envs: list, env_cfgs: list, device) -> ProcessReward | None:
    """The run's process reward (None without ``--reward.process_model``), checked against every env of the
    run: its state size, its instructions' words, the camera and image size it reads."""
    if not cfg.process_model:
        return None
    model = ProgressModel.load(cfg.process_model, device)
    c = model.config
    retrain = "train one on this task's demonstrations (vla-rl train-prm) or drop --reward.process_model"
    for env, env_cfg in zip(envs, env_cfgs, strict=True):
        state_dim = env.features[OBS_STATE]["shape"][0]
        if state_dim != c.state_dim:
            raise ValueError(
                f"the process reward model {cfg.process_model} reads a {c.state_dim}-dim state but env {env_cfg.task!r} "
                f"has {state_dim}; {retrain}"
            )
        unknown = sorted({w for text in env.reset(seed=0)[TASK] for w in words(text)} - set(c.vocabulary))
        if unknown:
            raise ValueError(
                f"the process reward model {cfg.process_model} was not trained on {env_cfg.task!r}: its instruction "
                f"has words it never read ({', '.join(unknown)}); {retrain}"
            )
        if c.camera and (c.camera not in env_cfg.cameras or c.image_size != env_cfg.image_size):
            raise ValueError(
                f"the process reward model {cfg.process_model} reads camera {c.camera!r} at {c.image_size}px but the env "
                f"renders {list(env_cfg.cameras)} at {env_cfg.image_size}px; train it on that camera at that size "
                f"(vla-rl train-prm --camera=...), or with --camera='' (state and instruction only)"
            )
    return ProcessReward(model, cfg.process_weight, cfg.process_model)


def check_resumed_reward(out: Path, cfg: RewardConfig) -> None:
    """A resumed run keeps the rewards it started with (``finetune_config.json``'s ``reward``; none before it
    existed): one line naming the flags to resume with."""
    path = out / "finetune_config.json"
    if not path.is_file():
        return
    saved = {**asdict(RewardConfig()), **json.loads(path.read_text()).get("reward", {})}
    same_model = (
        Path(saved["process_model"]).resolve() == Path(cfg.process_model).resolve()
        if saved["process_model"] and cfg.process_model
        else saved["process_model"] == cfg.process_model
    )
    if not same_model or saved["process_weight"] != cfg.process_weight:
        flags = f"--reward.process_model={saved['process_model']} --reward.process_weight={saved['process_weight']}"
        raise ValueError(
            f"the run in {out} was shaped with {flags if saved['process_model'] else 'no process reward'}; resume it "
            f"with {flags if saved['process_model'] else 'no --reward.* flags'}, or start a new --output_dir"
        )
