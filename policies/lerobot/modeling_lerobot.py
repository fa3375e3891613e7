"""A LeRobot policy behind vla-rl's policy contract: LeRobot's own preprocessor, model and
postprocessor, run in that order on a vla-rl observation batch (the feature names are LeRobot's).

LeRobot's flow VLAs (pi0, pi05, SmolVLA; `policies.lerobot.flow`) also implement the RL contract of a
denoising policy (`policies.denoising_chain.DenoisingRL`: chains with exact log-probabilities around
LeRobot's own Euler steps) and real-time-chunking guidance (``inpaint``), so ``vla-rl finetune`` trains
them and ``vla-rl eval`` / ``serve`` run them with the rtc merge; and the steering hooks
(`vla_core.types.FlowSteerable`) on the padded chunk LeRobot's sampler integrates, (chunk_size,
max_action_dim) per sample, in LeRobot's normalization of the checkpoint.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch

from policies.denoising_chain import DenoisingActor, DenoisingRL, ExplorationNoise
from policies.flow_matching import time_batch
from policies.lerobot import adaptation, assets, flow
from policies.lerobot.configuration_lerobot import LeRobotConfig, load_lerobot_config
from policies.observation import check_observation
from policies.pretrained import PreTrainedPolicy
from vla_core.types import ACTION, OBS_STATE, ActionChunk, Steer


class LeRobotPolicy(PreTrainedPolicy, DenoisingRL):
    """Implements `vla_core.types.Policy` with a LeRobot ``PreTrainedPolicy`` and its processors."""

    config_class = LeRobotConfig

    def __init__(self, config: LeRobotConfig):
        super().__init__(config)  # no vla-rl normalization buffers: LeRobot's processors normalize
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors

        lerobot_config = load_lerobot_config(config.pretrained_path)
        if lerobot_config.type == "smolvla":
            # Its weights are all in the checkpoint; the VLM's config (and processor) come from a local folder.
            lerobot_config.vlm_model_name = assets.vlm_source(
                config.pretrained_path, lerobot_config.vlm_model_name, config.tokenizer_dir
            )
            lerobot_config.load_vlm_weights = False
        tokenizer = assets.load_tokenizer(config.pretrained_path, config.lerobot_type, config.tokenizer_dir)
        self.model = get_policy_class(lerobot_config.type).from_pretrained(
            config.pretrained_path, config=lerobot_config
        )
        overrides = {} if tokenizer is None else {assets.TOKENIZER_STEP: {"tokenizer": tokenizer}}
        self.preprocessor, self.postprocessor = make_pre_post_processors(
            lerobot_config, pretrained_path=config.pretrained_path, preprocessor_overrides=overrides
        )
        self.tokenizer = tokenizer
        self.tokenizer_name = assets.saved_tokenizer_name(config.pretrained_path)
        # LeRobot's diffusion and flow policies take the sampler's start; ACT has none.
        parameters = inspect.signature(self.model.predict_action_chunk).parameters
        self._takes_noise = "noise" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        self.adapted: adaptation.Adapted | None = None  # how `vla-rl finetune` made it trainable

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def is_flow(self) -> bool:
        """A flow VLA LeRobot samples with its Euler loop (pi0, pi05, SmolVLA): RL and RTC guidance work."""
        return self.config.lerobot_type in flow.FLOW_TYPES

    @property
    def supports_inpainting(self) -> bool:
        return self.is_flow

    def load_weights(self, directory: Path) -> None:
        pass  # LeRobot's from_pretrained loaded them in __init__

    def save_pretrained(self, directory: str | Path) -> None:
        """Save as LeRobot does (its config, weights and processors), so LeRobot reads the copy: a LoRA
        adapter merged into the weights, the tokenizer named by its hub id as before, and a copy of it in
        ``tokenizer/`` so vla-rl loads the copy offline."""
        directory = Path(directory)
        if self.adapted is not None:
            self.adapted.save_merged(self.model, directory)
        else:
            self.model.save_pretrained(directory)
        step = next((s for s in self.preprocessor.steps if getattr(s, "tokenizer", None) is not None), None)
        if step is not None:  # LeRobot saves a tokenizer's name only when it was loaded by that name
            step.tokenizer, step.tokenizer_name = None, self.tokenizer_name
        try:
            self.preprocessor.save_pretrained(directory)
        finally:
            if step is not None:
                step.tokenizer = self.tokenizer
        self.postprocessor.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory / assets.TOKENIZER_FOLDER)
            if self.config.lerobot_type == "smolvla":
                self.model.model.vlm_with_expert.processor.save_pretrained(directory / assets.TOKENIZER_FOLDER)
                self.model.model.vlm_with_expert.config.save_pretrained(directory / assets.TOKENIZER_FOLDER)

    # -- LeRobot's batches ------------------------------------------------------------------------

    def _model_batch(self, obs: dict, actions: torch.Tensor | None = None) -> dict:
        """LeRobot's preprocessed batch of ``obs`` (with ``actions`` (B, H, A) in dataset units normalized
        as ``action``), on the model's device."""
        check_observation(obs, self.config.state_dim, self.config.cameras, self.config.image_size)
        batch = dict(obs) if actions is None else {**obs, ACTION: actions}
        batch = self.preprocessor(batch)
        # The saved preprocessor moves tensors to the device it was saved with; the model may be elsewhere.
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _chunk_out(self, actions: torch.Tensor, obs: dict, obs_step) -> ActionChunk:
        """LeRobot's normalized (B, >= horizon, A) actions -> ActionChunk in dataset units on obs's device."""
        actions = self.postprocessor(actions).to(obs[OBS_STATE].device)
        if actions.shape[1] < self.config.horizon:
            raise ValueError(
                f"the LeRobot {self.config.lerobot_type} policy returned {actions.shape[1]} actions per chunk, "
                f"fewer than the {self.config.horizon} its config announces"
            )
        return self._chunk(actions[:, : self.config.horizon], obs_step)

    def _padded_shape(self, batch_size: int) -> tuple[int, int, int]:
        """(B, chunk_size, A_max): the flow sampler's latent (its chunk, padded to the model's max_action_dim)."""
        return batch_size, *self.noise_shape

    # -- the steering hooks (flow VLAs; `vla_core.types.FlowSteerable`) ---------------------------------

    @property
    def noise_shape(self) -> tuple[int, int]:
        """(chunk_size, max_action_dim) from LeRobot's config: the padded chunk its flow sampler integrates,
        one noise per chunk row and per (padded) action dimension, e.g. (50, 32) for pi0 and pi05."""
        self._require_flow("noise_shape")
        return self.model.config.chunk_size, self.model.config.max_action_dim

    @property
    def latent_dim(self) -> int:
        """The action expert's width: the input width of LeRobot's ``action_out_proj``."""
        self._require_flow("latent_dim")
        return flow.ExpertLatents(self.model).width

    def velocity(self, obs: dict, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """(B, chunk_size, max_action_dim) LeRobot's velocity at x_t (the padded chunk, in LeRobot's
        normalization) and time t (a float or (B,), 1 = noise): its ``denoise_step`` on the observation's
        prefix, through the replaced Euler loop (`policies.lerobot.flow.Probe`). Autograd follows the caller."""
        return self._probe(obs, x_t, t, "velocity")[0]

    def latents(self, obs: dict, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """(B, latent_dim) the action expert's hidden state of the chunk's rows at x_t and t, as LeRobot's
        ``action_out_proj`` reads it, mean over the chunk_size rows (`policies.lerobot.flow.ExpertLatents`)."""
        return self._probe(obs, x_t, t, "latents")[1]

    def _probe(self, obs: dict, x_t: torch.Tensor, t, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_flow(what)
        batch = self._model_batch(obs)
        x = self._checked_noise(x_t, len(obs[OBS_STATE]), "x_t")
        probe = flow.Probe(x, time_batch(t, x.shape[0], x.device))
        grad = torch.is_grad_enabled()
        with flow.ExpertLatents(self.model) as latents, flow.integrator(self.model, probe, grad=grad) as predict:
            predict(batch, noise=x)
        return probe.velocity, latents.latest

    def _require_flow(self, what: str) -> None:
        if not self.is_flow:
            raise ValueError(
                f"{what} needs a flow velocity, which LeRobot's {self.config.lerobot_type} policy does not have; "
                f"steer a flow policy: LeRobot's pi0, pi05, SmolVLA, or vla-rl's diffusion or diffusion_vla trained "
                f"with --policy.objective=flow"
            )

    def _checked_noise(self, noise: torch.Tensor, batch_size: int, name: str = "noise") -> torch.Tensor:
        """A flow VLA's sampler state (B, chunk_size, max_action_dim), checked, contiguous float32 on the
        model's device (a repeated noise is often an expanded view whose rows share memory)."""
        shape = self._padded_shape(batch_size)
        if tuple(noise.shape) != shape:
            raise ValueError(
                f"{name} for LeRobot's {self.config.lerobot_type} must be (B, chunk_size, max_action_dim) = {shape}, "
                f"the padded chunk its sampler integrates, got {tuple(noise.shape)}"
            )
        return noise.to(self.device, torch.float32).contiguous()

    # -- sampling -------------------------------------------------------------------------------

    @torch.no_grad()
    def predict_chunk(self, obs, obs_step=None, *, noise=None, inpaint=None, steer: Steer | None = None) -> ActionChunk:
        """obs batch of size B -> ActionChunk (B, horizon, action_dim) in dataset units.

        noise: a flow VLA's is (B, chunk_size, max_action_dim) (``noise_shape``), its Euler loop's start in
        LeRobot's normalization; LeRobot's diffusion policy gets its own noise unchanged. inpaint (flow
        VLAs): (target (B, H, A) in dataset units, weights (B, H)), real-time-chunking guidance of LeRobot's
        Euler steps (`policies.flow_guidance`). steer (flow VLAs): an extra velocity at every Euler step
        (`vla_core.types.Steer`), read with the expert's latents of that step. LeRobot encodes the
        observation's prefix once per call; its loop only runs the action expert.
        """
        if noise is not None and not self._takes_noise:
            raise ValueError(f"the LeRobot {self.config.lerobot_type} policy samples without an initial noise")
        if steer is not None:
            self._require_flow("steer")
        if noise is not None and self.is_flow:
            noise = self._checked_noise(noise, len(obs[OBS_STATE]))
        if inpaint is None and steer is None:
            batch = self._model_batch(obs)
            actions = self.model.predict_action_chunk(batch, **({"noise": noise} if noise is not None else {}))
            return self._chunk_out(actions, obs, obs_step)
        if not self.is_flow:
            raise ValueError(
                f"inpainting guidance (the rtc merge) needs a flow VLA (pi0, pi05, SmolVLA), not LeRobot's "
                f"{self.config.lerobot_type}; use --chunking.merge=latest or ensemble"
            )
        batch = self._model_batch(obs, None if inpaint is None else inpaint[0])
        b, h, a_max = self._padded_shape(len(obs[OBS_STATE]))
        guidance = None if inpaint is None else self._guidance(batch, inpaint[1], (b, h, a_max))
        start = noise if noise is not None else torch.randn(b, h, a_max, device=self.device)
        with flow.ExpertLatents(self.model) if steer is not None else contextlib.nullcontext() as latents:
            sampler = flow.Sampler(torch.zeros(self.config.num_inference_steps), guidance, steer=steer, latents=latents)
            with flow.integrator(self.model, sampler) as predict:
                actions = predict(batch, noise=start)
        return self._chunk_out(actions, obs, obs_step)

    def _guidance(self, batch: dict, weights: torch.Tensor, shape: tuple[int, int, int]):
        """RTC's (target, weights), both (B, chunk_size, A_max): the batch's normalized ``action`` and the
        (B, H) weights, on the policy's action dimensions (the padded ones are free)."""
        h, a = shape[1], self.config.action_dim
        target = torch.zeros(shape, device=self.device)
        target[..., :a] = batch[ACTION].to(self.device)[:, :h]
        padded = torch.zeros_like(target)
        padded[..., :a] = weights.to(self.device)[:, :h, None]
        return target, padded

    def forward(self, batch, generator=None, copies=1) -> torch.Tensor:
        """LeRobot's own training loss of the batch (its preprocessor normalizes it first)."""
        batch = self.preprocessor(dict(batch))
        loss, _ = self.model({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()})
        return loss

    # -- RL fine-tuning (flow VLAs) -------------------------------------------------------------

    def rl_actor(self, noise: ExplorationNoise, augmentation_width: int = 0) -> DenoisingActor:
        if not self.is_flow:
            raise ValueError(
                f"LeRobot's {self.config.lerobot_type} policy has no RL actor in vla-rl (RL needs exact "
                f"log-probabilities: LeRobot's flow VLAs pi0, pi05 and SmolVLA, or vla-rl's own diffusion and "
                f"diffusion_vla); evaluate and serve it instead"
            )
        if self.config.num_inference_steps < 1:
            raise ValueError(f"the LeRobot {self.config.lerobot_type} config in {self.config.pretrained_path} "
                             f"sets no num_inference_steps; RL needs its Euler steps")  # fmt: skip
        return DenoisingActor(self, noise, augmentation_width)

    @torch.no_grad()
    def sample_with_log_prob(self, obs, obs_step=None, *, noise: ExplorationNoise):
        """(ActionChunk in dataset units, the chain (B, K+1, H, A_max), log-prob (B,)): LeRobot's Euler steps,
        each with Gaussian noise of std ``noise.min_std`` (normalized units) around it."""
        batch = self._model_batch(obs)
        sampler = flow.Sampler(torch.full((self.config.num_inference_steps,), noise.min_std))
        start = torch.randn(self._padded_shape(len(obs[OBS_STATE])), device=self.device)
        with flow.integrator(self.model, sampler) as predict:
            actions = predict(batch, noise=start)
        return self._chunk_out(actions, obs, obs_step), sampler.chain, sampler.log_prob

    def log_prob(self, obs, chain, *, per_step: bool = False) -> torch.Tensor:
        """(B,) or per step (B, K): the chain's log-density under the current weights, with autograd."""
        chain.check_density()
        checkpointed = self.adapted is not None and self.adapted.settings.gradient_checkpointing
        scorer = flow.Scorer(chain, checkpointed)
        with flow.integrator(self.model, scorer, grad=True) as predict:
            predict(self._model_batch(obs), noise=chain.latents[:, 0].to(self.device))
        per = chain.to(self.device).step_log_prob(scorer.means)
        return per if per_step else per.sum(1)

    @property
    def condition_dim(self) -> int:
        return self.config.horizon * self.config.action_dim + self.config.state_dim

    @torch.no_grad()
    def condition_features(self, obs: dict) -> torch.Tensor:
        """(B, horizon * action_dim + state_dim): the chunk the policy predicts in one step from zero noise
        (normalized) and the normalized state, for a value head; no sampling."""
        batch = self._model_batch(obs)
        zeros = torch.zeros(self._padded_shape(len(obs[OBS_STATE])), device=self.device)
        with flow.integrator(self.model, flow.CleanChunk()) as predict:
            clean = predict(batch, noise=zeros)[:, : self.config.horizon, : self.config.action_dim]
        state = batch[OBS_STATE][:, : self.config.state_dim].to(clean)
        return torch.cat([clean.flatten(1).float(), state.float()], -1)

    def normalize_action(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions (..., A) in dataset units -> LeRobot's normalization of this checkpoint (identity without one)."""
        normalizer = next((s for s in self.preprocessor.steps if hasattr(s, "_normalize_action")), None)
        return actions if normalizer is None else normalizer._normalize_action(actions, inverse=False)

    # -- what fine-tuning a VLA needs ------------------------------------------------------------

    def adapt(self, settings: adaptation.AdaptationConfig, seed: int = 0) -> None:
        """Make the weights RL trains those ``settings`` name (all, the action expert, or LoRA adapters drawn
        from ``seed``), in its dtype, with gradient checkpointing if asked (`policies.lerobot.adaptation`)."""
        if self.adapted is not None:
            raise ValueError("this policy was adapted for training already")
        self.adapted = adaptation.adapt(self.model, self.config.lerobot_type, settings, seed)
