"""RL²'s latent steering of a frozen flow policy: the steering field, the failure predictor, the gate and the
learner, the math in view. `vla-rl steer` (`vla_rl.steer`) collects the data and runs the learner;
`vla-rl eval --steer.dir=DIR` serves the steered policy.

At inference the field adds to the frozen policy's flow velocity at every Euler step,

    v(x_t, t) = v_base(x_t, t) + w * g * v_steer(x_t, t, z_t),

z_t the action expert's pooled hidden state (`FlowSteerable.latents`), w the steering weight and g the
gate: 1 where the failure predictor's probability, read once per chunk from the latents at t = 1 (the
noise, before any step), is above the threshold chosen on held-out rollouts (``gated``); 1 everywhere
(``always``).

The learner is Q-weighted flow matching, offline, on the frozen policy's own rollouts. For a request with
initial noise e whose sampler ended at x_0 (its chunk, in the policy's normalized units) and a time
t ~ U(0, 1), at x_t = t e + (1 - t) x_0 the composed velocity should be the straight path's, e - x_0, so
the field regresses the residual

    r = (e - x_0) - v_base(x_t, t),     loss = sum_i a_i |v_steer(x_t, t, z_t) - r_i|^2 / sum_i a_i,

each sample weighted by a_i = min(exp((Q_i - V_i) / beta), 20): Q_i the Monte-Carlo return of its chunk
(its episode's success, 1 or 0, undiscounted: the reward is sparse and terminal) and V_i = 1 - p_fail(z_1)
the predictor's success probability for the same request, the baseline. Successful chunks from states that
usually fail weigh most. Why this and not IQL: the data is one frozen policy's, a few hundred episodes; its
Monte-Carlo return is an unbiased Q for that policy, so IQL's expectile value and Q networks would add two
networks and their bias for nothing, and a residual velocity is the action space the base policy already
samples in (a flow policy cannot take a Gaussian IQL actor's action).

The failure predictor is a logistic MLP on z_1 trained with binary cross-entropy on the training
episodes' requests; the threshold maximizes Youden's J (true-positive rate of failures minus
false-positive rate) on the held-out episodes' requests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vla_core.types import Steer

MAX_WEIGHT = 20.0  # the largest advantage weight: a few rare successes must not be the whole loss
SteerMode = str  # "gated" (where the predictor expects failure) or "always"
STEER_MODES = ("gated", "always")


class SteeringField(nn.Module):
    """v_steer(x_t (B, *noise_shape), t (B,), latents (B, latent_dim)) -> (B, *noise_shape): an MLP on the
    flattened state, the time and the latents."""

    def __init__(self, noise_shape: tuple[int, ...], latent_dim: int, hidden: int = 256):
        super().__init__()
        self.noise_shape, self.latent_dim = tuple(noise_shape), latent_dim
        size = math.prod(self.noise_shape)
        self.net = nn.Sequential(nn.Linear(size + 1 + latent_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                 nn.GELU(), nn.Linear(hidden, size))  # fmt: skip
        nn.init.zeros_(self.net[-1].weight)  # untrained, it steers nowhere
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([x_t.flatten(1), t[:, None].to(x_t.dtype), latents.to(x_t.dtype)], dim=1)
        return self.net(flat).view(len(x_t), *self.noise_shape)


class FailurePredictor(nn.Module):
    """logit of P(the request's episode fails) from the latents at t = 1, (B, latent_dim) -> (B,)."""

    def __init__(self, latent_dim: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(latent_dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.net(latents).squeeze(-1)


class Steering(nn.Module):
    """The field, the predictor and the threshold, saved together (config.json + model.safetensors)."""

    def __init__(self, noise_shape: tuple[int, ...], latent_dim: int, hidden: int = 256, threshold: float = 0.5,
                 metrics: dict[str, Any] | None = None, base_sha256: str = ""):  # fmt: skip
        super().__init__()
        self.field = SteeringField(noise_shape, latent_dim, hidden)
        self.predictor = FailurePredictor(latent_dim)
        self.threshold, self.hidden, self.metrics = float(threshold), hidden, dict(metrics or {})
        self.base_sha256 = base_sha256  # the weights of the base policy it was trained on ("" = not recorded)

    def steer(self, mode: SteerMode = "gated", weight: float = 1.0) -> Steer:
        """A `vla_core.types.Steer` for one chunk: the gate is read at its first Euler step (t = 1) and kept."""
        if mode not in STEER_MODES:
            raise ValueError(f"steer mode must be one of {STEER_MODES}, got {mode!r}")
        gate: dict[str, torch.Tensor] = {}

        def steer(x_t: torch.Tensor, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            if "g" not in gate:  # the first step: the latents of the noise itself
                fail = torch.sigmoid(self.predictor(latents.float()))
                on = fail > self.threshold if mode == "gated" else torch.ones_like(fail, dtype=torch.bool)
                gate["g"] = on.to(x_t.dtype).view(-1, *[1] * (x_t.ndim - 1))
            if not gate["g"].any():  # no row steered (the common case in distribution): the field costs nothing
                return torch.zeros_like(x_t)
            return weight * gate["g"] * self.field(x_t.float(), t, latents.float()).to(x_t.dtype)

        return steer

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> None:
        """config.json and model.safetensors in ``directory``, each written atomically."""
        directory.mkdir(parents=True, exist_ok=True)
        config = {"noise_shape": list(self.field.noise_shape), "latent_dim": self.field.latent_dim,
                  "hidden": self.hidden, "threshold": self.threshold, "base_sha256": self.base_sha256,
                  "metrics": self.metrics, **(extra or {})}  # fmt: skip
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
        steering = cls(tuple(config["noise_shape"]), config["latent_dim"], config["hidden"], config["threshold"],
                       config.get("metrics"), config.get("base_sha256", ""))  # fmt: skip
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


class SteeredPolicy(WrappedPolicy):
    """The frozen ``base`` policy whose every ``predict_chunk`` is steered (see the module docstring)."""

    def __init__(self, base: nn.Module, steering: Steering, mode: SteerMode = "gated", weight: float = 1.0):
        super().__init__()
        if tuple(base.noise_shape) != steering.field.noise_shape or base.latent_dim != steering.field.latent_dim:
            raise ValueError(
                f"the steering was trained for noise {steering.field.noise_shape} and latents of "
                f"{steering.field.latent_dim}, the policy has {tuple(base.noise_shape)} and {base.latent_dim}: "
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
        self.base, self.steering, self.mode, self.weight = base, steering, mode, float(weight)
        steering.steer(mode)  # the mode checked now, not at the first chunk

    def predict_chunk(self, obs, obs_step=None, **kwargs):
        return self.base.predict_chunk(obs, obs_step, steer=self.steering.steer(self.mode, self.weight), **kwargs)


# -- the learner ---------------------------------------------------------------------------------


def advantage_weights(success: torch.Tensor, fail_logit: torch.Tensor, beta: float) -> torch.Tensor:
    """(N,) a_i = min(exp((Q_i - V_i) / beta), MAX_WEIGHT): Q the episode's success (N,) in {0, 1}, V = 1 -
    sigmoid(fail_logit) (N,) the predictor's success probability."""
    value = 1.0 - torch.sigmoid(fail_logit)
    return torch.exp((success.float() - value) / beta).clamp(max=MAX_WEIGHT)


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


def train_field(field: SteeringField, data: dict[str, torch.Tensor], weights: torch.Tensor, steps: int, lr: float,
                batch_size: int, generator: torch.Generator) -> list[float]:  # fmt: skip
    """The weighted residual regression of the module docstring on ``data`` (x_t (N, *S), t (N,), latents (N, L),
    residual (N, *S)) with ``weights`` (N,); returns the weighted loss per step."""
    optimizer = torch.optim.Adam(field.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        batch = torch.randint(len(weights), (batch_size,), generator=generator)  # with replacement
        predicted = field(data["x_t"][batch], data["t"][batch], data["latents"][batch])
        error = (predicted - data["residual"][batch]).pow(2).flatten(1).sum(1)  # (B,)
        loss = (weights[batch] * error).sum() / weights[batch].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
