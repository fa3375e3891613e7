"""`vla-rl probe-localization`: can a policy's vision front end find the task's object? The bound to measure before
training a policy on a task (a policy that cannot localize the object from one observation cannot act on it).

Data: ``episodes`` episodes of the task's scripted expert in the batched sim (from ``seed``; every episode, where
`vla-rl record` keeps the successful ones only), every control step a frame: its observation (images and state) and the label,
the task's object (its first privileged position: the cube, the reach or track ball, the drawer's handle) minus the
end effector, in cm. Whole episodes are held out, the last ones, until ``held_out_frames`` frames are.

Each encoder is a policy type at its default config (``encoders``), built fresh for the task (`from_dataset`'s
sizes and normalization, from the training frames), read where its action head reads: the diffusion policy's
observation encoding (its keypoint CNN with the state), the autoregressive VLA's last prompt hidden state (SigLIP
patches, instruction and state through Gemma, what its value head reads). A linear head on that readout regresses
the label, trained end to end with one recipe for all: ``steps`` AdamW steps of ``batch_size`` training frames at
``lr``, images shifted by up to ``shift`` pixels.

An encoder ``frozen:<checkpoint>`` is a trained policy read as it is: its weights frozen, the head alone trained
with the same recipe. It asks what training (imitation, RL) taught the readout, where a fresh encoder asks what the
front end can learn.

Reported per encoder on the held-out frames: the median and mean error (the distance from the label, cm), the RMSE
per axis, beside the same figures for predicting the training frames' mean. ``localization.json`` is written after
each encoder (atomically); a rerun with the same config reuses the finished ones. The final line is
``localization_cm <encoder>=<median error> ... mean_baseline=<median error>`` (an encoder's settings written
``type:field-value`` there).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sim.config import EnvConfig
from vla_core.files import write_text_atomic
from vla_core.types import ACTION, OBS_STATE, TASK


@dataclass
class ProbeLocalizationConfig:
    """Regress the task's object relative to the end effector from one observation, through each policy type's vision
    front end: the median error on held-out expert frames, against predicting the mean."""

    env: EnvConfig = field(default_factory=lambda: EnvConfig(task="track", num_envs=25))
    # policy types at their default config, or with fields set: "autoregressive_vla:vision=keypoints,layers=4";
    # or a trained checkpoint read frozen, its head alone trained: "frozen:outputs/track/ar/checkpoints/last"
    encoders: list[str] = field(default_factory=lambda: ["diffusion", "autoregressive_vla"])
    episodes: int = 260  # expert episodes (every control step a frame)
    held_out_frames: int = 1500  # the last episodes' frames, at least this many
    seed: int = 0  # of the expert episodes' initial states
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-4
    shift: int = 4  # image shift augmentation, pixels
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    output_dir: str = "outputs/probe_localization"


def probe_localization(cfg: ProbeLocalizationConfig) -> dict[str, Any]:
    """Run the probe of the module docstring; returns (and writes as ``localization.json``) its report."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.episodes < 2 or cfg.held_out_frames < 1:
        raise ValueError("--steps, --batch_size and --held_out_frames must be >= 1 and --episodes >= 2")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report_file = out / "localization.json"
    made_with = {k: v for k, v in asdict(cfg).items() if k not in ("encoders", "num_threads", "output_dir")}
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    if report.get("config", made_with) != made_with:
        raise ValueError(f"{report_file} was written with another config: pass another --output_dir, or delete it")
    report.setdefault("encoders", {})
    frames, features, instruction = collect_frames(cfg)
    held = held_out(frames["episode"], cfg.held_out_frames)
    train, test = {k: v[~held] for k, v in frames.items()}, {k: v[held] for k, v in frames.items()}
    mean = train["label"].mean(0)
    report |= {"config": made_with, "frames": {"train": int((~held).sum()), "held_out": int(held.sum())},
               "mean_baseline": errors_cm(mean.expand_as(test["label"]), test["label"])}  # fmt: skip
    for encoder in cfg.encoders:
        if encoder in report["encoders"]:
            continue
        start = time.time()
        predicted, losses = train_probe(cfg, encoder, train, test, features, instruction)
        report["encoders"][encoder] = {**errors_cm(predicted, test["label"]), "loss_first": round(losses[0], 4),
                                       "loss_last": round(losses[-1], 4), "seconds": round(time.time() - start, 1)}  # fmt: skip
        write_text_atomic(report_file, json.dumps(report, indent=2))
    write_text_atomic(report_file, json.dumps(report, indent=2))
    return report


def collect_frames(cfg: ProbeLocalizationConfig) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(the expert's frames: images per camera key (N, 3, S, S) uint8, state (N, D), action (N, A), label (N, 3) cm,
    episode (N,); the env's LeRobot features; the task's instruction), the first ``episodes`` episodes to end."""
    from sim.factory import make_env
    from sim.tasks import EXPERTS

    columns: dict[str, list] = {}
    with make_env(cfg.env) as env:
        expert = EXPERTS[cfg.env.task](env.num_envs)
        obs = env.reset(seed=cfg.seed)
        features = env.features
        current = list(range(env.num_envs))  # each world's episode number
        started = env.num_envs
        kept: dict[int, list[dict]] = {}
        ended = 0
        with tqdm(total=cfg.episodes, desc="expert frames", unit="ep") as bar:
            while ended < cfg.episodes:
                ee = env.ee_positions()
                target = next(iter(env.privileged_state().values()))  # the task's object
                actions = expert.act(ee, env.privileged_state())
                for i in range(env.num_envs):
                    row = {
                        k: obs[k][i].mul(255).round().to(torch.uint8)
                        for k in obs
                        if k.startswith("observation.images.")
                    }
                    row |= {OBS_STATE: obs[OBS_STATE][i].float(), ACTION: torch.from_numpy(actions[i]).float(),
                            "label": torch.from_numpy((target[i] - ee[i]) * 100).float()}  # fmt: skip
                    kept.setdefault(current[i], []).append(row)
                obs, _, terminated, truncated, _ = env.step(torch.from_numpy(actions))
                done = (terminated | truncated).cpu().numpy()
                for i in np.flatnonzero(done):
                    if ended < cfg.episodes:
                        for row in kept.pop(current[i]):
                            for k, v in row.items():
                                columns.setdefault(k, []).append(v)
                            columns.setdefault("episode", []).append(ended)
                        ended += 1
                        bar.update()
                    else:
                        kept.pop(current[i], None)
                    current[i], started = started, started + 1
                expert.reset(done)
        instruction = obs[TASK][0]
    frames = {k: torch.stack(v) if k != "episode" else torch.tensor(v) for k, v in columns.items()}
    return frames, features, instruction


def held_out(episode: torch.Tensor, frames: int) -> torch.Tensor:
    """(N,) bool: the frames of the last episodes (by number), as few as hold at least ``frames`` frames (at least
    one episode, never all)."""
    numbers = torch.unique(episode)
    for k in range(1, len(numbers)):
        mask = episode >= numbers[-k]
        if int(mask.sum()) >= frames:
            return mask
    return episode >= numbers[1]


def errors_cm(predicted: torch.Tensor, label: torch.Tensor) -> dict[str, Any]:
    """Median and mean of the distance |predicted - label| (N, 3) in cm, and the RMSE per axis."""
    distance = (predicted - label).norm(dim=1)
    rmse = (predicted - label).pow(2).mean(0).sqrt()
    return {"median_cm": round(float(distance.median()), 3), "mean_cm": round(float(distance.mean()), 3),
            "rmse_cm": [round(float(v), 3) for v in rmse]}  # fmt: skip


FROZEN = "frozen:"  # an encoder spec's prefix: a trained checkpoint, read frozen


def encoder_config(spec: str):
    """A policy config from ``type`` or ``type:field=value,...`` (each value read as its field's default's type);
    an unknown type or field is refused, naming the choices."""
    from dataclasses import fields

    from policies import PolicyConfig

    kind, _, settings = spec.partition(":")
    try:
        config = PolicyConfig.get_choice_class(kind)()
    except KeyError:
        raise ValueError(f"--encoders: unknown policy type {kind!r} in {spec!r}; one of "
                         f"{sorted(PolicyConfig.get_known_choices())}") from None  # fmt: skip
    known = {f.name for f in fields(config)}
    for setting in filter(None, settings.split(",")):
        name, _, value = setting.partition("=")
        if name not in known:
            raise ValueError(f"--encoders: {kind} has no field {name!r} (in {spec!r})")
        kind_of = type(getattr(config, name))
        if kind_of not in (int, float, str, bool):
            raise ValueError(f"--encoders: {kind}.{name} is not a number, a string or a flag; only those are set here")
        setattr(config, name, value.lower() in ("1", "true") if kind_of is bool else kind_of(value))
    config.validate()
    return config


def readout(policy):
    """What the policy's action head reads of an observation, (B, F): the autoregressive VLA's last prompt hidden
    state (`prefix_features`), or an encoder's observation encoding (`encode_observation`; condition tokens
    (B, L, F) with their mask, the diffusion VLA's, mean-pooled over the unmasked ones)."""
    if hasattr(policy, "prefix_features"):
        return policy.prefix_features
    if not hasattr(policy, "encode_observation"):
        raise ValueError(f"{type(policy).__name__} has no observation readout (prefix_features or encode_observation)")

    def encoded(obs: dict) -> torch.Tensor:
        out = policy.encode_observation(obs)
        if isinstance(out, tuple):  # tokens (B, L, F) and their mask (B, L)
            tokens, mask = out
            weights = mask.to(tokens.dtype).unsqueeze(-1)
            return (tokens * weights).sum(1) / weights.sum(1).clamp(min=1)
        return out

    return encoded


def train_probe(cfg: ProbeLocalizationConfig, encoder: str, train: dict, test: dict, features: dict, instruction: str):
    """(predicted labels of the test frames (M, 3), the loss per step): the policy type ``encoder`` built fresh for
    the env's ``features`` and normalized on the training frames, a linear head on its readout, trained end to end
    (the module docstring's recipe)."""
    from policies import policy_class
    from vla_core.data import random_shift
    from vla_rl.checkpoint import load_policy

    torch.manual_seed(cfg.seed)
    frozen = encoder.startswith(FROZEN)
    if frozen:  # a trained policy, its own normalization and sizes
        policy = load_policy(encoder.removeprefix(FROZEN))[0].requires_grad_(False)
    else:
        pcfg = encoder_config(encoder)
        pcfg.image_size = cfg.env.image_size  # built for the frames' size (the keypoint encoder does not resize)
        pcfg.validate()  # again, at that size
        stats = {OBS_STATE: {"mean": train[OBS_STATE].mean(0), "std": train[OBS_STATE].std(0).clamp(min=1e-6)},
                 ACTION: {"min": train[ACTION].min(0).values, "max": train[ACTION].max(0).values}}  # fmt: skip
        policy = policy_class(pcfg.type).from_dataset(pcfg, features, stats, [instruction])
    read = readout(policy)
    images = [k for k in train if k.startswith("observation.images.")]

    def batch(frames: dict, rows: torch.Tensor, generator: torch.Generator | None = None) -> dict:
        """The observations of ``rows``, images in [0, 1] (shifted when a generator is given)."""
        obs = {k: frames[k][rows].float() / 255 for k in images}
        if generator is not None:
            obs = {k: random_shift(v, cfg.shift, generator) for k, v in obs.items()}
        return obs | {OBS_STATE: frames[OBS_STATE][rows], TASK: [instruction] * len(rows)}

    generator = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        width = read(batch(train, torch.arange(2))).shape[-1]
    head = torch.nn.Linear(width, 3)
    scale = train["label"].std(0).clamp(min=1e-3)  # the head regresses standardized labels
    center = train["label"].mean(0)
    optimizer = torch.optim.AdamW([*([] if frozen else policy.parameters()), *head.parameters()], lr=cfg.lr)
    policy.train(not frozen)
    losses = []
    for _ in tqdm(range(cfg.steps), desc=f"probe {encoder}", unit="step"):
        rows = torch.randint(len(train["label"]), (cfg.batch_size,), generator=generator)
        predicted = head(read(batch(train, rows, generator)))
        loss = (predicted - (train["label"][rows] - center) / scale).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    policy.eval()
    with torch.no_grad():
        predicted = torch.cat([head(read(batch(test, rows))) for rows in torch.arange(len(test["label"])).split(256)])
    return predicted * scale + center, losses


def final_line(report: dict[str, Any]) -> str:
    """``localization_cm <encoder>=<median error> ... mean_baseline=<median error>``."""
    medians = {
        **{k: v["median_cm"] for k, v in report["encoders"].items()},
        "mean_baseline": report["mean_baseline"]["median_cm"],
    }
    # an encoder's own settings read "type:field-value" here, so that each figure is the one "=" of its word
    return "localization_cm " + " ".join(f"{k.replace('=', '-')}={v:.2f}" for k, v in medians.items())
