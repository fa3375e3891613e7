"""A small diffusion policy in the style of Diffusion Policy (Chi et al.), sized for CPU training.

- Vision: a 3-layer CNN per camera ending in spatial softmax (learned keypoints), which localizes
  objects precisely from few demonstrations.
- Instruction: mean of learned word embeddings over a vocabulary taken from the dataset's tasks
  (``policies.tokenizer``).
- Denoiser: residual MLP over the flattened chunk (H*A), FiLM-conditioned on the observation
  embedding and the diffusion timestep; epsilon prediction.
- Noise: `diffusers` DDPMScheduler for training, DDIMScheduler for sampling.

Delay augmentation (training-time RTC, Black et al. 2025), only when ``config.max_delay_steps`` > 0:
the chunk steps in ``observation.committed_mask`` are known, already executing actions. The denoiser
reads a known indicator per chunk step beside the chunk (its input is H * (A + 1) wide), and the
known steps of its input always hold their clean action, never noise, at every noise level. Training
takes the loss on the unknown, non-padded steps only. Row j is then predicted only on the frames with
d <= j (row 0 only at d = 0), so a batch marked ``zero_delay_pass`` (`vla-rl train`'s) is denoised
twice from one encoded observation, each time with its own noise and timestep: under its delays, and
at zero delay (nothing known, every non-padded row in the loss, as plain training takes it); the
loss is the mean of the two. Every row then gets at least the samples plain training gives it,
whatever the delays. (Weighting row j by 1 / P(d <= j) instead restores its expected share of the
loss, not its samples, and did not close the gap in a small trained comparison.) Sampling writes the
clean committed actions into the known steps before every DDIM step, and the returned chunk starts
with them exactly. With max_delay_steps = 0 the augmentation is ignored and the network is the one
without it.

RL fine-tuning (``policies.denoising_chain``, DPPO-style): ``sample_with_log_prob`` runs DDIM with eta,
so each step is a Gaussian around DDIM's step mean with std max(eta * sigma_t, min_std), and the chunk
is that Gaussian chain's last sample. ``log_prob`` evaluates all K steps of a stored chain in one
denoiser call and sums their Gaussian log-densities over the unknown chunk steps.

Actions are normalized to [-1, 1] with the dataset min/max, states to zero mean and unit variance;
the statistics are buffers, so they travel inside every checkpoint's weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler
from torch import nn

from policies.denoising_chain import (
    DDIMSteps,
    DenoisingChain,
    DenoisingRL,
    ExplorationNoise,
    check_chain_shape,
    known_for_chain,
    sample_chain,
)
from policies.diffusion.configuration_diffusion import DiffusionConfig
from policies.keypoints import ImageEncoder, SpatialSoftmax  # noqa: F401 (SpatialSoftmax: this module's name for it)
from policies.observation import check_observation
from policies.pretrained import PreTrainedPolicy
from policies.tokenizer import PAD_WORD, UNKNOWN_WORD, WordTokenizer
from vla_core.types import ACTION, OBS_STATE, TASK, ZERO_DELAY_PASS, ActionChunk, image_key


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(B,) integer timesteps -> (B, dim) sinusoidal embedding."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], -1)


class FiLMBlock(nn.Module):
    def __init__(self, dim: int, cond_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.film = nn.Linear(cond_dim, 2 * dim)
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.film(cond).chunk(2, -1)
        h = self.norm(x) * (1 + scale) + shift
        return x + self.fc2(F.mish(self.fc1(F.mish(h))))


class DiffusionPolicy(DenoisingRL, PreTrainedPolicy):
    """Implements `vla_core.types.Policy`: observation batch -> ActionChunk of (B, horizon, action_dim)."""

    config_class = DiffusionConfig

    def __init__(self, config: DiffusionConfig):
        super().__init__(config)
        cfg = config
        self.image_encoders = nn.ModuleDict(
            {cam: ImageEncoder(cfg.vision_channels, cfg.num_keypoints) for cam in cfg.cameras}
        )
        vocabulary = cfg.vocabulary or [PAD_WORD, UNKNOWN_WORD]
        self.tokenize = WordTokenizer(vocabulary, cfg.max_text_tokens)
        self.word_embedding = nn.Embedding(len(vocabulary), cfg.text_dim)
        obs_dim = len(cfg.cameras) * 2 * cfg.num_keypoints + cfg.state_dim + cfg.text_dim
        cond_dim = cfg.hidden_dim
        self.obs_proj = nn.Sequential(nn.Linear(obs_dim, cond_dim), nn.Mish(), nn.Linear(cond_dim, cond_dim))
        self.time_proj = nn.Sequential(nn.Linear(cond_dim, cond_dim), nn.Mish(), nn.Linear(cond_dim, cond_dim))
        flat = cfg.horizon * cfg.action_dim
        # A policy that reads the delay augmentation sees one known flag per chunk step beside the actions;
        # without it the input is the chunk alone, as in checkpoints written before the augmentation.
        self.reads_known = cfg.max_delay_steps > 0
        flags = cfg.horizon if self.reads_known else 0
        self.input_proj = nn.Linear(flat + flags, cfg.hidden_dim)
        self.blocks = nn.ModuleList([FiLMBlock(cfg.hidden_dim, cond_dim) for _ in range(cfg.num_blocks)])
        self.output_proj = nn.Sequential(nn.LayerNorm(cfg.hidden_dim), nn.Linear(cfg.hidden_dim, flat))

        self.register_normalization(cfg.state_dim, cfg.action_dim)
        self.latency_head = self.build_latency_head() if cfg.latency_aware else None

        sched = {
            "num_train_timesteps": cfg.num_train_timesteps,
            "beta_schedule": cfg.beta_schedule,
            "clip_sample": True,
        }
        self.train_scheduler = DDPMScheduler(**sched, prediction_type="epsilon")
        self.sample_scheduler = DDIMScheduler(**sched, prediction_type="epsilon")

    # -- conditioning -------------------------------------------------------------------------

    def _encode_text(self, instructions: list[str], device) -> torch.Tensor:
        """B instructions -> (B, text_dim): the mean embedding of each instruction's words."""
        ids, attention = self.tokenize(instructions, device)  # (B, T), padding has attention 0
        weights = attention.float()[..., None]
        return (self.word_embedding(ids) * weights).sum(1) / weights.sum(1)

    def encode_observation(self, obs: dict, prepared: dict | None = None) -> torch.Tensor:
        """Observation batch -> (B, hidden_dim) condition. Validates shapes and finiteness.

        A latency-aware policy adds its fast head's correction (`policies.latency_head`): the slow part
        reads the request's observation, the fast part the committed actions and the mid-inference one.
        prepared: the slow part's output for this batch (``prepare_request``), if computed already.
        """
        slow = prepared if prepared is not None else self.prepare_request(obs)
        correction = self.latency_correction(obs, slow)
        return slow["cond"] if correction is None else slow["cond"] + correction

    def prepare_request(self, obs: dict) -> dict:
        """The slow part on the request's observation: image keypoints, the normalized state and the
        condition before any fast-head correction. A latency-aware policy on a robot computes it while
        the mid-inference observation is still to come (``predict_chunk(..., prepared=)``)."""
        check_observation(obs, self.config.state_dim, self.config.cameras, self.config.image_size)
        state = obs[OBS_STATE]
        keypoints = {cam: self.image_encoders[cam](obs[image_key(cam)]) for cam in self.config.cameras}
        normalized = self.normalize_state(state)
        feats = [*keypoints.values(), normalized, self._encode_text(list(obs[TASK]), state.device)]
        return {"cond": self.obs_proj(torch.cat(feats, -1)), "state": normalized, "keypoints": keypoints}

    def latency_head_inputs(self) -> tuple[dict[str, nn.Module], int, int]:
        """See ``PreTrainedPolicy.latency_head_inputs``: the mid cameras' encoders start as copies of the slow ones."""
        cfg = self.config
        return dict(self.image_encoders), 2 * cfg.num_keypoints, cfg.hidden_dim

    # -- training and inference ---------------------------------------------------------------

    def denoise(
        self, noisy: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, known: torch.Tensor | None = None
    ) -> torch.Tensor:
        """noisy (B, H, A), t (B,), cond (B, D) -> predicted noise (B, H, A).

        known: (B, H) bool, the chunk steps that hold clean committed actions (None: none); read only
        when the policy has max_delay_steps > 0.
        """
        b = noisy.shape[0]
        c = cond + self.time_proj(timestep_embedding(t, cond.shape[-1]))
        chunk = noisy
        if self.reads_known:
            flags = torch.zeros(noisy.shape[:2], device=noisy.device) if known is None else known.to(noisy)
            chunk = torch.cat([noisy, flags[..., None]], -1)  # (B, H, A + 1)
        x = self.input_proj(chunk.reshape(b, -1))
        for block in self.blocks:
            x = block(x, c)
        return self.output_proj(x).reshape(noisy.shape)

    def forward(self, batch: dict, generator: torch.Generator | None = None, copies: int = 1) -> torch.Tensor:
        """batch: observation keys + ``action`` (B, H, A) + ``action_is_pad`` (B, H) -> scalar loss.

        With max_delay_steps > 0 and the delay augmentation in the batch, the committed steps enter
        clean and are left out of the loss; with ``ZERO_DELAY_PASS`` the frames are also denoised at zero
        delay (see the module docstring and `chunk_loss`). copies must be 1: this policy
        has no Level-2 minibatching (``supports_copies`` is False).
        """
        if copies != 1:
            raise ValueError(f"the diffusion policy trains one copy per frame, got copies={copies}")
        actions = batch[ACTION]
        if not torch.isfinite(actions).all():
            raise ValueError("the training batch has NaN or inf actions; check the dataset")
        target = self.normalize_action(actions)
        cond = self.encode_observation(batch)
        b = target.shape[0]
        prefix = self.committed_actions(batch)
        # The zero-delay pass: each frame a second time (one encoded observation, its own noise and timestep,
        # nothing known), in the same denoiser call: 2B chunks.
        passes = 2 if prefix is not None and batch.get(ZERO_DELAY_PASS, False) else 1
        if passes == 2:
            target, cond = target.repeat(2, 1, 1), cond.repeat(2, 1)
        noise = torch.randn(target.shape, generator=generator, device=target.device)
        t = torch.randint(0, self.config.num_train_timesteps, (passes * b,), generator=generator, device=target.device)
        noisy = self.train_scheduler.add_noise(target, noise, t)
        known = None
        if prefix is not None:
            committed, given = prefix
            known = torch.cat([given, torch.zeros_like(given)]) if passes == 2 else given
            noisy = torch.where(known[..., None], self.normalize_action(committed).repeat(passes, 1, 1), noisy)
        err = F.mse_loss(self.denoise(noisy, t, cond, known), noise, reduction="none").mean(-1)  # (passes * B, H)
        if passes == 2:
            return self.chunk_loss(err[:b], batch, given, at_zero_delay=err[b:])
        return self.chunk_loss(err, batch, known)  # the committed steps are given, not predicted

    @torch.no_grad()
    def predict_chunk(
        self,
        obs: dict,
        obs_step: torch.Tensor | None = None,
        *,
        noise: torch.Tensor | None = None,
        inpaint: tuple[torch.Tensor, torch.Tensor] | None = None,
        prepared: dict | None = None,
    ) -> ActionChunk:
        """obs batch of size B -> ActionChunk (B, horizon, action_dim) in dataset units (DDIM sampling).

        noise: (B, horizon, action_dim) sampler start (see ``PreTrainedPolicy.predict_chunk``).
        prepared: ``prepare_request(obs)``'s output, computed before the mid-inference observation came.
        With max_delay_steps > 0, the committed actions of the delay augmentation are kept: the
        chunk's known steps equal them exactly. This policy has no inpainting guidance.
        """
        if inpaint is not None:
            raise ValueError("the diffusion policy has no inpainting guidance; use a flow diffusion_vla policy")
        cond = self.encode_observation(obs, prepared)
        b = cond.shape[0]
        cfg = self.config
        x = self._initial_noise(noise, b, cond.device)
        prefix = self.committed_actions(obs)
        committed, known = prefix if prefix is not None else (None, None)
        self.sample_scheduler.set_timesteps(cfg.num_inference_steps)
        for t in self.sample_scheduler.timesteps:
            if known is not None:  # as in training: the known steps are clean at every noise level
                x = torch.where(known[..., None], self.normalize_action(committed), x)
            eps = self.denoise(x, t.expand(b).to(cond.device), cond, known)
            x = self.sample_scheduler.step(eps, t, x).prev_sample
        actions = self.unnormalize_action(x.clamp(-1, 1))
        if known is not None:  # exactly the committed actions, not their normalization round trip
            actions = torch.where(known[..., None], committed, actions)
        return self._chunk(actions, obs_step)

    # -- RL fine-tuning -------------------------------------------------------------------------

    @property
    def condition_dim(self) -> int:
        return self.config.hidden_dim

    def condition_features(self, obs: dict) -> torch.Tensor:
        """(B, hidden_dim): ``encode_observation``'s condition, for a value head."""
        return self.encode_observation(obs)

    @torch.no_grad()
    def sample_with_log_prob(
        self, obs: dict, obs_step: torch.Tensor | None = None, *, noise: ExplorationNoise
    ) -> tuple[ActionChunk, DenoisingChain, torch.Tensor]:
        """DDIM sampling with eta = ``noise.eta`` and each step's std floored at ``noise.min_std``; see
        `policies.denoising_chain.DenoisingRL`. eta = 0, min_std = 0 is ``predict_chunk``'s DDIM."""
        noise.validate()
        cond = self.encode_observation(obs)
        b = cond.shape[0]
        prefix = self.committed_actions(obs)
        committed = None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])
        known = None if prefix is None else prefix[1]
        steps = DDIMSteps.from_scheduler(self.sample_scheduler, self.config.num_inference_steps).to(cond.device)

        def step_mean(x: torch.Tensor, k: int) -> torch.Tensor:
            eps = self.denoise(x, steps.timesteps[k].expand(b), cond, known)
            return steps.mean(x, eps, noise.eta, k)

        initial = self._initial_noise(None, b, cond.device)
        chain, log_prob = sample_chain(step_mean, initial, steps.stds(noise), noise.eta, committed)
        actions = self.unnormalize_action(chain.latents[:, -1].clamp(-1, 1))
        if prefix is not None:  # exactly the committed actions, not their normalization round trip
            actions = torch.where(known[..., None], prefix[0], actions)
        return self._chunk(actions, obs_step), chain, log_prob

    def log_prob(self, obs: dict, chain: DenoisingChain, *, per_step: bool = False) -> torch.Tensor:
        """(B,) log-probability of a DDIM-with-eta chain, all K steps in one denoiser call; see
        `policies.denoising_chain.DenoisingRL`."""
        chain.check_density()
        if chain.eta is None:
            raise ValueError("the chain does not record its DDIM eta; sample it with sample_with_log_prob")
        cond = self.encode_observation(obs)  # once; repeated for the K steps below
        b, k, cfg = cond.shape[0], self.config.num_inference_steps, self.config
        check_chain_shape(chain, b, k, cfg.horizon, cfg.action_dim)
        chain = chain.to(cond.device)
        prefix = self.committed_actions(obs)
        committed = None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])
        committed = known_for_chain(committed, chain)
        x = chain.inputs(committed)  # (B, K, H, A), the known steps clean
        steps = DDIMSteps.from_scheduler(self.sample_scheduler, k).to(cond.device)
        t = steps.timesteps.repeat(b)  # row b * K + k: step k
        known = None if committed is None else committed[1].repeat_interleave(k, 0)
        eps = self.denoise(x.flatten(0, 1), t, cond.repeat_interleave(k, 0), known).unflatten(0, (b, k))
        terms = chain.step_log_prob(steps.mean(x, eps, chain.eta))
        return terms if per_step else terms.sum(1)
