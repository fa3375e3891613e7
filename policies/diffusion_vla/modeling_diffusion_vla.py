"""A vision-language diffusion/flow VLA: condition encoder + DiT action expert.

Training takes B conditions and K noised copies of each condition's action chunk (Mini-Diffuser
Level-2 minibatching): the encoder runs B times, the DiT B*K times. K = 1 is conventional training.

Objectives (``config.objective``):

- ``ddpm``: epsilon prediction with diffusers' DDPMScheduler noise; sampling with DDIM or DDPM.
- ``flow``: flow matching with x_t = t * noise + (1 - t) * action, t in [0, 1], regressing the
  velocity noise - action; sampling integrates from t = 1 to 0 with Euler steps (`policies.flow_matching`,
  shared with the small ``diffusion`` policy). Flow sampling can inpaint toward a previous chunk
  (real-time chunking guidance), see ``predict_chunk``, and offers the steering hooks
  (`vla_core.types.FlowSteerable`; its latents are the DiT's final hidden tokens, pooled over the chunk).

Delay augmentation (training-time RTC, Black et al. 2025), only when ``config.max_delay_steps`` > 0:
the chunk steps in ``observation.committed_mask`` are known, already executing actions. Their tokens
enter the DiT clean, with the clean end of the schedule as their own timestep (flow t = 0, ddpm step
0; every other token has the copy's timestep) and a learned known-token embedding added. Training
takes the loss on the unknown, non-padded tokens only, and every Level-2 copy of a condition shares
its known prefix. A batch marked ``zero_delay_pass`` (`vla-rl train`'s) is also denoised at zero
delay, as K more copies of each condition, each with its own noise and timestep, nothing known and
every non-padded token in the loss, as plain training takes it; the loss is the mean of the two
passes' (see the ``diffusion`` policy's docstring for why). Sampling writes the clean committed actions into
the known tokens before every denoising or Euler step, and the returned chunk starts with them exactly.
Inpainting guidance (flow) still applies on top, to the unknown tokens. With max_delay_steps = 0 the
augmentation is ignored and the network is the one without it.

RL fine-tuning (``policies.denoising_chain``): ``sample_with_log_prob`` injects Gaussian noise into each
step, so every step is a Gaussian around the deterministic sampler's step: ddpm, DDIM with eta (DPPO;
DDIM's steps even when ``ddpm_sampler`` is ddpm), std max(eta * sigma_t, min_std); flow, the Euler step
x - v / n with std min_std (ReinFlow-style). ``log_prob`` evaluates all K steps of a stored chain as K
copies in one DiT pass (Level-2 layout) and sums the Gaussian log-densities over the unknown tokens.

Actions are normalized to [-1, 1] with the dataset min/max and states to zero mean, unit variance;
the statistics are buffers, so they travel inside every checkpoint's weights.
"""

from __future__ import annotations

from pathlib import Path

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
from policies.diffusion_vla.condition_encoder import ConditionEncoder
from policies.diffusion_vla.configuration_diffusion_vla import DiffusionVLAConfig
from policies.diffusion_vla.dit import DiT
from policies.flow_matching import FLOW_FIX, FlowHooks, flow_times, flow_training_pair
from policies.keypoints import ImageEncoder
from policies.observation import check_observation
from policies.pretrained import PreTrainedPolicy
from vla_core.types import ACTION, OBS_STATE, TASK, ZERO_DELAY_PASS, ActionChunk, Steer, image_key

ENCODER_DIR = "encoder"  # in a saved directory: pretrained towers' configs and tokenizer
LATENCY_IMAGE_CHANNELS, LATENCY_KEYPOINTS = 16, 16  # the fast head's own image encoder (latency-aware only)


class DiffusionVLAPolicy(FlowHooks, DenoisingRL, PreTrainedPolicy):
    """Implements `vla_core.types.Policy`: observation batch -> ActionChunk (B, horizon, action_dim); with the
    flow objective also the steering hooks (`vla_core.types.FlowSteerable`, `policies.flow_matching`)."""

    config_class = DiffusionVLAConfig
    supports_copies = True

    def __init__(self, config: DiffusionVLAConfig, saved_encoder: Path | None = None):
        super().__init__(config)
        cfg = config
        self.encoder = ConditionEncoder(cfg, saved_encoder)
        self.dit = DiT(
            cfg.action_dim, cfg.horizon, cfg.dim, cfg.depth, cfg.heads, cfg.mlp_ratio,
            known_tokens=cfg.max_delay_steps > 0,
        )  # fmt: skip
        self.register_normalization(cfg.state_dim, cfg.action_dim, cfg.action_bounds)
        self.latency_head = self.build_latency_head() if cfg.latency_aware else None
        self.low_latency = self.build_low_latency() if cfg.low_latency else None
        sched = {
            "num_train_timesteps": cfg.num_train_timesteps,
            "beta_schedule": cfg.beta_schedule,
            "clip_sample": True,
        }
        self.train_scheduler = DDPMScheduler(**sched, prediction_type="epsilon")
        sampler = DDIMScheduler if cfg.ddpm_sampler == "ddim" else DDPMScheduler
        self.sample_scheduler = sampler(**sched, prediction_type="epsilon")

    @classmethod
    def for_directory(cls, config: DiffusionVLAConfig, directory: Path) -> DiffusionVLAPolicy:
        """Built from a saved directory's own ``encoder/`` when it has one (pretrained towers' configs and
        tokenizer), so a checkpoint loads without the directory its towers were first loaded from."""
        saved = Path(directory) / ENCODER_DIR
        return cls(config, saved_encoder=saved if saved.is_dir() else None)

    def save_assets(self, directory: Path) -> None:
        self.encoder.save(Path(directory) / ENCODER_DIR)

    # -- conditioning -------------------------------------------------------------------------

    def encode_observation(self, obs: dict, prepared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Observation batch -> condition tokens (B, L, dim) and mask (B, L). Validates the input.

        A latency-aware policy adds its fast head's correction (`policies.latency_head`) to every token:
        the slow part (the towers) reads the request's observation, the fast part the committed actions
        and the mid-inference one. prepared: ``prepare_request(obs)``, if computed already.
        """
        slow = prepared if prepared is not None else self.prepare_request(obs)
        tokens, mask = slow["cond"]
        correction = self.latency_correction(obs, slow)
        return (tokens, mask) if correction is None else (tokens + correction[:, None], mask)

    def prepare_request(self, obs: dict) -> dict:
        """The slow part on the request's observation: the condition tokens before any fast-head correction,
        the normalized state and, for a latency-aware policy, its head's keypoints of the request's images
        (`vla_core.types.LatencyAwarePolicy`)."""
        check_observation(obs, self.config.state_dim, self.config.cameras, image_size=None)  # the encoder resizes
        state = self.normalize_state(obs[OBS_STATE])
        images = [obs[image_key(cam)] for cam in self.config.cameras]
        keypoints = {}
        if self.latency_head is not None:
            keypoints = {
                cam: self.latency_head.mid_encoders[cam](obs[image_key(cam)]) for cam in self.config.mid_cameras
            }
        return {"cond": self.encoder(images, state, list(obs[TASK])), "state": state, "keypoints": keypoints}

    def latency_head_inputs(self) -> tuple[dict[str, nn.Module], int, int]:
        """See ``PreTrainedPolicy.latency_head_inputs``. The SigLIP tower is the slow part, too slow to run on
        the mid observation: the fast head encodes the request's and the mid images with a small keypoint
        CNN of its own (`policies.keypoints`), so their difference is the world's motion in its features."""
        cameras = dict.fromkeys(
            [*self.config.mid_cameras, *self.config.low_latency_cameras]
        )  # a low-latency part's too
        encoders = {cam: ImageEncoder(LATENCY_IMAGE_CHANNELS, LATENCY_KEYPOINTS) for cam in cameras}
        return encoders, 2 * LATENCY_KEYPOINTS, self.config.dim

    # -- training -----------------------------------------------------------------------------

    def forward(self, batch: dict, generator: torch.Generator | None = None, copies: int = 1) -> torch.Tensor:
        """Denoising loss with Level-2 minibatching; the scalar mean over all B*K samples.

        batch: observation keys of B conditions + ``action`` (B, H, A) + ``action_is_pad`` (B, H).
        copies: K noised copies of each condition's chunk, each with its own noise and timestep. With
        max_delay_steps > 0 and the delay augmentation in the batch, the committed steps enter clean
        in every copy and are left out of the loss; with ``ZERO_DELAY_PASS`` the frames are also denoised
        at zero delay (see the module docstring and `chunk_loss`).
        """
        actions = batch[ACTION]
        cfg = self.config
        if actions.ndim != 3 or actions.shape[1:] != (cfg.horizon, cfg.action_dim):
            raise ValueError(f"batch actions must be (B, {cfg.horizon}, {cfg.action_dim}), got {tuple(actions.shape)}")
        if not torch.isfinite(actions).all():
            raise ValueError("the training batch has NaN or inf actions; check the dataset")
        cond, cond_mask = self.encode_observation(batch)  # once per condition, not per copy
        b = actions.shape[0]
        prefix = self.committed_actions(batch)
        # The zero-delay pass: K more copies of each condition, each with its own noise and timestep, nothing known.
        k = 2 * copies if prefix is not None and batch.get(ZERO_DELAY_PASS, False) else copies
        target = self.normalize_action(actions)[:, None].expand(b, k, -1, -1)  # (B, K, H, A), a view
        noise = torch.randn(target.shape, generator=generator, device=target.device)
        if cfg.objective == "flow":
            t = torch.rand(b, k, generator=generator, device=target.device)  # (B, K)
            noisy, regress = flow_training_pair(target, noise, t[..., None, None])
        else:
            t = torch.randint(0, cfg.num_train_timesteps, (b, k), generator=generator, device=target.device)
            # diffusers expects one timestep per leading index, so flatten (B, K) for the call.
            noisy = self.train_scheduler.add_noise(target.flatten(0, 1), noise.flatten(0, 1), t.flatten())
            noisy = noisy.unflatten(0, (b, k))
            regress = noise
        t, known = t.float(), None
        if prefix is not None:
            committed, given = prefix
            known = given[:, None].expand(-1, copies, -1)  # every copy of a condition shares its prefix
            known = torch.cat([known, torch.zeros_like(known)], 1) if k > copies else known
            noisy, t, known = self._insert_known(noisy, t, self.normalize_action(committed), known)
        prediction = self.dit(noisy, t, cond, cond_mask, known)
        err = F.mse_loss(prediction, regress, reduction="none").mean(-1)  # (B, K, H)
        if k > copies:
            return self.chunk_loss(err[:, :copies], batch, given, at_zero_delay=err[:, copies:])
        return self.chunk_loss(err, batch, None if prefix is None else given)  # the committed steps are given

    @staticmethod
    def _insert_known(x: torch.Tensor, t: torch.Tensor, clean: torch.Tensor, known: torch.Tensor):
        """Make the known tokens clean: (x (B, K, H, A), per-token t (B, K, H), known (B, K, H)).

        x: (B, K, H, A) noised chunks; t: (B, K) float timesteps; clean: (B, H, A) normalized
        committed actions; known: (B, H) bool, shared by the K copies of a condition, or (B, K, H), one
        per copy. The clean end of the schedule is 0 for both objectives (flow t = 0, ddpm step 0).
        """
        known = known[:, None].expand(-1, x.shape[1], -1) if known.ndim == 2 else known  # (B, K, H)
        x = torch.where(known[..., None], clean[:, None], x)
        t = torch.where(known, 0.0, t[..., None].expand_as(known))
        return x, t, known

    # -- inference ----------------------------------------------------------------------------

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
        """obs batch of size B -> ActionChunk (B, horizon, action_dim) in dataset units.

        noise: (B, horizon, action_dim) sampler start in normalized units (drawn when None).
        inpaint: (target (B, H, A) in dataset units, weights (B, H) in [0, 1]), flow only. Sampling is
        guided so that the chunk's steps with weight 1 follow the target and the rest are free
        (real-time chunking, Black et al. 2025: pseudo-inverse guidance on the predicted clean chunk,
        with the guidance weight clipped at ``rtc_max_guidance``).
        With max_delay_steps > 0, the committed actions of the delay augmentation are kept: the
        chunk's known steps equal them exactly (training-time RTC; see the module docstring).
        prepared: ``prepare_request(obs)``'s output, computed before the mid-inference observation came.
        steer: flow only, an extra velocity at every Euler step (`vla_core.types.Steer`; its latents are
        the DiT's final hidden tokens, pooled: ``latents``). The condition is encoded once.
        """
        if steer is not None:
            self.require_flow("steer")
        condition = cond, cond_mask = self.encode_observation(obs, prepared)
        prefix = self.committed_actions(obs)
        clean = None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])
        b, cfg = cond.shape[0], self.config
        x = self._initial_noise(noise, b, cond.device)
        if cfg.objective == "flow":
            x = self._sample_flow(x, condition, clean, inpaint, steer)
        else:
            if inpaint is not None:
                raise ValueError(f"inpainting guidance needs a flow policy; {FLOW_FIX}")
            x = x[:, None]  # (B, 1, H, A): one copy per condition
            self.sample_scheduler.set_timesteps(cfg.num_inference_steps)
            for t in self.sample_scheduler.timesteps:
                x, tt, known = self._timesteps(x, float(t), clean)
                eps = self.dit(x, tt, cond, cond_mask, known)
                x = self.sample_scheduler.step(eps, t, x).prev_sample
            x = x[:, 0]
        actions = self.unnormalize_action(self.clamp_chunk(x))
        if prefix is not None:  # exactly the committed actions, not their normalization round trip
            actions = torch.where(prefix[1][..., None], prefix[0], actions)
        return self._chunk(actions, obs_step)

    def _timesteps(self, x: torch.Tensor, t: float, clean: tuple[torch.Tensor, torch.Tensor] | None):
        """The DiT's input at sampler time t: (x (B, 1, H, A), timesteps, known (B, 1, H) or None).

        Without known steps the timesteps are one per chunk, (B, 1); with them (clean: normalized
        committed actions (B, H, A) and known (B, H)) the known steps of x are overwritten with their
        clean actions and get the clean timestep, as in training: (B, 1, H) timesteps.
        """
        tt = torch.full(x.shape[:2], t, device=x.device)
        if clean is None:
            return x, tt, None
        return self._insert_known(x, tt, *clean)

    # -- the flow objective's hooks (`policies.flow_matching.FlowHooks`) -------------------------------

    def _flow_inputs(self, obs: dict, prepared: dict | None = None):
        """(condition tokens and mask, committed (normalized actions (B, H, A), known (B, H)) or None)."""
        condition = self.encode_observation(obs, prepared)
        prefix = self.committed_actions(obs)
        return condition, None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])

    def _flow_pass(self, x, t, condition, committed, want_latents: bool = False):
        """One DiT pass at x (B, H, A) and t (B,), the known steps clean at time 0 -> (velocity (B, H, A),
        latents (B, dim): the final hidden tokens the output layer reads, mean over the H chunk tokens)."""
        cond, cond_mask = condition
        xx, tt, known = x[:, None], t[:, None], None
        if committed is not None:
            xx, tt, known = self._insert_known(xx, tt, *committed)
        if not want_latents:
            return self.dit(xx, tt, cond, cond_mask, known)[:, 0], None
        v, hidden = self.dit(xx, tt, cond, cond_mask, known, with_hidden=True)
        return v[:, 0], hidden[:, 0].mean(1)

    @property
    def _latent_width(self) -> int:
        return self.config.dim

    # -- RL fine-tuning -------------------------------------------------------------------------

    @property
    def condition_dim(self) -> int:
        return self.config.dim

    def condition_features(self, obs: dict) -> torch.Tensor:
        """(B, dim): the mean of the condition tokens over their mask, for a value head."""
        cond, cond_mask = self.encode_observation(obs)
        weights = cond_mask.to(cond)[..., None]
        return (cond * weights).sum(1) / weights.sum(1).clamp_min(1)

    def rl_actor(self, noise: ExplorationNoise, augmentation_width: int = 0):
        """The denoising actor (`policies.denoising_chain.DenoisingRL`), refused with the fix where RL would not
        train what evaluation runs or a setting would do nothing."""
        cfg = self.config
        if cfg.objective == "ddpm" and cfg.ddpm_sampler == "ddpm":
            raise ValueError(
                "RL scores DDIM-with-eta chains, but this policy samples with DDPM (policy.ddpm_sampler=ddpm), so "
                'evaluation and serving would not run the policy RL trains; set "ddpm_sampler": "ddim" in the '
                "checkpoint's pretrained_model/config.json (the weights stay as they are) and fine-tune that"
            )
        return super().rl_actor(noise, augmentation_width)  # FlowHooks refuses an eta under flow

    @torch.no_grad()
    def sample_with_log_prob(
        self, obs: dict, obs_step: torch.Tensor | None = None, *, noise: ExplorationNoise
    ) -> tuple[ActionChunk, DenoisingChain, torch.Tensor]:
        """Noisy sampling: ddpm takes DDIM steps with eta = ``noise.eta`` (whatever ``ddpm_sampler``
        is) and std max(eta * sigma_t, min_std); flow takes Euler steps with std ``noise.min_std``. See
        `policies.denoising_chain.DenoisingRL`; noise 0 is ``predict_chunk``'s sampler (DDIM for ddpm)."""
        noise.validate()
        condition = cond, cond_mask = self.encode_observation(obs)
        b, n = cond.shape[0], self.config.num_inference_steps
        prefix = self.committed_actions(obs)
        committed = None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])
        initial = self._initial_noise(None, b, cond.device)
        if self.config.objective == "flow":
            chain, log_prob = self._sample_flow_chain(initial, condition, committed, noise)
        else:
            steps = DDIMSteps.from_scheduler(self.sample_scheduler, n)
            times = steps.timesteps.float()  # read as Python floats, step by step
            steps = steps.to(cond.device)

            def step_mean(x: torch.Tensor, k: int) -> torch.Tensor:
                xx, tt, known = self._timesteps(x[:, None], float(times[k]), committed)
                return steps.mean(x, self.dit(xx, tt, cond, cond_mask, known)[:, 0], noise.eta, k)

            chain, log_prob = sample_chain(step_mean, initial, steps.stds(noise), noise.eta, committed)
        actions = self.unnormalize_action(self.clamp_chunk(chain.latents[:, -1]))
        if prefix is not None:  # exactly the committed actions, not their normalization round trip
            actions = torch.where(prefix[1][..., None], prefix[0], actions)
        return self._chunk(actions, obs_step), chain, log_prob

    def log_prob(self, obs: dict, chain: DenoisingChain, *, per_step: bool = False) -> torch.Tensor:
        """(B,) log-probability of a chain; the K steps are K copies of one DiT pass, the condition
        encoded once. See `policies.denoising_chain.DenoisingRL`."""
        chain.check_density()
        flow = self.config.objective == "flow"
        if not flow and chain.eta is None:
            raise ValueError("the chain does not record its DDIM eta; sample it with sample_with_log_prob")
        cond, cond_mask = self.encode_observation(obs)
        b, n, cfg = cond.shape[0], self.config.num_inference_steps, self.config
        check_chain_shape(chain, b, n, cfg.horizon, cfg.action_dim)
        chain = chain.to(cond.device)
        prefix = self.committed_actions(obs)
        committed = None if prefix is None else (self.normalize_action(prefix[0]), prefix[1])
        committed = known_for_chain(committed, chain)
        x = chain.inputs(committed)  # (B, K, H, A): step k is copy k
        if flow:
            times = torch.tensor(flow_times(n), device=cond.device)
        else:
            steps = DDIMSteps.from_scheduler(self.sample_scheduler, n).to(cond.device)
            times = steps.timesteps.float()
        t = times.expand(b, n)
        known = None
        if committed is not None:
            x, t, known = self._insert_known(x, t, *committed)
        out = self.dit(x, t, cond, cond_mask, known)
        means = x - out / n if flow else steps.mean(x, out, chain.eta)
        terms = chain.step_log_prob(means)
        return terms if per_step else terms.sum(1)
