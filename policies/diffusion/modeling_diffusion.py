"""A small diffusion policy in the style of Diffusion Policy (Chi et al.), sized for CPU training.

- Vision: a 3-layer CNN per camera ending in spatial softmax (learned keypoints), which localizes
  objects precisely from few demonstrations.
- Instruction: mean of learned word embeddings over a vocabulary taken from the dataset's tasks
  (``policies.tokenizer``).
- Denoiser: residual MLP over the flattened chunk (H*A), FiLM-conditioned on the observation
  embedding and the diffusion timestep.
- Objectives (``config.objective``): ``ddpm`` (the default): epsilon prediction, `diffusers`
  DDPMScheduler noise for training, DDIMScheduler for sampling. ``flow``: flow matching as
  ``diffusion_vla`` takes it (`policies.flow_matching`: x_t = t * noise + (1 - t) * action, t ~ U(0, 1),
  regressing the velocity noise - action; Euler sampling from t = 1 to 0), with real-time-chunking
  inpainting (`policies.flow_guidance`) and the steering hooks (`vla_core.types.FlowSteerable`; its
  latents are the denoiser's last hidden vector, one for the whole chunk). Its time is embedded as
  ``FLOW_TIME_SCALE * t``, the range of the ddpm objective's integer timesteps, which the sinusoidal
  embedding's frequencies resolve.

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

RL fine-tuning (``policies.denoising_chain``): ``sample_with_log_prob`` runs DDIM with eta (ddpm, DPPO-style),
so each step is a Gaussian around DDIM's step mean with std max(eta * sigma_t, min_std), or the Euler
steps x - v / n with std min_std (flow, ReinFlow-style, as ``diffusion_vla``), and the chunk is that
Gaussian chain's last sample. ``log_prob`` evaluates all K steps of a stored chain in one denoiser call
and sums their Gaussian log-densities over the unknown chunk steps.

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
from policies.flow_matching import FLOW_FIX, FlowHooks, flow_times, flow_training_pair
from policies.keypoints import ImageEncoder, SpatialSoftmax  # noqa: F401 (SpatialSoftmax: this module's name for it)
from policies.observation import check_observation
from policies.pretrained import PreTrainedPolicy
from policies.tokenizer import PAD_WORD, UNKNOWN_WORD, WordTokenizer
from vla_core.types import ACTION, OBS_STATE, TASK, ZERO_DELAY_PASS, ActionChunk, Steer, image_key

# The flow objective's time t in [0, 1] enters the timestep embedding as FLOW_TIME_SCALE * t: the range of the
# ddpm objective's default 100 timesteps. Its fastest frequency is 1 per unit, so t itself would barely turn it.
FLOW_TIME_SCALE = 100.0


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(B,) timesteps (integer, or the flow's scaled time) -> (B, dim) sinusoidal embedding."""
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


class DiffusionPolicy(FlowHooks, DenoisingRL, PreTrainedPolicy):
    """Implements `vla_core.types.Policy`: observation batch -> ActionChunk of (B, horizon, action_dim); with the
    flow objective also the steering hooks (`vla_core.types.FlowSteerable`, `policies.flow_matching`)."""

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

        self.register_normalization(cfg.state_dim, cfg.action_dim, cfg.action_bounds)
        self.latency_head = self.build_latency_head() if cfg.latency_aware else None
        self.low_latency = self.build_low_latency() if cfg.low_latency else None

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
        self,
        noisy: torch.Tensor,
        t: torch.Tensor,
        cond: torch.Tensor,
        known: torch.Tensor | None = None,
        with_latents: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """noisy (B, H, A), t (B,), cond (B, D) -> predicted noise (ddpm) or velocity (flow) (B, H, A).

        t: the objective's time: integer timesteps (ddpm) or t in [0, 1] (flow, 1 = noise). known: (B, H)
        bool, the chunk steps that hold clean committed actions (None: none); read only when the policy
        has max_delay_steps > 0. with_latents: also return the last hidden vector (B, hidden_dim), as the
        output layer reads it (after its LayerNorm).
        """
        b = noisy.shape[0]
        steps = t * FLOW_TIME_SCALE if self.config.objective == "flow" else t
        c = cond + self.time_proj(timestep_embedding(steps, cond.shape[-1]))
        chunk = noisy
        if self.reads_known:
            flags = torch.zeros(noisy.shape[:2], device=noisy.device) if known is None else known.to(noisy)
            chunk = torch.cat([noisy, flags[..., None]], -1)  # (B, H, A + 1)
        x = self.input_proj(chunk.reshape(b, -1))
        for block in self.blocks:
            x = block(x, c)
        hidden = self.output_proj[0](x)
        out = self.output_proj[1](hidden).reshape(noisy.shape)
        return (out, hidden) if with_latents else out

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
        if self.config.objective == "flow":
            t = torch.rand(passes * b, generator=generator, device=target.device)
            noisy, regress = flow_training_pair(target, noise, t[:, None, None])
        else:
            t = torch.randint(
                0, self.config.num_train_timesteps, (passes * b,), generator=generator, device=target.device
            )
            noisy, regress = self.train_scheduler.add_noise(target, noise, t), noise
        known = None
        if prefix is not None:
            committed, given = prefix
            known = torch.cat([given, torch.zeros_like(given)]) if passes == 2 else given
            noisy = torch.where(known[..., None], self.normalize_action(committed).repeat(passes, 1, 1), noisy)
        err = F.mse_loss(self.denoise(noisy, t, cond, known), regress, reduction="none").mean(-1)  # (passes * B, H)
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
        steer: Steer | None = None,
    ) -> ActionChunk:
        """obs batch of size B -> ActionChunk (B, horizon, action_dim) in dataset units (DDIM sampling, or
        Euler steps for flow).

        noise: (B, horizon, action_dim) sampler start (see ``PreTrainedPolicy.predict_chunk``).
        inpaint (flow only): (target (B, H, A) in dataset units, weights (B, H) in [0, 1]), real-time
        chunking guidance (`policies.flow_guidance`, weight clipped at ``rtc_max_guidance``).
        prepared: ``prepare_request(obs)``'s output, computed before the mid-inference observation came.
        steer (flow only): an extra velocity at every Euler step (`vla_core.types.Steer`); the
        observation is encoded once. With max_delay_steps > 0, the committed actions of the delay
        augmentation are kept: the chunk's known steps equal them exactly.
        """
        if steer is not None:
            self.require_flow("steer")
        if inpaint is not None and self.config.objective != "flow":
            raise ValueError(f"inpainting guidance needs a flow policy; {FLOW_FIX}")
        cond = self.encode_observation(obs, prepared)
        b = cond.shape[0]
        cfg = self.config
        x = self._initial_noise(noise, b, cond.device)
        prefix = self.committed_actions(obs)
        committed, known = prefix if prefix is not None else (None, None)
        if cfg.objective == "flow":
            clean = None if prefix is None else (self.normalize_action(committed), known)
            x = self._sample_flow(x, cond, clean, inpaint, steer)
        else:
            self.sample_scheduler.set_timesteps(cfg.num_inference_steps)
            for t in self.sample_scheduler.timesteps:
                if known is not None:  # as in training: the known steps are clean at every noise level
                    x = torch.where(known[..., None], self.normalize_action(committed), x)
                eps = self.denoise(x, t.expand(b).to(cond.device), cond, known)
                x = self.sample_scheduler.step(eps, t, x).prev_sample
        actions = self.unnormalize_action(self.clamp_chunk(x))
        if known is not None:  # exactly the committed actions, not their normalization round trip
            actions = torch.where(known[..., None], committed, actions)
        return self._chunk(actions, obs_step)

    # -- the flow objective's hooks (`policies.flow_matching.FlowHooks`) -------------------------------

    def _flow_inputs(self, obs: dict, prepared: dict | None = None):
        """(the condition (B, hidden_dim), committed (normalized actions (B, H, A), known (B, H)) or None)."""
        cond = self.encode_observation(obs, prepared)
        prefix = self.committed_actions(obs)
        return cond, None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])

    def _flow_pass(self, x, t, cond, committed, want_latents: bool = False):
        """One denoiser pass at x (B, H, A) and t (B,), the known steps clean -> (velocity (B, H, A), latents
        (B, hidden_dim): the last hidden vector, one for the whole chunk (the MLP has no per-step tokens))."""
        known = None
        if committed is not None:
            clean, known = committed
            x = torch.where(known[..., None], clean, x)
        if not want_latents:
            return self.denoise(x, t, cond, known), None
        return self.denoise(x, t, cond, known, with_latents=True)

    @property
    def _latent_width(self) -> int:
        return self.config.hidden_dim

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
        """ddpm: DDIM sampling with eta = ``noise.eta`` and each step's std floored at ``noise.min_std``; flow:
        Euler steps with std ``noise.min_std``. See `policies.denoising_chain.DenoisingRL`; eta = 0,
        min_std = 0 is ``predict_chunk``'s sampler."""
        noise.validate()
        cond = self.encode_observation(obs)
        b = cond.shape[0]
        prefix = self.committed_actions(obs)
        committed = None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])
        known = None if prefix is None else prefix[1]
        initial = self._initial_noise(None, b, cond.device)
        if self.config.objective == "flow":
            chain, log_prob = self._sample_flow_chain(initial, cond, committed, noise)
        else:
            steps = DDIMSteps.from_scheduler(self.sample_scheduler, self.config.num_inference_steps).to(cond.device)

            def step_mean(x: torch.Tensor, k: int) -> torch.Tensor:
                eps = self.denoise(x, steps.timesteps[k].expand(b), cond, known)
                return steps.mean(x, eps, noise.eta, k)

            chain, log_prob = sample_chain(step_mean, initial, steps.stds(noise), noise.eta, committed)
        actions = self.unnormalize_action(self.clamp_chunk(chain.latents[:, -1]))
        if prefix is not None:  # exactly the committed actions, not their normalization round trip
            actions = torch.where(known[..., None], prefix[0], actions)
        return self._chunk(actions, obs_step), chain, log_prob

    def log_prob(self, obs: dict, chain: DenoisingChain, *, per_step: bool = False) -> torch.Tensor:
        """(B,) log-probability of a chain (DDIM with eta, or the flow's Euler steps), all K steps in one
        denoiser call; see `policies.denoising_chain.DenoisingRL`."""
        chain.check_density()
        flow = self.config.objective == "flow"
        if not flow and chain.eta is None:
            raise ValueError("the chain does not record its DDIM eta; sample it with sample_with_log_prob")
        cond = self.encode_observation(obs)  # once; repeated for the K steps below
        b, k, cfg = cond.shape[0], self.config.num_inference_steps, self.config
        check_chain_shape(chain, b, k, cfg.horizon, cfg.action_dim)
        chain = chain.to(cond.device)
        prefix = self.committed_actions(obs)
        committed = None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])
        committed = known_for_chain(committed, chain)
        x = chain.inputs(committed)  # (B, K, H, A), the known steps clean
        if flow:
            times = torch.tensor(flow_times(k), device=cond.device)
        else:
            steps = DDIMSteps.from_scheduler(self.sample_scheduler, k).to(cond.device)
            times = steps.timesteps
        t = times.repeat(b)  # row b * K + k: step k
        known = None if committed is None else committed[1].repeat_interleave(k, 0)
        out = self.denoise(x.flatten(0, 1), t, cond.repeat_interleave(k, 0), known).unflatten(0, (b, k))
        means = x - out / k if flow else steps.mean(x, out, chain.eta)
        terms = chain.step_log_prob(means)
        return terms if per_step else terms.sum(1)
