"""The policy contract's base classes: the config every policy has, and the policy base class.

Layout and format follow LeRobot's: one folder per policy type with ``configuration_<type>.py``
(a ``<Name>Config`` registered under the type name) and ``modeling_<type>.py`` (the sibling
``<Name>Policy``), so the class of a type is found by LeRobot's own naming convention
(:func:`policy_class`). A saved policy is a directory with

- ``config.json``: ``{"type": "vla_rl_<type>", <every config field>}``, as LeRobot writes
  ``config.json``. The type is the name LeRobot knows the policy by: LeRobot has its own
  ``diffusion``, so ours are namespaced (:func:`lerobot_type`). With the ``lerobot_policy_vla_rl``
  plugin installed (``plugins/``), LeRobot's own ``from_pretrained`` loads the directory.
- ``model.safetensors``: the weights, the normalization statistics included (they are buffers);
- ``policy_preprocessor.json`` / ``policy_postprocessor.json``: LeRobot's processors, which only
  batch and move tensors (:func:`lerobot_processors`).

A directory LeRobot wrote (any other ``type``) loads as the ``lerobot`` policy (``policies/lerobot``),
which runs LeRobot's model and processors behind the same contract.

Callers construct a policy in one of two ways: :meth:`PreTrainedPolicy.from_dataset` (training: the
config is completed from a LeRobotDataset's features, tasks and statistics) or
:meth:`PreTrainedPolicy.from_pretrained` (evaluation, serving, fine-tuning).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import draccus
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from policies.denoising_chain import ExplorationNoise
from policies.flow_guidance import DEFAULT_MAX_GUIDANCE
from policies.flow_matching import Objective, check_objective
from policies.low_latency import LowLatencyInputs, LowLatencyPolicy
from policies.normalization import NormalizationMixin
from policies.tokenizer import word_vocabulary
from vla_core.runtime.protocol import DEFAULT_MID_FRACTION, check_mid_fraction
from vla_core.types import ACTION, OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_STATE, ActionChunk, Steer, image_key

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclass
class PolicyConfig(draccus.ChoiceRegistry):
    """Fields every policy has, so training, evaluation and deployment can drive any of them."""

    horizon: int = 16  # action steps predicted per chunk (H)
    # Steps of each chunk executed before the next one is requested: the default of eval and serve
    # when their chunking.execute_steps is 0.
    n_action_steps: int = 8
    image_size: int = 64  # camera image side the policy is built for, pixels
    crop_shift: int = 4  # training augmentation: random image shift of up to this many pixels
    max_text_tokens: int = 16  # instruction tokens kept (longer instructions are cut)
    # The largest inference delay (control steps) the policy was trained with: it reads the delay
    # augmentation's committed actions up to this many chunk steps (training-time RTC). 0 = it does
    # not read the augmentation; `vla-rl train --delay.*` sets it.
    max_delay_steps: int = 0
    # Latency-aware fine-tuning (ARLI; `policies.latency_head`): a fast head reads the committed actions
    # and the mid-inference observation. `vla-rl finetune --latency_aware=true` adds it and sets these.
    latency_aware: bool = False
    latency_max_delay: int = 0  # D: the most committed steps the fast head reads (its fine-tuning's largest delay)
    mid_fraction: float = DEFAULT_MID_FRACTION  # the mid-inference observation is taken this far into the window
    mid_cameras: list[str] = field(default_factory=list)  # the cameras in the mid-inference observation
    # A low-latency part (ARLI's fast policy, `policies.low_latency`) that acts every control step on the freshest
    # observation, correcting the plan. `vla-rl finetune --low_latency=true` adds it and sets these.
    low_latency: bool = False
    low_latency_rows: int = 0  # R: the plan rows it reads
    low_latency_max_age: int = 0  # the scale of its ages: the largest delay it is made for plus a chunk's steps
    low_latency_cameras: list[str] = field(default_factory=list)  # the cameras it reads, freshest frame
    # Filled from the dataset when training starts (see fit_to_dataset); stored in every checkpoint.
    state_dim: int = 0  # observation.state size
    action_dim: int = 0  # action size
    cameras: list[str] = field(default_factory=list)  # camera names, in the order the policy reads them
    vocabulary: list[str] = field(default_factory=list)  # instruction words of the word-level tokenizer

    @classmethod
    def default_choice_name(cls) -> str:
        # `--policy.horizon=8` without `--policy.type` keeps meaning the small diffusion policy.
        return "diffusion"

    @property
    def type(self) -> str:
        return self.get_choice_name(type(self))

    def validate(self) -> None:
        """Raise ValueError naming the fix for an inconsistent config."""
        if self.horizon < 1:
            raise ValueError(f"policy.horizon must be >= 1, got {self.horizon}")
        if not 1 <= self.n_action_steps <= self.horizon:
            raise ValueError(f"policy.n_action_steps={self.n_action_steps} must be in [1, horizon={self.horizon}]")
        if self.image_size < 1 or self.crop_shift < 0 or self.max_text_tokens < 1:
            raise ValueError("policy.image_size and policy.max_text_tokens must be >= 1, policy.crop_shift >= 0")
        if not 0 <= self.max_delay_steps < self.horizon:
            raise ValueError(
                f"policy.max_delay_steps={self.max_delay_steps} must be in [0, horizon={self.horizon}): a chunk "
                f"needs at least one step after the delay; lower the delay or raise --policy.horizon"
            )
        if not 0 <= self.latency_max_delay < self.horizon:
            raise ValueError(
                f"policy.latency_max_delay={self.latency_max_delay} must be in [0, horizon={self.horizon})"
            )
        check_mid_fraction(self.mid_fraction, "policy.mid_fraction")
        if self.cameras and set(self.mid_cameras) - set(self.cameras):
            raise ValueError(f"policy.mid_cameras={self.mid_cameras} must be among the policy's cameras {self.cameras}")
        if self.low_latency and (self.low_latency_rows < 1 or self.low_latency_max_age < 1):
            raise ValueError(
                f"policy.low_latency_rows={self.low_latency_rows} and policy.low_latency_max_age="
                f"{self.low_latency_max_age} must be >= 1 for a policy with a low-latency part"
            )
        if self.cameras and set(self.low_latency_cameras) - set(self.cameras):
            raise ValueError(
                f"policy.low_latency_cameras={self.low_latency_cameras} must be among the policy's cameras {self.cameras}"
            )

    def require_dataset_fields(self) -> None:
        """Raise unless the dataset-derived fields are set (a policy cannot be built without them)."""
        if self.state_dim < 1 or self.action_dim < 1 or not self.cameras:
            raise ValueError(
                f"{type(self).__name__} needs state_dim, action_dim and cameras; they come from the dataset "
                f"(PreTrainedPolicy.from_dataset) or a checkpoint's config.json"
            )

    def fit_to_dataset(self, features: dict[str, dict], tasks: list[str], cameras: list[str] | None = None) -> None:
        """Complete the dataset-derived fields from a LeRobotDataset's ``features`` and task strings.

        features: LeRobot features (``{"observation.state": {"shape": (S,), ...}, "action": ...,
        "observation.images.<cam>": {"shape": (H, W, C), ...}}``); cameras: the ones to use (None = all).
        A state_dim or action_dim set by hand that disagrees with the dataset is an error.
        """
        dims = {"state_dim": features[OBS_STATE]["shape"][0], "action_dim": features[ACTION]["shape"][0]}
        for name, expected in dims.items():
            if getattr(self, name) not in (0, expected):
                raise ValueError(
                    f"policy.{name}={getattr(self, name)} but the dataset's "
                    f"{'observation.state' if name == 'state_dim' else 'action'} has {expected} dimensions; "
                    f"drop --policy.{name} (it is set from the dataset)"
                )
            setattr(self, name, int(expected))
        available = [k.removeprefix(image_key("")) for k in features if k.startswith(image_key(""))]
        self.cameras = list(cameras or available)
        for cam in self.cameras:
            if cam not in available:
                raise ValueError(f"camera {cam!r} is not in the dataset (it has {available})")
            feature = features[image_key(cam)]
            names = list(feature.get("names") or ["height", "width", "channels"])
            height, width = (feature["shape"][names.index(axis)] for axis in ("height", "width"))
            self.check_image_size(int(height), int(width))
        self.vocabulary = word_vocabulary(tasks)

    def check_image_size(self, height: int, width: int) -> None:
        """Raise if this policy cannot read dataset images of this size (default: it resizes them)."""


@dataclass
class DenoisingPolicyConfig(PolicyConfig):
    """Fields of the policies that sample a chunk by denoising (diffusion or flow)."""

    num_train_timesteps: int = 100  # DDPM noise levels during training
    num_inference_steps: int = 10  # sampler steps at inference (DDIM/DDPM steps, or Euler steps for flow)
    beta_schedule: str = "squaredcos_cap_v2"  # diffusers beta schedule (DDPM/DDIM)
    # ddpm (epsilon prediction, DDPM noise, DDIM sampling) or flow (flow matching, Euler sampling;
    # `policies.flow_matching`): flow offers RTC inpainting and the steering hooks. Each type sets its default.
    objective: Objective = "ddpm"
    # flow only: clip of the real-time-chunking inpainting guidance weight (`policies.flow_guidance`)
    rtc_max_guidance: float = DEFAULT_MAX_GUIDANCE
    # flow only: [low, high] (each one value per action, in action units) a sampled chunk is clamped to, e.g. the
    # robot's limits; empty (the default): the demonstrations' range, so no sample leaves what was demonstrated.
    # (ddpm's sampler clips its clean estimate to that range at every step, so it cannot take wider bounds.)
    action_bounds: list[list[float]] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        if self.num_inference_steps < 1 or self.num_train_timesteps < 1:
            raise ValueError("policy.num_inference_steps and policy.num_train_timesteps must be >= 1")
        check_objective(self.objective)
        bounds = self.action_bounds
        if bounds and (len(bounds) != 2 or len(bounds[0]) != len(bounds[1])
                       or any(lo > hi for lo, hi in zip(*bounds))):  # fmt: skip
            raise ValueError(f"--policy.action_bounds must be [low, high] with low <= high per action, got {bounds}")
        if bounds and self.objective != "flow":
            raise ValueError("--policy.action_bounds needs --policy.objective=flow (ddpm's sampler clips every step "
                             "to the demonstrations' range): train a flow policy, or drop the bounds")  # fmt: skip


def policy_class(type_name: str) -> type[PreTrainedPolicy]:
    """The policy class of a registered type, by LeRobot's convention.

    ``policies.diffusion.configuration_diffusion.DiffusionConfig`` -> ``policies.diffusion.
    modeling_diffusion.DiffusionPolicy``. The modeling module is imported only here, so parsing a
    config never pulls in a model's heavy dependencies.
    """
    known = sorted(PolicyConfig.get_known_choices())
    if type_name not in known:
        raise ValueError(f"unknown policy type {type_name!r}; known: {known}")
    config_cls = PolicyConfig.get_choice_class(type_name)
    module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
    return getattr(module, config_cls.__name__.removesuffix("Config") + "Policy")


LEROBOT_TYPE_PREFIX = "vla_rl_"


def lerobot_type(type_name: str) -> str:
    """The name a vla-rl policy type has in LeRobot's registry and in ``config.json``: ``vla_rl_<type>``."""
    return LEROBOT_TYPE_PREFIX + type_name


def lerobot_processors(device: str = "cpu"):
    """LeRobot's (preprocessor, postprocessor) of a vla-rl policy: batch the input and move it to
    ``device``; return the actions on the CPU. No normalization: the model normalizes with the
    statistics it was trained with (they are among its weights)."""
    from lerobot.processor import AddBatchDimensionProcessorStep, DeviceProcessorStep, RenameObservationsProcessorStep
    from lerobot.processor.factory import make_policy_processor_pipelines

    return make_policy_processor_pipelines(
        input_steps=[
            RenameObservationsProcessorStep(rename_map={}),
            AddBatchDimensionProcessorStep(),
            DeviceProcessorStep(device=device),
        ],
        output_steps=[DeviceProcessorStep(device="cpu")],
    )


def config_from_dict(saved: dict[str, Any], source: str | Path, tokenizer_dir: str = "") -> PolicyConfig:
    """A policy config from the contents of a ``config.json``; the errors name what the file is instead.
    tokenizer_dir: for a LeRobot VLA, the local folder of its tokenizer (`policies.lerobot.assets`)."""
    saved_type = saved.get("type")
    if tokenizer_dir and str(saved_type).startswith(LEROBOT_TYPE_PREFIX):
        raise ValueError(
            f"{source} holds a vla-rl policy, which brings its own tokenizer: drop --tokenizer_dir (it is for "
            f"LeRobot VLA checkpoints that name theirs by hub id)"
        )
    if saved_type is None:
        hint = " (written by vla-rl 0.1: retrain it with `vla-rl train`)" if "policy_type" in saved else ""
        raise ValueError(f"{source} is not a vla-rl checkpoint: its config.json names no policy type{hint}")
    known = sorted(PolicyConfig.get_known_choices())
    type_name = saved_type.removeprefix(LEROBOT_TYPE_PREFIX)
    if not saved_type.startswith(LEROBOT_TYPE_PREFIX):
        # Not vla-rl's: a LeRobot policy (ACT, diffusion, pi0, ...) enters through the `lerobot` type.
        return PolicyConfig.get_choice_class("lerobot").from_directory(source, tokenizer_dir)
    if type_name not in known:
        raise ValueError(
            f"{source} holds a {saved_type!r} policy, which this vla-rl does not know "
            f"(it writes {[lerobot_type(k) for k in known]}); pass a directory written by `vla-rl train`"
        )
    config_cls = PolicyConfig.get_choice_class(type_name)
    names = {f.name for f in fields(config_cls)}
    unknown = sorted(set(saved) - names - {"type"} - LEROBOT_FIELDS)
    if unknown:
        raise ValueError(
            f"{source}'s config.json has fields vla-rl's {type_name!r} policy does not have ({', '.join(unknown)}); "
            f"it was written by another tool or another vla-rl version"
        )
    return config_cls(**{k: v for k, v in saved.items() if k in names})


# Fields of LeRobot's PreTrainedConfig (0.6): LeRobot adds them when it saves a vla-rl policy; vla-rl
# ignores them. tests/test_lerobot_interop.py checks the list against the installed LeRobot.
LEROBOT_FIELDS = {
    "n_obs_steps", "input_features", "output_features", "device", "use_amp", "use_peft", "push_to_hub",
    "repo_id", "private", "tags", "license", "pretrained_path", "pretrained_revision",
}  # fmt: skip


class PreTrainedPolicy(NormalizationMixin, nn.Module):
    """The policy contract (``vla_core.types.Policy``), with what every policy shares implemented once.

    A subclass sets ``config_class`` and implements ``predict_chunk`` (sampling) and ``forward``
    (the imitation loss); RL fine-tuning needs its ``rl_actor`` (denoising policies:
    `policies.denoising_chain.DenoisingRL`).
    """

    config_class: type[PolicyConfig] = PolicyConfig
    supports_inpainting = False  # whether predict_chunk accepts ``inpaint`` (real-time chunking guidance)
    supports_copies = False  # whether forward() accepts copies > 1 (Level-2 minibatching)

    def __init__(self, config: PolicyConfig):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        config.validate()
        config.require_dataset_fields()
        self.config = config
        # The fast head of a latency-aware policy (a subclass builds it: build_latency_head()); None: plain.
        self.latency_head: nn.Module | None = None
        # The low-latency part (a subclass builds it: build_low_latency()); None: the chunks run as they are.
        self.low_latency: nn.Module | None = None

    @property
    def device(self) -> torch.device:
        return self.state_mean.device  # a buffer every policy has (NormalizationMixin)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_dataset(
        cls, config: PolicyConfig, features: dict, stats: dict, tasks: list[str], cameras: list[str] | None = None
    ) -> PreTrainedPolicy:
        """A freshly initialized policy for a LeRobotDataset: its config completed from ``features`` and
        ``tasks`` (see ``PolicyConfig.fit_to_dataset``), its normalization from the dataset ``stats``."""
        config.fit_to_dataset(features, tasks, cameras)
        policy = cls(config)
        policy.set_normalization(
            stats[OBS_STATE]["mean"], stats[OBS_STATE]["std"], stats[ACTION]["min"], stats[ACTION]["max"]
        )
        return policy

    def fit_to_demonstrations(self, demos, frames: torch.Tensor | None = None) -> None:
        """Fit what the policy learns from the data before training (an autoregressive policy's action
        tokenizer) on the demonstrations of ``frames`` (`vla_core.data.ChunkedDemos`); nothing by default."""

    def training_report(self) -> dict:
        """What the policy counted while training (``vla-rl train`` adds it to its summary); nothing by default."""
        return {}

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json``, ``model.safetensors`` and the policy's assets into ``directory`` (LeRobot's format)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.save_weights(directory)
        saved = {"type": lerobot_type(self.config.type), **asdict(self.config)}
        (directory / CONFIG_FILE).write_text(json.dumps(saved, indent=2))
        for pipeline in lerobot_processors():  # LeRobot's scripts load these beside the model
            pipeline.save_pretrained(directory)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, device: str | torch.device = "cpu", tokenizer_dir: str = ""
    ) -> PreTrainedPolicy:
        """The policy saved in ``directory``, in eval mode on ``device``. tokenizer_dir: see `config_from_dict`.

        Called on the base class it builds whichever type ``config.json`` names; called on a subclass
        it also checks the type.
        """
        directory = Path(directory)
        config = config_from_dict(json.loads((directory / CONFIG_FILE).read_text()), directory, tokenizer_dir)
        policy_cls = policy_class(config.type)
        if cls is not PreTrainedPolicy and policy_cls is not cls:
            raise ValueError(f"{directory} holds a {config.type!r} policy, not a {cls.__name__}")
        policy = policy_cls.for_directory(config, directory)
        policy.load_weights(directory)
        return policy.to(device).eval()

    @classmethod
    def for_directory(cls, config: PolicyConfig, directory: Path) -> PreTrainedPolicy:
        """The policy of ``config`` built to load the weights saved in ``directory`` (which may hold what building
        it needs, e.g. a pretrained backbone's config); by default just from the config."""
        return cls(config)

    def save_weights(self, directory: Path) -> None:
        """Write ``model.safetensors`` and what else the weights need (``save_assets``) into ``directory``."""
        # safetensors' save_model writes a tensor shared by two names (tied embeddings) once; load_model ties it back.
        save_model(self, str(directory / WEIGHTS_FILE), force_contiguous=True)
        self.save_assets(directory)

    def load_weights(self, directory: Path) -> None:
        """Load ``model.safetensors`` and the assets from a directory ``save_weights`` wrote."""
        load_model(self, str(directory / WEIGHTS_FILE), strict=True)
        self.load_assets(Path(directory))

    def save_assets(self, directory: Path) -> None:
        """Write the files besides the weights the policy needs (an action tokenizer); none by default."""

    def load_assets(self, directory: Path) -> None:
        """Read what ``save_assets`` wrote; ValueError naming the fix when it is missing."""

    # -- the contract ---------------------------------------------------------------------------

    def predict_chunk(
        self,
        obs: dict,
        obs_step: torch.Tensor | None = None,
        *,
        noise: torch.Tensor | None = None,
        inpaint: tuple[torch.Tensor, torch.Tensor] | None = None,
        steer: Steer | None = None,
    ) -> ActionChunk:
        """Observation batch of size B -> ActionChunk (B, horizon, action_dim) in dataset units.

        obs_step: (B,) control step of the observation (zeros when None). noise: (B, *noise_shape)
        initial noise of the sampler in normalized units (drawn when None), so a chunk can be
        reproduced. inpaint: (target (B, H, A) in dataset units, weights (B, H) in [0, 1]): guide the
        chunk toward the target where the weight is 1, for policies with ``supports_inpainting``.
        steer: a flow policy's extra velocity at every Euler step (`vla_core.types.Steer`).
        """
        raise NotImplementedError

    def forward(self, batch: dict, generator: torch.Generator | None = None, copies: int = 1) -> torch.Tensor:
        """The imitation loss (a scalar) of a training batch: observation keys of B frames + ``action``
        (B, H, A) + ``action_is_pad`` (B, H). copies: noised copies per frame, for policies that support
        Level-2 minibatching (``supports_copies``)."""
        raise NotImplementedError

    def rl_actor(self, noise: ExplorationNoise, augmentation_width: int = 0):
        """The RL actor of this policy (`vla_core.rl.RLPolicy`): what ``vla-rl finetune`` trains, on rollouts
        whose delay augmentation is ``augmentation_width`` wide. Denoising policies act with denoising
        chains (`policies.denoising_chain.DenoisingRL`)."""
        raise ValueError(
            f"the {self.config.type!r} policy has no RL actor (no exact log-probabilities), which RL needs; fine-tune "
            f"a diffusion or diffusion_vla checkpoint (any objective)"
        )

    # -- steering hooks of flow policies (`vla_core.types.FlowSteerable`) ------------------------------
    # vla-rl's own denoising policies implement them in `policies.flow_matching.FlowHooks`, a LeRobot flow
    # VLA in its adapter; any other policy refuses them here.

    @property
    def noise_shape(self) -> tuple[int, ...]:
        """The shape of one sample's initial noise ``predict_chunk`` takes (`vla_core.types.FlowSteerable`)."""
        raise ValueError(f"the {self.config.type!r} policy samples from no initial noise (it has no noise_shape)")

    @property
    def latent_dim(self) -> int:
        """The width of ``latents`` (`vla_core.types.FlowSteerable`)."""
        raise ValueError(self._no_flow_velocity("latent_dim"))

    def velocity(self, obs: dict, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """(B, *noise_shape) the flow velocity at x_t and t (`vla_core.types.FlowSteerable`)."""
        raise ValueError(self._no_flow_velocity("velocity"))

    def latents(self, obs: dict, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """(B, latent_dim) the action expert's pooled hidden state at x_t and t (`vla_core.types.FlowSteerable`)."""
        raise ValueError(self._no_flow_velocity("latents"))

    def _no_flow_velocity(self, what: str) -> str:
        return (
            f"{what} needs a flow velocity, which the {self.config.type!r} policy does not have; steer a flow "
            f"policy: diffusion or diffusion_vla trained with --policy.objective=flow, or LeRobot's pi0, pi05, SmolVLA"
        )

    # -- latency-aware policies (ARLI, `policies.latency_head`) ---------------------------------------

    def latency_head_inputs(self) -> tuple[dict[str, nn.Module], int, int]:
        """What a fast head is built from: per camera an image encoder ((B, 3, S, S) -> (B, K)) its
        mid-image encoders start as copies of (the one ``prepare_request`` encodes the request's images
        with), K, and the width of the condition it corrects. A policy that does not implement it has
        no fast head."""
        raise ValueError(
            f"the {self.config.type!r} policy has no fast head (latency-aware fine-tuning corrects a policy's "
            f"condition, and it exposes none); fine-tune it without --latency_aware"
        )

    def build_latency_head(self) -> nn.Module:
        """The fast head of this policy's config (``latency_max_delay``, ``mid_cameras``): zero at its output."""
        from policies.latency_head import LatencyHead

        encoders, keypoint_dim, width = self.latency_head_inputs()
        cfg = self.config
        return LatencyHead(
            state_dim=cfg.state_dim, action_dim=cfg.action_dim, max_delay=cfg.latency_max_delay,
            mid_cameras=cfg.mid_cameras, image_encoders=encoders, keypoint_dim=keypoint_dim, out_dim=width,
            hidden_dim=width,
        )  # fmt: skip

    def add_latency_head(self, max_delay: int, mid_fraction: float, mid_cameras: list[str]) -> None:
        """Make this policy latency-aware (ARLI, `policies.latency_head`): a fast head that reads the
        committed actions (up to ``max_delay`` steps) and the mid-inference observation (taken at
        ``mid_fraction`` of the inference window, with ``mid_cameras``). Until it is trained the policy
        acts exactly as before. Sets the config fields, so checkpoints rebuild it."""
        if self.latency_head is not None:
            raise ValueError("this policy is latency-aware already; fine-tune it as it is")
        if type(self).latency_head_inputs is PreTrainedPolicy.latency_head_inputs:
            self.latency_head_inputs()  # says, before anything changes, that this policy has no fast head
        fields = {"latency_aware": True, "latency_max_delay": max_delay, "mid_fraction": mid_fraction,
                  "mid_cameras": list(mid_cameras)}  # fmt: skip
        dataclasses.replace(self.config, **fields).validate()  # a bad value changes nothing
        for name, value in fields.items():
            setattr(self.config, name, value)
        self.latency_head = self.build_latency_head().to(self.device)

    def latency_correction(self, obs: dict, slow: dict) -> torch.Tensor | None:
        """(B, width) the fast head's correction of the condition, or None for a policy without one. slow:
        ``prepare_request``'s output, with the request's normalized ``state`` (B, S) and ``keypoints``
        (camera -> (B, K)) of the mid cameras."""
        if self.latency_head is None:
            return None
        return self.latency_head(obs, slow["state"], slow["keypoints"], self.normalize_state, self.normalize_action)

    # -- the low-latency part (ARLI's fast policy, `policies.low_latency`) ---------------------------------

    def build_low_latency(self) -> nn.Module:
        """The low-latency part of this policy's config, its encoders copies of the fast head's sources (the slow
        policy's own keypoint encoders, where it has them; `latency_head_inputs`): zero at its output."""
        encoders, keypoint_dim, _ = self.latency_head_inputs()
        cfg = self.config
        return LowLatencyPolicy(
            state_dim=cfg.state_dim, action_dim=cfg.action_dim, cameras=cfg.low_latency_cameras,
            image_encoders=encoders, keypoint_dim=keypoint_dim, rows=cfg.low_latency_rows,
            max_age=cfg.low_latency_max_age,
        )  # fmt: skip

    def add_low_latency(self, rows: int, max_age: int, cameras: list[str]) -> None:
        """Give this policy a low-latency part reading ``rows`` plan rows and ``cameras``' freshest frames, its
        ages scaled by ``max_age``. Until it is trained the policy acts exactly as before. Sets the config fields,
        so checkpoints rebuild it."""
        if self.low_latency is not None:
            raise ValueError("this policy has a low-latency part already; fine-tune it as it is")
        if type(self).latency_head_inputs is PreTrainedPolicy.latency_head_inputs:
            self.latency_head_inputs()  # says, before anything changes, that this policy has no encoders to copy
        fields = {"low_latency": True, "low_latency_rows": rows, "low_latency_max_age": max_age,
                  "low_latency_cameras": list(cameras)}  # fmt: skip
        dataclasses.replace(self.config, **fields).validate()  # a bad value changes nothing
        for name, value in fields.items():
            setattr(self.config, name, value)
        self.low_latency = self.build_low_latency().to(self.device)

    def low_latency_inputs(self, obs: dict, base: torch.Tensor, context) -> LowLatencyInputs:
        """The low-latency part's inputs at a control step: ``obs`` the freshest observation (B worlds), ``base``
        (B, A) the action the queue emits (or the hold action), ``context`` the protocol's `StepContext`."""
        cfg, dev = self.config, self.device
        scale = float(cfg.low_latency_max_age)
        plan = self.normalize_action(context.plan.to(dev, torch.float32))
        plan = torch.cat([self.normalize_action(base.to(dev, torch.float32))[:, None], plan[:, 1:]], 1)
        queued = torch.cat([torch.ones_like(context.queued[:, :1]), context.queued[:, 1:]], 1).to(dev)
        return LowLatencyInputs(
            state=self.normalize_state(obs[OBS_STATE].to(dev, torch.float32)),
            images={cam: obs[image_key(cam)].to(dev, torch.float32) for cam in cfg.low_latency_cameras},
            plan=plan, plan_mask=queued, plan_age=context.plan_age.to(dev, torch.float32) / scale,
            since_request=context.since_request.to(dev, torch.float32) / scale,
        )  # fmt: skip

    def corrected_action(self, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """(B, A) in dataset units: ``base`` (B, A) moved by the low-latency correction ``delta`` (B, A), in
        normalized units."""
        return self.unnormalize_action(self.normalize_action(base.to(delta)) + delta)

    @torch.no_grad()
    def low_latency_step(self, obs: dict, base: torch.Tensor, context) -> torch.Tensor:
        """(B, A) the action to run at this control step (evaluation and serving: the mean correction), the shells'
        step policy (`vla_core.runtime.delayed_env.DelayedChunkEnv`, `robot_bridge.chunk_scheduler`)."""
        if self.low_latency is None:
            raise ValueError("this policy has no low-latency part; run it without a step policy")
        mean, _ = self.low_latency(self.low_latency_inputs(obs, base, context))
        return self.corrected_action(base, mean)

    def committed_actions(self, obs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The delay augmentation as this policy reads it (training-time RTC), or None when it reads none.

        Returns (committed (B, horizon, A) in dataset units, known (B, horizon) bool): chunk step j is
        known where ``observation.committed_mask[:, j]`` is True; its action is already executing and
        the chunk must keep it. None when ``config.max_delay_steps`` is 0 (the keys are ignored) or
        the observation has no augmentation (nothing is known). A mask wider than max_delay_steps is
        accepted when it is False past it; True there is a delay the policy was not trained for.
        """
        limit = self.config.max_delay_steps
        if limit == 0 or OBS_COMMITTED_MASK not in obs:
            return None
        if OBS_COMMITTED_ACTIONS not in obs:
            raise ValueError(
                f"{OBS_COMMITTED_MASK} comes without {OBS_COMMITTED_ACTIONS}; pass both (the delay augmentation)"
            )
        committed, mask = obs[OBS_COMMITTED_ACTIONS], obs[OBS_COMMITTED_MASK]
        if mask.ndim != 2 or tuple(committed.shape) != (*mask.shape, self.config.action_dim):
            raise ValueError(
                f"{OBS_COMMITTED_ACTIONS} must be (B, D, {self.config.action_dim}) and {OBS_COMMITTED_MASK} (B, D), "
                f"got {tuple(committed.shape)} and {tuple(mask.shape)}"
            )
        b, rows = mask.shape
        mask = mask.to(self.device, torch.bool)
        beyond = mask[:, limit:].any(0).nonzero()
        if len(beyond):
            step = int(beyond[-1]) + limit
            raise ValueError(
                f"{OBS_COMMITTED_MASK} commits chunk step {step} but this policy was trained for delays up to "
                f"max_delay_steps={limit}; keep the delay at or below {limit} or retrain with --delay.kind=uniform --delay.high={step + 1}"
            )
        rows = min(rows, limit)
        known = torch.zeros(b, self.config.horizon, dtype=torch.bool, device=self.device)
        known[:, :rows] = mask[:, :rows]
        actions = torch.zeros(b, self.config.horizon, self.config.action_dim, device=self.device)
        # Rows outside the mask are padding (zeros by convention, but anything): never read them.
        actions[:, :rows] = torch.where(known[:, :rows, None], committed[:, :rows].to(actions), 0.0)
        if not torch.isfinite(actions).all():
            raise ValueError(f"{OBS_COMMITTED_ACTIONS} holds NaN or inf where {OBS_COMMITTED_MASK} is True")
        return actions, known

    @staticmethod
    def chunk_loss(
        err: torch.Tensor, batch: dict, known: torch.Tensor | None = None, at_zero_delay: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A denoising policy's training loss from its per-row error ``err`` (B, H), or (B, K, H) for K
        copies of each frame: the mean over the rows in the loss, those neither padding (``action_is_pad``)
        nor known (B, H) (committed: given, not predicted; None without the delay augmentation).

        at_zero_delay: the same frames' error, shaped as ``err``, denoised with nothing committed (the
        zero-delay pass of training-time RTC, ``ZERO_DELAY_PASS``): the loss is then the mean of the two
        passes' losses, that one over every row that is not padding, as plain training takes it.
        """
        valid = ~batch["action_is_pad"]

        def mean(e: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            rows = rows[:, None].expand_as(e) if e.ndim == 3 else rows
            return (e * rows).sum() / rows.sum().clamp_min(1)

        loss = mean(err, valid if known is None else valid & ~known)
        return loss if at_zero_delay is None else (loss + mean(at_zero_delay, valid)) / 2

    @staticmethod
    def _chunk(actions: torch.Tensor, obs_step: torch.Tensor | None) -> ActionChunk:
        """(B, H, A) actions -> ActionChunk conditioned on ``obs_step`` (B,), zeros when None."""
        if obs_step is None:
            obs_step = torch.zeros(actions.shape[0], dtype=torch.long, device=actions.device)
        return ActionChunk(actions=actions, obs_step=obs_step)

    def _initial_noise(self, noise: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
        """(B, H, A) sampler start: the given noise, checked, or a fresh standard normal draw."""
        shape = (batch, *self.noise_shape)
        if noise is None:
            return torch.randn(shape, device=device)
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise must be (B, horizon, action_dim) = {shape}, got {tuple(noise.shape)}")
        # Contiguous: a repeated noise is often an expanded view whose rows share memory; the sampler gets
        # rows of its own, so nothing downstream writes through them or trips over their strides.
        return noise.to(device=device, dtype=torch.float32).contiguous()
