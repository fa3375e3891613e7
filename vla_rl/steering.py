"""RL²'s latent steering of a frozen flow policy, as its paper builds it: a small offline-RL flow policy on the
action expert's observation-only latents, its velocity composed with the frozen policy's, switched on by a failure
predictor that judges the state. `vla-rl steer` (`vla_rl.steer`) collects the data and runs the learner;
`vla-rl eval --steer.dir=DIR` and `vla-rl serve` run the steered policy.

Observation-only latents. z = latents(obs, 0, t = 1): the action expert's pooled hidden state (`FlowSteerable.
latents`) at a fixed input, the noise's mean at its time. It depends on the observation alone, so the gate and the
RL policy judge the state, not the draw of noise (the latents along the sampler's path change with every noise).

At inference, in a chunk the gate steers, every Euler step's velocity becomes

    v(x_t, t) = v_base(x_t, t) + w * (v_RL(x_t, t, z) - v_base(x_t, t)),

w the steering weight (1: the RL policy's velocity alone; `vla-rl steer` chooses it on held-out rollouts); the
gate is 1 where the failure predictor's probability from z is above the threshold chosen on held-out episodes
(``gated``), 1 everywhere (``always``). Unsteered chunks are the frozen policy's, bit for bit.

The learner, offline on the frozen policy's own rollouts. A decision is a request: its state z, its action the
sampler's end x_0 (the chunk in the policy's normalized units, before any clamp; shape ``noise_shape``), its reward
1 at the episode's last request when the episode succeeded, else 0 (sparse and terminal: at zero delay the last
request's rows are the ones running when the episode ends), discount ``gamma`` per request.

1. A chunk-level critic, IQL: Q(z, x_0) by TD, target r + gamma (1 - done) V(z'), and V(z) by expectile regression
   (tau) on a slowly updated copy of Q, so V approaches the best return the data shows from z, not its mean. Q
   reads the executed rows of x_0 only.
2. The RL flow policy by advantage-weighted flow matching: for noise e ~ N(0, I) and t ~ U(0, 1), at
   x_t = t e + (1 - t) x_0 it regresses the straight path's velocity e - x_0, each sample weighted by
   a = min(exp((Q(z, x_0) - V(z)) / beta), MAX_WEIGHT); a sharp beta (0.05) keeps the chunks the critic ranks
   above the state's value and drops the rest, which is how it can move beyond the base's dominant mode.
3. The failure predictor: a logistic MLP on z, binary cross-entropy on the training episodes' requests (label:
   the episode failed); the threshold maximizes Youden's J on the held-out episodes' requests.

Best-of-N (the paper's optional selection, since 2026-12-07): in a chunk the gate steers, the sampler runs
``best_of`` times from fresh noises with the composed velocity, and the chunk the critic's Q(z, x_0) ranks first
runs. The critic is saved with the steering for it. `vla-rl steer` chooses w and N together on held-out rollouts.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, get_args

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vla_core.types import TASK, Steer, SteerMode
from vla_rl.rl.networks import mlp

MAX_WEIGHT = 100.0  # the largest advantage weight: one chunk must not be the whole loss
STEER_MODES = get_args(SteerMode)
VERSION = 3  # of the saved steering: 3 = with its critic and best_of; 2 = without (loaded; selects nothing)


def sampler_end(x_t: torch.Tensor, t: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """(B, *S) where the Euler step from x_t at times t (B,) with ``velocity`` (its total, any steer added) lands:
    x_t - velocity * t. At the sampler's last step t is the step size 1/n, so this is the sampler's end x_0."""
    return x_t - velocity * t.view(-1, *[1] * (x_t.ndim - 1))


def batch_size(obs: dict) -> int:
    """The number of samples in an observation batch (its first tensor's leading size)."""
    return next(v for v in obs.values() if torch.is_tensor(v)).shape[0]


@torch.no_grad()
def observation_latents(policy, obs: dict) -> torch.Tensor:
    """(B, latent_dim) z = latents(obs, 0, t = 1): the action expert's latents at a fixed input (see the module
    docstring): one expert pass for vla-rl's policies; a LeRobot VLA's hook encodes its prefix again too."""
    zeros = torch.zeros(batch_size(obs), *policy.noise_shape, device=policy.device)
    return policy.latents(obs, zeros, 1.0).float()


class RLFlowPolicy(nn.Module):
    """v_RL(x_t (B, *noise_shape), t (B,), z (B, latent_dim)) -> (B, *noise_shape): an MLP on the flattened state,
    the time and the observation-only latents."""

    def __init__(self, noise_shape: tuple[int, ...], latent_dim: int, hidden: int = 256):
        super().__init__()
        self.noise_shape, self.latent_dim = tuple(noise_shape), latent_dim
        size = math.prod(self.noise_shape)
        self.net = mlp(size + 1 + latent_dim, hidden, size)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([x_t.flatten(1), t[:, None].to(x_t.dtype), z.to(x_t.dtype)], dim=1)
        return self.net(flat).view(len(x_t), *self.noise_shape)


class ChunkCritic(nn.Module):
    """IQL at the chunk level: ``q(z (B, L), x0 (B, *S)) -> (B,)`` and ``v(z) -> (B,)``, LayerNorm MLPs. Q reads
    the chunk's first ``executed_rows`` rows (the ones that run at zero delay) and their first ``action_dim``
    values only: the rest never reach the robot, so in its input they would be noise."""

    def __init__(self, noise_shape: tuple[int, ...], latent_dim: int, hidden: int = 256, executed_rows: int = 0,
                 action_dim: int = 0):  # fmt: skip
        super().__init__()
        self.executed_rows, self.action_dim = executed_rows or noise_shape[0], action_dim or noise_shape[-1]
        self.q_net = mlp(latent_dim + self.executed_rows * self.action_dim, hidden, 1, layer_norm=True)
        self.v_net = mlp(latent_dim, hidden, 1, layer_norm=True)

    def q(self, z: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        ran = x0[:, : self.executed_rows, : self.action_dim]  # a LeRobot VLA pads its actions to max_action_dim
        return self.q_net(torch.cat([z, ran.flatten(1)], dim=1)).squeeze(-1)

    def v(self, z: torch.Tensor) -> torch.Tensor:
        return self.v_net(z).squeeze(-1)


class FailurePredictor(nn.Module):
    """logit of P(the request's episode fails) from the observation-only latents, (B, latent_dim) -> (B,)."""

    def __init__(self, latent_dim: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(latent_dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.net(latents).squeeze(-1)


class Steering(nn.Module):
    """The RL flow policy, the failure predictor, the threshold, the chosen weight and ``best_of``, and the critic
    that ranks best-of-N candidates (``critic`` None: a version-2 steering, saved without it), saved together
    (config.json + model.safetensors). ``executed``: (the rows of a chunk that run, the action's width), what the
    critic reads."""

    def __init__(self, noise_shape: tuple[int, ...], latent_dim: int, hidden: int = 256, threshold: float = 0.5,
                 weight: float = 1.0, metrics: dict[str, Any] | None = None, base_sha256: str = "",
                 executed: tuple[int, int] | None = (0, 0), best_of: int = 1):  # fmt: skip
        super().__init__()
        self.flow = RLFlowPolicy(noise_shape, latent_dim, hidden)
        self.predictor = FailurePredictor(latent_dim)
        self.critic = None if executed is None else ChunkCritic(noise_shape, latent_dim, hidden, *executed)
        self.threshold, self.weight, self.hidden = float(threshold), float(weight), hidden
        self.best_of = int(best_of)
        self.metrics = dict(metrics or {})
        self.base_sha256 = base_sha256  # the weights of the base policy it was trained on ("" = not recorded)

    def steer(self, z: torch.Tensor, mode: SteerMode = "gated", weight: float | None = None) -> Steer:
        """A `vla_core.types.Steer` for one chunk from its observation-only latents ``z`` (B, L): the gate read from
        z, the composed velocity's extra w * g * (v_RL - v_base) at every step (``weight`` None: the chosen one)."""
        if mode not in STEER_MODES:
            raise ValueError(f"steer mode must be one of {STEER_MODES}, got {mode!r}")
        w = self.weight if weight is None else float(weight)
        on = self.gate(z) if mode == "gated" else None

        def steer(x_t: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
            gate = torch.ones(len(x_t), dtype=torch.bool, device=x_t.device) if on is None else on.to(x_t.device)
            if not gate.any() or w == 0:  # no row steered (the common case in distribution): it costs nothing
                return torch.zeros_like(x_t)
            g = gate.to(x_t.dtype).view(-1, *[1] * (x_t.ndim - 1))
            v_rl = self.flow(x_t.float(), t, z.to(x_t.device).float()).to(x_t.dtype)
            return w * g * (v_rl - velocity)

        steer.reads_velocity = True
        return steer

    def gate(self, z: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the chunks the failure predictor expects to fail, from their observation-only latents (B, L)."""
        return torch.sigmoid(self.predictor(z.float())) > self.threshold

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> None:
        """config.json and model.safetensors in ``directory``, each written atomically."""
        directory.mkdir(parents=True, exist_ok=True)
        config = {"version": VERSION, "noise_shape": list(self.flow.noise_shape), "latent_dim": self.flow.latent_dim,
                  "hidden": self.hidden, "threshold": self.threshold, "weight": self.weight, "best_of": self.best_of,
                  "executed": None if self.critic is None else [self.critic.executed_rows, self.critic.action_dim],
                  "base_sha256": self.base_sha256, "metrics": self.metrics, **(extra or {})}  # fmt: skip
        tmp = directory / "model.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(tmp))
        tmp.replace(directory / "model.safetensors")
        tmp = directory / "config.json.tmp"
        tmp.write_text(json.dumps(config, indent=2))
        tmp.replace(directory / "config.json")

    @classmethod
    def load(cls, directory: str | Path) -> Steering:
        directory = Path(directory)
        if not (directory / "config.json").exists():
            raise ValueError(f"{directory} holds no steering (config.json); write one with `vla-rl steer`")
        config = json.loads((directory / "config.json").read_text())
        if config.get("version") not in (2, VERSION):
            raise ValueError(f"{directory} holds a steering of an earlier vla-rl steer (a residual field on the noise's "
                             "latents), which this version no longer runs: train it again with `vla-rl steer`")  # fmt: skip
        executed = tuple(config["executed"]) if config.get("executed") else None  # version 2: no critic saved
        steering = cls(tuple(config["noise_shape"]), config["latent_dim"], config["hidden"], config["threshold"],
                       config["weight"], config.get("metrics"), config.get("base_sha256", ""), executed,
                       config.get("best_of", 1))  # fmt: skip
        steering.trained_on = config.get("checkpoint", "")
        steering.load_state_dict(load_file(str(directory / "model.safetensors")))
        return steering.eval()


def check_steerable(policy) -> None:
    """ValueError naming the fix unless ``policy`` has the flow hooks steering acts on (`FlowSteerable`)."""
    try:
        policy.noise_shape, policy.latent_dim  # noqa: B018 (a policy without a flow velocity refuses these)
    except ValueError as err:
        raise ValueError(f"steering needs a flow policy: {err}") from None


class WrappedPolicy(nn.Module):
    """A frozen ``base`` policy whose ``predict_chunk`` a subclass changes; everything else (config, latency
    spec, hooks, device) is the base's."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)


class NoiseScaledPolicy(WrappedPolicy):
    """The frozen ``base`` flow policy sampling from ``sigma`` times its initial noise: a given noise e (B, *S)
    becomes sigma e, and with none, sigma times a standard normal draw from torch's stream. What the sigma probe
    runs (`vla-rl eval --noise_scale`): how far outside its training noise the base keeps working bounds a noise
    space an agent (DSRL) may steer in."""

    def __init__(self, base: nn.Module, sigma: float):
        super().__init__()
        try:
            check_steerable(base)  # the noise DSRL steers is a flow policy's
        except ValueError as err:
            raise ValueError(
                f"a noise scale needs a flow policy: {str(err).removeprefix('steering needs a flow policy: ')}"
            ) from None
        if not sigma > 0:
            raise ValueError(f"the noise scale must be > 0, got {sigma}")
        self.base, self.sigma = base, float(sigma)

    def predict_chunk(self, obs, obs_step=None, noise=None, **kwargs):
        if noise is None:
            noise = torch.randn(batch_size(obs), *self.base.noise_shape, device=self.base.device)
        return self.base.predict_chunk(obs, obs_step, noise=self.sigma * noise, **kwargs)


class SteeredPolicy(WrappedPolicy):
    """The frozen ``base`` policy whose every ``predict_chunk`` is steered (see the module docstring); ``weight``
    and ``best_of`` None take the ones `vla-rl steer` chose."""

    def __init__(self, base: nn.Module, steering: Steering, mode: SteerMode = "gated", weight: float | None = None,
                 best_of: int | None = None):  # fmt: skip
        super().__init__()
        if tuple(base.noise_shape) != steering.flow.noise_shape or base.latent_dim != steering.flow.latent_dim:
            raise ValueError(
                f"the steering was trained for noise {steering.flow.noise_shape} and latents of "
                f"{steering.flow.latent_dim}, the policy has {tuple(base.noise_shape)} and {base.latent_dim}: "
                "steer the policy it was collected on"
            )
        if steering.base_sha256:
            from vla_rl.eval_record import weights_sha256

            sha = weights_sha256(base)
            if sha != steering.base_sha256:
                where = getattr(steering, "trained_on", "") or "the policy it was collected on"
                raise ValueError(
                    f"the steering was trained on another base policy (weights sha256 {steering.base_sha256[:12]}..., "
                    f"this one {sha[:12]}...): steer {where}, or collect and train again with `vla-rl steer` on this one"
                )
        self.base, self.steering, self.mode = base, steering, mode
        self.weight = steering.weight if weight is None else float(weight)  # None: the weight `vla-rl steer` chose
        self.best_of = steering.best_of if best_of is None else int(best_of)
        if mode not in STEER_MODES:  # checked now, not at the first chunk
            raise ValueError(f"steer mode must be one of {STEER_MODES}, got {mode!r}")
        if self.best_of < 1:
            raise ValueError(f"best_of={self.best_of}: it must be >= 1 (1: no candidates beside the one chunk)")
        if self.best_of > 1 and steering.critic is None:
            raise ValueError(f"best_of={self.best_of} needs the critic that ranks the candidates, which this steering "
                             "(from before best-of-N) does not hold: train it again with `vla-rl steer`")  # fmt: skip

    def predict_chunk(self, obs, obs_step=None, **kwargs):
        # One more pass of the expert per chunk (a LeRobot VLA's hook also encodes its prefix again: about one more
        # inference per chunk, even where the gate steers nothing).
        if self.best_of > 1 and kwargs.get("prepared") is not None:  # refused on every request, steered or not
            raise ValueError("best-of-N selection samples whole chunks from the request's observation; a latency-aware "
                             "policy's prepared request cannot be repeated per candidate: pass best_of=1")  # fmt: skip
        z = observation_latents(self.base, obs)
        chunk = self.base.predict_chunk(obs, obs_step, steer=self.steering.steer(z, self.mode, self.weight), **kwargs)
        if self.best_of == 1:
            return chunk
        rows = torch.ones(len(z), dtype=torch.bool) if self.mode == "always" else self.steering.gate(z).cpu()
        if not rows.any():
            return chunk
        picked = self.select(obs, obs_step, z, rows.nonzero().flatten(), kwargs.get("noise"), kwargs.get("inpaint"))
        actions = chunk.actions.clone()
        actions[rows.to(actions.device)] = picked
        return type(chunk)(actions, chunk.obs_step)

    @torch.no_grad()
    def select(self, obs: dict, obs_step: torch.Tensor | None, z: torch.Tensor, rows: torch.Tensor,
               noise: torch.Tensor | None = None, inpaint: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> torch.Tensor:  # fmt: skip
        """The actions (R, H, A) of the steered ``rows`` (R,): each row's ``best_of`` chunks sampled with the
        composed velocity (and the request's guidance ``inpaint``, repeated per candidate), the one of highest
        Q(z, x_0) kept (the first of equal ones). Their noise is drawn from torch's stream; with a given ``noise``
        (B, *S) a row's first candidate starts from its own."""
        n, r = self.best_of, len(rows)
        take = rows.to(z.device).repeat_interleave(n)  # each row n times, in a block
        sub = {k: [v[i] for i in take.tolist()] if k == TASK else v[take.to(v.device)]
               for k, v in obs.items() if k == TASK or torch.is_tensor(v)}  # fmt: skip
        step = None if obs_step is None else obs_step[take.to(obs_step.device)]
        starts = torch.randn(r * n, *self.base.noise_shape, device=self.base.device)
        if noise is not None:
            starts[::n] = noise[rows.to(noise.device)].to(starts)
        guidance = None if inpaint is None else tuple(g[take.to(g.device)] for g in inpaint)
        composed = self.steering.steer(z[take], "always", self.weight)
        seen: dict[str, torch.Tensor] = {}

        def candidate(x_t, t, latents, velocity):  # composed, and keeps where this Euler step lands
            extra = composed(x_t, t, latents, velocity)
            seen["x0"] = sampler_end(x_t, t, velocity + extra)  # the last step's is the sampler's end
            return extra

        candidate.reads_velocity = True
        sampled = self.base.predict_chunk(
            sub, step, noise=starts, inpaint=guidance, steer=candidate
        ).actions  # (R n, H, A)
        q = self.steering.critic.q(z[take].float(), seen["x0"].float()).view(r, n)
        best = q.argmax(1)
        return sampled.view(r, n, *sampled.shape[1:])[torch.arange(r, device=sampled.device), best.to(sampled.device)]


def load_steered(base: nn.Module, directory: str | Path, mode: SteerMode = "gated", weight: float | None = None,
                 best_of: int | None = None):  # fmt: skip
    """``base`` steered by the steering in ``directory``, of either kind: a `vla-rl steer` output's ``steering/``
    (RL², gated or always at ``weight`` with ``best_of`` candidates, None: the chosen ones) or a `vla-rl dsrl`
    output's ``dsrl/`` (the agent's noise in every chunk: it has no gate, weight or candidates, so any of them or
    the mode ``always`` is refused). Either refuses a base other than the one it was trained on, in one line."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if config_file.is_file() and "sac" in json.loads(config_file.read_text()):
        if weight or best_of or mode != "gated":
            raise ValueError(f"{directory} is a DSRL agent, which sets every chunk's noise with no gate, weight or "
                             "best-of-N: drop the steering mode, weight and best_of")  # fmt: skip
        from vla_rl.dsrl import load_noise_policy

        return load_noise_policy(directory, base)
    return SteeredPolicy(base, Steering.load(directory).to(base.device), mode, weight, best_of)


# -- the learner ---------------------------------------------------------------------------------


def train_critic(critic: ChunkCritic, data: dict[str, torch.Tensor], steps: int, lr: float, batch_size: int,
                 gamma: float, expectile: float, generator: torch.Generator, polyak: float = 0.005) -> list[float]:  # fmt: skip
    """IQL on the requests ``data``: z (N, L), x0 (N, *S), reward (N,), next_z (N, L), done (N,) bool. V regresses
    the ``expectile`` of a slowly updated (``polyak``) copy of Q; Q regresses r + gamma (1 - done) V(next_z).
    Returns the sum of both losses per step."""
    target = copy.deepcopy(critic).requires_grad_(False)
    optimizer = torch.optim.Adam(critic.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        batch = torch.randint(len(data["reward"]), (batch_size,), generator=generator)  # with replacement
        z, x0, next_z = data["z"][batch], data["x0"][batch], data["next_z"][batch]
        with torch.no_grad():
            q_target = target.q(z, x0)
            backup = data["reward"][batch] + gamma * (~data["done"][batch]).float() * critic.v(next_z)
        diff = q_target - critic.v(z)
        v_loss = (torch.abs(expectile - (diff < 0).float()) * diff.pow(2)).mean()
        q_loss = (critic.q(z, x0) - backup).pow(2).mean()
        optimizer.zero_grad()
        (v_loss + q_loss).backward()
        optimizer.step()
        with torch.no_grad():
            for p, p_target in zip(critic.parameters(), target.parameters(), strict=True):
                p_target.lerp_(p, polyak)
        losses.append((v_loss + q_loss).item())
    return losses


def advantage_weights(advantage: torch.Tensor, beta: float) -> torch.Tensor:
    """(N,) a_i = min(exp(A_i / beta), MAX_WEIGHT) from the critic's advantages (N,)."""
    return torch.exp(advantage / beta).clamp(max=MAX_WEIGHT)


def train_flow_policy(flow: RLFlowPolicy, z: torch.Tensor, x0: torch.Tensor, weights: torch.Tensor, steps: int,
                      lr: float, batch_size: int, generator: torch.Generator) -> list[float]:  # fmt: skip
    """Advantage-weighted flow matching (the module docstring) on the requests z (N, L), x0 (N, *S), weights (N,):
    each step draws fresh noise and times. Returns the weighted loss per step."""
    optimizer = torch.optim.Adam(flow.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        batch = torch.randint(len(weights), (batch_size,), generator=generator)  # with replacement
        target = x0[batch]
        noise = torch.randn(target.shape, generator=generator)
        t = torch.rand(batch_size, generator=generator)
        tt = t.view(-1, *[1] * (target.ndim - 1))
        predicted = flow(tt * noise + (1 - tt) * target, t, z[batch])
        error = (predicted - (noise - target)).pow(2).flatten(1).sum(1)  # (B,)
        loss = (weights[batch] * error).sum() / weights[batch].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_predictor(predictor: FailurePredictor, latents: torch.Tensor, fail: torch.Tensor, steps: int, lr: float,
                    batch_size: int, generator: torch.Generator) -> list[float]:  # fmt: skip
    """Binary cross-entropy on (latents (N, L), fail (N,) in {0, 1}); returns the loss per step."""
    optimizer = torch.optim.Adam(predictor.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        batch = torch.randint(len(latents), (batch_size,), generator=generator)  # with replacement
        loss = nn.functional.binary_cross_entropy_with_logits(predictor(latents[batch]), fail[batch].float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def choose_threshold(fail_prob: torch.Tensor, fail: torch.Tensor) -> dict[str, float]:
    """The threshold on held-out failure probabilities (N,) maximizing Youden's J = TPR - FPR of ``fail`` (N,)
    bool (of equal J the highest: steering a success costs, not steering a failure only fails to help), with
    its rates and the ranking's AUC; 0.5 (J = 0, the rates and AUC None) when the held-out requests are all
    one class."""
    fail = fail.bool()
    positives, negatives = int(fail.sum()), int((~fail).sum())
    if not positives or not negatives:  # None, not NaN: the record is JSON
        return {"threshold": 0.5, "youden_j": 0.0, "tpr": None, "fpr": None, "auc": None}
    best = {"threshold": 0.5, "youden_j": -1.0, "tpr": 0.0, "fpr": 0.0}
    cuts = torch.unique(fail_prob)  # ascending
    for k, cut in enumerate(cuts.tolist()):
        above = fail_prob >= cuts[k]  # steer from this probability on
        tpr, fpr = float((above & fail).sum()) / positives, float((above & ~fail).sum()) / negatives
        if tpr - fpr >= best["youden_j"] - 1e-9:  # ascending cuts: of equal J the highest, which steers the fewest
            # The gate steers above the threshold: halfway down to the next lower probability (or to 0).
            below = float(cuts[k - 1]) if k else 0.0
            best = {"threshold": (cut + below) / 2, "youden_j": tpr - fpr, "tpr": tpr, "fpr": fpr}
    # AUC: the chance a failing request ranks above a succeeding one (ties count half).
    diff = fail_prob[fail][:, None] - fail_prob[~fail][None, :]
    best["auc"] = float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())
    return best
