"""DSRL-NA: soft actor-critic in the noise space of a frozen flow policy, as DSRL's authors run it, one learner
file, the math in view (Wagenmaker et al. 2025, "Steering your diffusion policy with latent space RL", its
noise-aliased variant).

The decision is the initial noise of the rows that run. For an observation o the agent's own small encoder
(`Encoder`: a convolution stack over the raw images and the state, trained by the critics) gives the state s;
the actor draws w = k tanh(u), u ~ N(mu(s), sigma(s)), over the first E rows of the noise (E = the rows a chunk
runs at zero delay, times the noise's per-row width; k = ``max_noise``, set from the sigma probe of the base,
`vla-rl eval --noise_scale`); the other rows of the noise are 0 (their mean), so the chunk is a function of w.
The chunk is the frozen policy's ``predict_chunk(o, noise)``. The rollout is the one PPO and GRPO use
(`vla_rl.rl.rollout.collect`: one decision per chunk); a transition is (o, w, a, R, gamma^steps, o', done), a the
rows of the chunk that ran (E, action_dim), R the discounted reward of its window, o' the next decision's
observation in the same episode.

Two critics, each an ensemble of ``critics`` LayerNorm MLPs on the encoder's features, and their Polyak targets:

    action critic:  Q^A(s, a) -> R + gamma^steps (1 - done) (mean_j Qbar^W_j(s', w') - alpha log pi(w'|s')),
                    w' ~ pi(.|s'),
    noise critic:   Q^W(s, w) -> mean_j Q^A_j(s, a(s, w)),   a(s, w) the rows the base makes of w,
                    for the transition's own w and for ``distill_batch`` fresh w ~ N(0, I) clipped to the box,
    actor:          L_pi = alpha log pi(w|s) - mean_j Q^W_j(s, w),   w ~ pi(.|s) (reparametrized; features
                    detached: only the critics train the encoder),
    temperature:    L_alpha = -alpha (log pi(w|s) + target_entropy),   target_entropy = -dim(w) / 2.

The noise critic sees many noises per state through the base (the aliasing that gives the method its name), the
action critic learns from what ran. Each backup averages the ensemble (the authors' mean backup). ``utd`` gradient
steps per new transition once the buffer holds ``warmup_transitions`` transitions of the base's own noise
(N(0, I) clipped to the box).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from vla_core.types import OBS_IMAGES, OBS_STATE, TASK, ActionChunk
from vla_rl.rl.networks import mlp


@dataclass
class SACConfig:
    gamma: float = 0.99  # per control step: a chunk's discount is gamma^(the steps it ran)
    tau: float = 0.005  # Polyak rate of the target networks
    lr: float = 3e-4  # every network and the temperature
    batch_size: int = 256
    utd: float = 10.0  # gradient steps per new transition, after the warm-up
    warmup_transitions: int = 256  # the base's own noise until the buffer holds this many
    buffer_size: int = 100_000  # transitions kept
    max_noise: float = 1.5  # k: the noise is k tanh(u); set it from the sigma probe (`vla-rl eval --noise_scale`)
    hidden: int = 256
    critics: int = 5  # ensemble members of each critic
    alpha_init: float = 1.0
    distill_batch: int = 32  # states whose fresh noises go through the base each step, for the noise critic
    feature_dim: int = 64  # the encoder's output


@dataclass
class NoiseDecision:
    """B decisions: ``noise`` (B, D) the agent's, in [-k, k]; ``chunk`` (B, H, A) the chunk it gave."""

    noise: torch.Tensor
    chunk: torch.Tensor

    def __len__(self) -> int:
        return len(self.noise)

    def select(self, rows: torch.Tensor) -> NoiseDecision:
        return NoiseDecision(self.noise[rows], self.chunk[rows])

    def to(self, device) -> NoiseDecision:
        return NoiseDecision(self.noise.to(device), self.chunk.to(device))

    @staticmethod
    def cat(decisions) -> NoiseDecision:
        return NoiseDecision(torch.cat([d.noise for d in decisions]), torch.cat([d.chunk for d in decisions]))


def image_keys(obs: dict) -> list[str]:
    return sorted(k for k in obs if k.startswith(OBS_IMAGES + "."))


def compact(obs: dict) -> dict[str, torch.Tensor]:
    """What the agent (and its replay) keeps of an observation batch: ``images`` (B, 3 C, S, S) uint8, the cameras
    in name order stacked along channels, and ``state`` (B, state_dim) float. (The replay's keys may hold no dots:
    TensorDict reads a dotted key back as nested ones.)"""
    images = torch.cat([obs[k] for k in image_keys(obs)], dim=1)
    if images.dtype != torch.uint8:
        images = (images * 255).round().to(torch.uint8)
    return {"images": images, "state": obs[OBS_STATE].float()}


def expand(kept: dict[str, torch.Tensor], cameras: list[str], task: str) -> dict:
    """The policy's observation batch of a `compact` one: each camera's images in [0, 1], the state, the task."""
    images = kept["images"].float() / 255
    obs = {f"{OBS_IMAGES}.{camera}": images[:, 3 * i : 3 * i + 3] for i, camera in enumerate(sorted(cameras))}
    return {**obs, OBS_STATE: kept["state"], TASK: [task] * len(images)}


class Encoder(nn.Module):
    """The agent's own observation encoder: the images (each (B, 3, S, S) in [0, 1], stacked along channels) through
    three stride-2 convolutions, with the state (B, state_dim), to (B, feature_dim) in [-1, 1]."""

    def __init__(self, cameras: int, image_size: int, state_dim: int, feature_dim: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3 * cameras, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                                  nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU(), nn.Flatten())  # fmt: skip
        flat = 32 * math.ceil(image_size / 8) ** 2
        self.head = nn.Sequential(nn.Linear(flat + state_dim, feature_dim), nn.LayerNorm(feature_dim), nn.Tanh())

    def forward(self, images: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.conv(images), state], dim=1))


class Ensemble(nn.Module):
    """``n`` LayerNorm MLPs of the same input: (B, inputs) -> (n, B)."""

    def __init__(self, inputs: int, hidden: int, n: int):
        super().__init__()
        self.members = nn.ModuleList(mlp(inputs, hidden, 1, layer_norm=True) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x).squeeze(-1) for m in self.members])


class Critics(nn.Module):
    """The encoder and both critics: what the TD losses train, and what its Polyak copy targets."""

    def __init__(self, encoder: Encoder, feature_dim: int, noise_dim: int, action_dim: int, cfg: SACConfig):
        super().__init__()
        self.encoder = encoder
        self.q_action = Ensemble(feature_dim + action_dim, cfg.hidden, cfg.critics)
        self.q_noise = Ensemble(feature_dim + noise_dim, cfg.hidden, cfg.critics)


class NoiseAgent:
    """The DSRL-NA agent over a frozen flow ``policy`` (an `vla_core.rl.RLPolicy` for the shared rollout): ``act``
    samples noises and the chunks they give; ``deterministic_noise`` is the actor's mean, k tanh(mu).
    ``executed_rows``: E, the rows a chunk runs (at zero delay, rows 0 .. E - 1)."""

    def __init__(self, policy, cfg: SACConfig, executed_rows: int):
        self.policy, self.cfg, self.rows = policy, cfg, executed_rows
        config = policy.config
        noise_shape = tuple(policy.noise_shape)
        self.noise_dim = executed_rows * math.prod(noise_shape[1:])
        self.action_dim = executed_rows * config.action_dim
        cameras = len(getattr(config, "cameras", [])) or 1
        encoder = Encoder(cameras, config.image_size, config.state_dim, cfg.feature_dim)
        self.critics = Critics(encoder, cfg.feature_dim, self.noise_dim, self.action_dim, cfg)
        self.target = Critics(Encoder(cameras, config.image_size, config.state_dim, cfg.feature_dim),
                              cfg.feature_dim, self.noise_dim, self.action_dim, cfg)  # fmt: skip
        self.target.load_state_dict(self.critics.state_dict())
        self.target.requires_grad_(False)
        self.actor_net = mlp(cfg.feature_dim, cfg.hidden, 2 * self.noise_dim)
        self.log_alpha = torch.tensor(math.log(cfg.alpha_init), requires_grad=True)
        self.target_entropy = -self.noise_dim / 2
        self.critic_optimizer = torch.optim.Adam(self.critics.parameters(), lr=cfg.lr)
        self.actor_optimizer = torch.optim.Adam(self.actor_net.parameters(), lr=cfg.lr)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=cfg.lr)
        self.num_factors, self.value_dim = 1, cfg.feature_dim
        self.warming_up = False  # act with the base's own noise (the warm-up)
        self.task = ""  # the instruction of the rollouts (one agent per setting): the base reads it when distilling

    @property
    def device(self) -> torch.device:
        return self.policy.device

    # -- acting ------------------------------------------------------------------------------------

    def features(self, kept: dict[str, torch.Tensor], critics: Critics | None = None) -> torch.Tensor:
        """(B, feature_dim) the encoder's state of a `compact` observation (the critics' encoder, or ``critics``')."""
        return (critics or self.critics).encoder(kept["images"].float() / 255, kept["state"])

    def sample(self, features: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(w (B, D) in [-k, k], log pi(w|s) (B,)): the tanh-squashed Gaussian's draw (its mean, deterministic)."""
        mu, log_std = self.actor_net(features).chunk(2, dim=-1)
        log_std = log_std.clamp(-5.0, 2.0)
        u = mu if deterministic else mu + log_std.exp() * torch.randn_like(mu)
        # log N(u) minus the tanh and the scale k's Jacobians (stable form of log(1 - tanh(u)^2)).
        log_prob = (-0.5 * ((u - mu) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        log_prob = (
            log_prob
            - (2 * (math.log(2) - u - F.softplus(-2 * u))).sum(-1)
            - self.noise_dim * math.log(self.cfg.max_noise)
        )
        return self.cfg.max_noise * torch.tanh(u), log_prob

    def full_noise(self, w: torch.Tensor) -> torch.Tensor:
        """(B, *noise_shape): the agent's rows first, the rest 0."""
        shape = tuple(self.policy.noise_shape)
        noise = torch.zeros(len(w), *shape, device=w.device)
        noise[:, : self.rows] = w.view(len(w), self.rows, *shape[1:])
        return noise

    @torch.no_grad()
    def act(self, obs: dict, obs_step: torch.Tensor) -> tuple[ActionChunk, NoiseDecision]:
        """Chunks of the agent's noises (while ``warming_up``: of the base's own, N(0, I) clipped to the box)."""
        self.task = obs[TASK][0] if TASK in obs else ""
        if self.warming_up:
            w = torch.randn(len(obs_step), self.noise_dim, device=self.device).clamp(
                -self.cfg.max_noise, self.cfg.max_noise
            )
        else:
            w, _ = self.sample(self.features(compact(obs)))
        chunk = self.policy.predict_chunk(obs, obs_step, noise=self.full_noise(w))
        return chunk, NoiseDecision(w.cpu(), chunk.actions.cpu())

    @torch.no_grad()
    def deterministic_noise(self, obs: dict) -> torch.Tensor:
        """(B, *noise_shape) the actor's deterministic noise for ``obs``."""
        return self.full_noise(self.sample(self.features(compact(obs)), deterministic=True)[0])

    def score(self, obs, decision, executed=None):
        raise NotImplementedError("SAC learns from its critics, not from scored log-probabilities")

    def value_features(self, obs: dict) -> torch.Tensor:
        return self.features(compact(obs))

    # -- learning ----------------------------------------------------------------------------------

    def executed_actions(self, kept: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        """(B, E * action_dim) the rows the base makes of noises w (B, D) for the `compact` observations ``kept``:
        what the noise critic is distilled toward."""
        obs = expand(kept, list(getattr(self.policy.config, "cameras", [])) or ["front"], self.task)
        with torch.no_grad():
            chunk = self.policy.predict_chunk(obs, None, noise=self.full_noise(w)).actions
        return chunk[:, : self.rows].flatten(1).float()

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step of each loss of the module docstring on ``batch``: obs and next_obs (`compact`
        observations), noise (B, D), action (B, E * A), reward, discount, done (B,)."""
        cfg = self.cfg
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_features = self.features(batch["next_obs"], self.target)
            next_w, next_log_prob = self.sample(self.features(batch["next_obs"]))
            next_value = self.target.q_noise(torch.cat([next_features, next_w], -1)).mean(0) - alpha * next_log_prob
            y = batch["reward"] + batch["discount"] * (~batch["done"]).float() * next_value
        features = self.features(batch["obs"])
        q_action = self.critics.q_action(torch.cat([features, batch["action"]], -1))  # (n, B)
        action_loss = (q_action - y).pow(2).mean(0).sum()
        # The noise critic: the transition's own noise, and fresh ones through the base on the first states.
        d = min(cfg.distill_batch, len(batch["noise"]))
        fresh = torch.randn(d, self.noise_dim, device=features.device).clamp(-cfg.max_noise, cfg.max_noise)
        few = {k: v[:d] for k, v in batch["obs"].items()}
        noises = torch.cat([batch["noise"], fresh])
        actions = torch.cat([batch["action"], self.executed_actions(few, fresh)])
        states = torch.cat([features, features[:d]])
        with torch.no_grad():
            target_w = self.critics.q_action(torch.cat([states, actions], -1)).mean(0)
        noise_loss = (self.critics.q_noise(torch.cat([states, noises], -1)) - target_w).pow(2).mean(0).sum()
        self.critic_optimizer.zero_grad()
        (action_loss + noise_loss).backward()
        self.critic_optimizer.step()
        # The actor and the temperature, on the critics' features, detached.
        w, log_prob = self.sample(features.detach())
        actor_loss = (alpha * log_prob - self.critics.q_noise(torch.cat([features.detach(), w], -1)).mean(0)).mean()
        self.actor_optimizer.zero_grad()
        actor_loss.backward()
        self.actor_optimizer.step()
        alpha_loss = -(self.log_alpha.exp() * (log_prob.detach() + self.target_entropy)).mean()
        self.alpha_optimizer.zero_grad()
        alpha_loss.backward()
        self.alpha_optimizer.step()
        with torch.no_grad():
            for p, p_target in zip(self.critics.parameters(), self.target.parameters(), strict=True):
                p_target.lerp_(p, cfg.tau)
        return {"loss_action_critic": action_loss.item(), "loss_noise_critic": noise_loss.item(),
                "loss_actor": actor_loss.item(), "alpha": alpha.item()}  # fmt: skip

    def state_dict(self) -> dict:
        """Everything a resumed run restores: the networks, the temperature and the optimizers."""
        return {"critics": self.critics.state_dict(), "target": self.target.state_dict(),
                "actor": self.actor_net.state_dict(), "log_alpha": self.log_alpha.detach().clone(),
                "critic_optimizer": self.critic_optimizer.state_dict(),
                "actor_optimizer": self.actor_optimizer.state_dict(),
                "alpha_optimizer": self.alpha_optimizer.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.critics.load_state_dict(state["critics"])
        self.target.load_state_dict(state["target"])
        self.actor_net.load_state_dict(state["actor"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])


def transitions(rollout, rows: int) -> dict:
    """The rollout's decisions as transitions: obs and next_obs (`compact` observations: the same world's next
    decision's in the episode; its own where the episode ended, unused then), noise (M, D), action (M, rows * A)
    the rows that ran (left-aligned, 0 past the last that ran), reward, discount, done (M,). Rows are in
    world-then-time order; the decisions of episodes whose world blew up are left out, as PPO leaves them. So is
    the last decision of an episode the time limit cut (``rollout.truncated``): a value follows it, but of a state
    the rollout does not record, and taking it as terminal would teach the critics that running out of time is a
    state the encoder can see."""
    m = len(rollout)
    following = torch.arange(m) + 1
    same = torch.zeros(m, dtype=torch.bool)
    same[:-1] = (rollout.world[1:] == rollout.world[:-1]) & (rollout.episode[1:] == rollout.episode[:-1])
    following = torch.where(same & ~rollout.done, following, torch.arange(m)).clamp(max=m - 1)
    chunk, executed = rollout.decision.chunk, rollout.executed
    # The rows that ran, left-aligned: the k-th executed row of each chunk in slot k.
    order = torch.argsort((~executed).to(torch.int8), dim=1, stable=True)[:, :rows]
    ran = torch.gather(chunk, 1, order[..., None].expand(-1, -1, chunk.shape[-1]))
    ran = ran * torch.gather(executed, 1, order)[..., None]
    keep = ~rollout.diverged & ~rollout.truncated
    obs = compact(rollout.obs)
    return {"obs": {k: v[keep] for k, v in obs.items()}, "next_obs": {k: v[following][keep] for k, v in obs.items()},
            "noise": rollout.decision.noise[keep], "action": ran.flatten(1)[keep].float(),
            "reward": rollout.reward[keep].float(), "discount": rollout.discount[keep].float(),
            "done": rollout.done[keep]}  # fmt: skip
