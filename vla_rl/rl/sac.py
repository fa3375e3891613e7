"""DSRL: soft actor-critic in the noise space of a frozen flow policy, one learner file, the math in view.

The decision is the sampler's initial noise. For an observation o the frozen policy's features
s = latents(o, x = 0, t = 1) (`FlowSteerable.latents`: the action expert's pooled state on a neutral input,
so the agent sees what the policy makes of the observation) are the state; the SAC actor draws a noise
w = k tanh(u), u ~ N(mu(s), sigma(s)) (k = ``max_noise``), and the chunk is the frozen policy's
``predict_chunk(o, noise=w)``. The rollout is the one PPO and GRPO use (`vla_rl.rl.rollout.collect`: one
decision per chunk through the latency model); its transitions (s_i, w_i, R_i, s_{i+1}, done_i), R_i the
chunk's discounted reward and s_{i+1} the world's next decision's state in the same episode, go to a replay
buffer (all but an episode's last decision where the time limit cut it: `transitions`), and each iteration
takes ``updates`` gradient steps of

    critic:  L_Q = sum_j (Q_j(s, w) - y)^2,   y = R + gamma_c (1 - done) (min_j Qbar_j(s', w') - alpha log pi(w'|s')),
    actor:   L_pi = alpha log pi(w|s) - min_j Q_j(s, w),       w ~ pi(.|s) (reparametrized),
    entropy: L_alpha = -alpha (log pi(w|s) + target_entropy),  target_entropy = -dim(w),

with two critics, Polyak-averaged targets Qbar (rate ``tau``). TorchRL provides all of it
(`torchrl.objectives.SACLoss`, `torchrl.data.ReplayBuffer` on a `LazyTensorStorage`,
`torchrl.objectives.SoftUpdate`), so this file only wires the networks and the transitions. Where TorchRL
does not fit: its TD(0) target takes one discount, while a chunk's is gamma^steps of the steps it ran. A
chunk that is not its episode's last runs max(execute_steps, delay) steps, the same for every chunk under a
fixed delay, so gamma_c = gamma^steps of those chunks, measured on the first rollout (with a random delay,
their mean: an approximation the summary records).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from vla_core.types import ActionChunk


@dataclass
class SACConfig:
    gamma: float = 0.99  # per control step
    tau: float = 0.005  # Polyak rate of the target critics
    lr: float = 3e-4  # actor, critics and temperature
    batch_size: int = 256
    updates: int = 64  # gradient steps per iteration (after each rollout)
    buffer_size: int = 100_000  # transitions kept
    max_noise: float = 2.0  # k: the noise is k tanh(u), within [-k, k] per dimension
    hidden: int = 256
    alpha_init: float = 0.1  # initial entropy temperature


@dataclass
class NoiseDecision:
    """B initial-noise decisions: ``noise`` (B, D) flattened, in [-k, k]; ``features`` (B, F) the state."""

    noise: torch.Tensor
    features: torch.Tensor

    def __len__(self) -> int:
        return len(self.noise)

    def select(self, rows: torch.Tensor) -> NoiseDecision:
        return NoiseDecision(self.noise[rows], self.features[rows])

    def to(self, device) -> NoiseDecision:
        return NoiseDecision(self.noise.to(device), self.features.to(device))

    @staticmethod
    def cat(decisions) -> NoiseDecision:
        return NoiseDecision(torch.cat([d.noise for d in decisions]), torch.cat([d.features for d in decisions]))


def features_of(policy, obs: dict) -> torch.Tensor:
    """(B, latent_dim) the state: the frozen policy's latents on a neutral input, x = 0 at t = 1."""
    batch = len(next(v for v in obs.values() if torch.is_tensor(v)))
    zeros = torch.zeros(batch, *policy.noise_shape, device=policy.device)
    return policy.latents(obs, zeros, 1.0).float()


class _Critic(nn.Module):
    def __init__(self, features: int, noise: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features + noise, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))  # fmt: skip

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([observation, action], -1))


class NoiseAgent:
    """The SAC agent over a frozen ``policy``'s noise (an `vla_core.rl.RLPolicy` for the shared rollout):
    ``act`` samples noises and the chunks they give; ``deterministic_noise`` is the actor's mean, k tanh(mu)."""

    def __init__(self, policy, cfg: SACConfig):
        from tensordict.nn import NormalParamExtractor, TensorDictModule
        from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
        from torchrl.objectives import SACLoss, SoftUpdate

        self.policy, self.cfg = policy, cfg
        self.noise_dim, features = math.prod(policy.noise_shape), policy.latent_dim
        self.actor_net = nn.Sequential(nn.Linear(features, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.hidden),
                                       nn.ReLU(), nn.Linear(cfg.hidden, 2 * self.noise_dim), NormalParamExtractor())  # fmt: skip
        self.actor = ProbabilisticActor(
            TensorDictModule(self.actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
            in_keys=["loc", "scale"], distribution_class=TanhNormal,
            distribution_kwargs={"low": -cfg.max_noise, "high": cfg.max_noise}, return_log_prob=True,
        )  # fmt: skip
        critic = ValueOperator(_Critic(features, self.noise_dim, cfg.hidden), in_keys=["observation", "action"])
        self.loss = SACLoss(actor_network=self.actor, qvalue_network=critic, num_qvalue_nets=2, delay_qvalue=True,
                            target_entropy=-float(self.noise_dim), alpha_init=cfg.alpha_init)  # fmt: skip
        self.target_update = SoftUpdate(self.loss, tau=cfg.tau)
        self.optimizer = torch.optim.Adam(self.loss.parameters(), lr=cfg.lr)
        self.module = self.loss  # what a checkpoint of the agent saves
        self.num_factors, self.value_dim = 1, features
        self.gamma_chunk: float | None = None  # set from the first rollout (module docstring)

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @torch.no_grad()
    def act(self, obs: dict, obs_step: torch.Tensor) -> tuple[ActionChunk, NoiseDecision]:
        features = features_of(self.policy, obs)
        noise = self.sample(features)
        chunk = self.policy.predict_chunk(obs, obs_step, noise=noise.view(len(noise), *self.policy.noise_shape))
        return chunk, NoiseDecision(noise.cpu(), features.cpu())

    def sample(self, features: torch.Tensor) -> torch.Tensor:
        """(B, D) noises drawn from the actor for states (B, F), with exploration: TorchRL's actors return
        their deterministic action unless told to sample."""
        from tensordict import TensorDict
        from tensordict.nn import InteractionType, set_interaction_type

        with set_interaction_type(InteractionType.RANDOM):
            return self.actor(TensorDict({"observation": features}, batch_size=[len(features)]))["action"]

    @torch.no_grad()
    def deterministic_noise(self, obs: dict) -> torch.Tensor:
        """(B, *noise_shape) the actor's deterministic noise for ``obs``."""
        from tensordict import TensorDict
        from tensordict.nn import InteractionType, set_interaction_type

        features = features_of(self.policy, obs)
        with set_interaction_type(InteractionType.DETERMINISTIC):
            noise = self.actor(TensorDict({"observation": features}, batch_size=[len(features)]))["action"]
        return noise.view(len(noise), *self.policy.noise_shape)

    def score(self, obs, decision, executed=None):
        raise NotImplementedError("SAC learns from its critics, not from scored log-probabilities")

    def value_features(self, obs: dict) -> torch.Tensor:
        return features_of(self.policy, obs)

    def update(self, replay) -> dict[str, float]:
        """``cfg.updates`` gradient steps on batches from ``replay``: the three losses of the module docstring."""
        totals: dict[str, float] = {}
        for _ in range(self.cfg.updates):
            losses = self.loss(replay.sample().to(self.device))
            total = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
            self.optimizer.zero_grad()
            total.backward()
            self.optimizer.step()
            self.target_update.step()
            for key in ("loss_actor", "loss_qvalue", "loss_alpha", "alpha"):
                totals[key] = totals.get(key, 0.0) + float(losses[key].detach()) / self.cfg.updates
        return totals


def chunk_discount(rollout, gamma: float) -> float:
    """gamma_c of the module docstring: the mean discount gamma^steps of the chunks that did not end their episode
    (all equal under a fixed delay); gamma^1 if every chunk ended one."""
    going = rollout.discount[~rollout.done]
    return float(going.mean()) if len(going) else gamma


def transitions(rollout):
    """The rollout's decisions as TorchRL transitions (a TensorDict): observation (M, F), action (M, D), next:
    observation (the same world's next decision's features in the episode; its own where the episode ended,
    unused then), reward (M, 1), done and terminated (M, 1). Rows are in world-then-time order; the decisions
    of episodes whose world blew up are left out, as PPO leaves them. So is the last decision of an episode the
    time limit cut (``rollout.truncated``): a value follows it, but of a state the rollout does not record, and
    taking it as terminal would teach the critics that a state the features cannot tell from others is worth
    only its last chunk's reward."""
    from tensordict import TensorDict

    decision = rollout.decision
    m = len(rollout)
    following = torch.arange(m) + 1
    same = torch.zeros(m, dtype=torch.bool)
    same[:-1] = (rollout.world[1:] == rollout.world[:-1]) & (rollout.episode[1:] == rollout.episode[:-1])
    following = torch.where(same & ~rollout.done, following, torch.arange(m)).clamp(max=m - 1)
    done = rollout.done[:, None]
    nxt = TensorDict({"observation": decision.features[following], "reward": rollout.reward[:, None].float(),
                      "done": done, "terminated": done}, batch_size=[m])  # fmt: skip
    whole = TensorDict({"observation": decision.features, "action": decision.noise, "next": nxt}, batch_size=[m])
    return whole[~rollout.diverged & ~rollout.truncated]
