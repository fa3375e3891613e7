"""The few shared contracts every part of vla-rl meets at.

Observation batches are plain dicts of tensors with a leading batch dimension and use
LeRobot's feature names, so LeRobot policies and datasets plug in unchanged:

- ``observation.images.<camera>``: float32 in [0, 1], shape (B, C, H, W)
- ``observation.state``: float32, shape (B, S)
- ``task``: list of B instruction strings

Delay augmentation (built by :class:`vla_core.runtime.ActionChunkExecutor`) adds:

- ``observation.committed_actions``: (B, D_max, A) actions that execute before a new chunk can start
- ``observation.committed_mask``: (B, D_max) bool, True where the row above is a real action
- ``observation.delay_steps``: (B,) long, the inference delay in control steps
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

# Where a latent steering (RL²) acts: gated = in the chunks its failure predictor expects to fail; always = every chunk.
SteerMode = Literal["gated", "always"]

OBS_STATE = "observation.state"
# A simulation's true state (LeRobot's name), recorded as labels (`vla-rl record --environment_state=true`)
ENVIRONMENT_STATE = "observation.environment_state"
OBS_IMAGES = "observation.images"
OBS_COMMITTED_ACTIONS = "observation.committed_actions"
OBS_COMMITTED_MASK = "observation.committed_mask"
OBS_DELAY_STEPS = "observation.delay_steps"
# The mid-inference observation (latency-aware policies): the world m steps into the inference window.
OBS_MID = "observation.mid"
OBS_MID_STATE = f"{OBS_MID}.state"
OBS_MID_STEPS = f"{OBS_MID}.steps"  # (B,) long, m: steps from the request to the mid observation
# The simulator's privileged state at a decision (B, P) float, recorded by RL rollouts for an asymmetric critic
# (`vla_rl.rl.ppo`): no policy reads it, and a robot never has it.
OBS_PRIVILEGED = "observation.privileged"
TASK = "task"
ACTION = "action"
# True in a training batch with the delay augmentation whose frames are also trained at zero delay
# (training-time RTC: the denoising policies add a pass with nothing committed and every row in the loss).
ZERO_DELAY_PASS = "zero_delay_pass"

Observation = dict[str, Any]
"""A batch of observations: tensors with a leading batch dim, plus ``task`` (list[str])."""


def image_key(camera: str) -> str:
    """LeRobot feature name of a camera, e.g. ``observation.images.front``."""
    return f"{OBS_IMAGES}.{camera}"


def mid_image_key(camera: str) -> str:
    """A camera's image in the mid-inference observation, e.g. ``observation.mid.images.front``."""
    return f"{OBS_MID}.images.{camera}"


@dataclass
class ActionChunk:
    """H future actions per batch element.

    actions: (B, H, A) float; ``actions[b, j]`` is meant for control step ``obs_step[b] + j``.
    obs_step: (B,) long; the control step whose observation the chunk was conditioned on.
    """

    actions: torch.Tensor
    obs_step: torch.Tensor

    def __post_init__(self) -> None:
        if self.actions.ndim != 3:
            raise ValueError(f"ActionChunk.actions must be (B, H, A), got shape {tuple(self.actions.shape)}")
        if self.obs_step.shape != self.actions.shape[:1]:
            raise ValueError(
                f"ActionChunk.obs_step must be (B,)={tuple(self.actions.shape[:1])}, got {tuple(self.obs_step.shape)}"
            )

    @property
    def horizon(self) -> int:
        return self.actions.shape[1]


class PolicyConfigView(Protocol):
    """The config fields every caller of a policy may read (``policies.pretrained.PolicyConfig``)."""

    type: str  # the registered policy type, e.g. "diffusion"
    horizon: int  # H, actions per chunk
    n_action_steps: int  # default steps executed per chunk
    image_size: int
    state_dim: int
    action_dim: int
    cameras: list[str]
    max_delay_steps: int  # the largest delay it trained with the delay augmentation for; 0 = it ignores it


@runtime_checkable
class Policy(Protocol):
    """A policy maps an observation batch to a chunk of future actions.

    ``policies.pretrained.PreTrainedPolicy`` implements it (construction from a dataset's features
    and statistics, ``save_pretrained`` / ``from_pretrained`` in LeRobot's format); test doubles and
    the bridge's benchmark policy implement only what they need. This is what evaluation and serving
    need; RL fine-tuning needs an actor (`vla_core.rl.RLPolicy`), and a latency-aware policy splits its
    work around the mid-inference observation (`LatencyAwarePolicy`).
    """

    config: PolicyConfigView
    supports_inpainting: bool  # predict_chunk accepts ``inpaint`` (real-time chunking guidance)

    @property
    def device(self) -> torch.device: ...

    def predict_chunk(
        self,
        obs: Observation,
        obs_step: torch.Tensor | None = None,
        *,
        noise: torch.Tensor | None = None,
        inpaint: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ActionChunk:
        """obs: batch of size B; obs_step: (B,) step index (zeros when None); noise: (B, H, A) sampler
        start (drawn when None); inpaint: (target (B, H, A), weights (B, H)) guidance."""
        ...

    def forward(self, batch: Observation, generator: torch.Generator | None = None, copies: int = 1) -> torch.Tensor:
        """The imitation loss of a batch (observation keys + ``action`` (B, H, A) + ``action_is_pad`` (B, H))."""
        ...


@runtime_checkable
class LatencyAwarePolicy(Protocol):
    """What a latency-aware policy (config ``latency_aware``) adds to `Policy`: its work splits around the
    mid-inference observation (`vla_core.runtime.protocol`). On a robot the slow part runs on the
    request's observation at once and the fast part once the mid observation is in.

    ``prepare_request(obs)`` runs the slow part on a batch of requests' observations and returns what
    ``predict_chunk(obs, obs_step, prepared=...)`` then needs; ``obs`` there is the same batch with
    ``observation.mid.*`` added. Without ``prepared`` it runs both parts.
    """

    def prepare_request(self, obs: Observation) -> Any: ...

    def predict_chunk(self, obs: Observation, obs_step: torch.Tensor | None = None, *, noise: torch.Tensor | None = None,
                      inpaint: tuple[torch.Tensor, torch.Tensor] | None = None, prepared: Any = None) -> ActionChunk: ...  # fmt: skip


Steer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``steer(x_t, t, latents) -> extra velocity``: x_t (B, *noise_shape) the sampler's state, t (B,) float32
its time (1 = noise, 0 = actions), latents (B, latent_dim) the action expert's pooled hidden state at that
step (`FlowSteerable.latents`); returns (B, *noise_shape), added to the policy's velocity at every Euler
step. A steer with the attribute ``reads_velocity = True`` is called ``steer(x_t, t, latents, velocity)``,
velocity (B, *noise_shape) the policy's own at that step (after any guidance), so it can compose with it
(RL²: w * (v_RL - velocity)). The caller owns any weight or gate (multiply inside ``steer``)."""


@runtime_checkable
class FlowSteerable(Protocol):
    """The steering hooks of a flow policy: what latent steering (RL^2) and noise-space steering (DSRL) act on.

    Units and time are the sampler's: x_t in the policy's normalized action units (vla-rl's policies:
    [-1, 1] is the dataset's range; a LeRobot VLA: its checkpoint's normalization), t in [0, 1] with
    t = 1 the noise and t = 0 the actions, x_t = t * noise + (1 - t) * actions. ``predict_chunk``
    integrates from t = 1 to 0 in n Euler steps of 1/n: x <- x - (v + steer(x, t, latents)) / n at
    t_k = 1 - k / n, then clamps (vla-rl's policies) and unnormalizes.

    - ``noise_shape``: the shape of one sample's initial noise, the whole state the sampler integrates:
      one value per chunk row and per action dimension, (rows, dims). vla-rl's own policies:
      (horizon, action_dim); a LeRobot flow VLA: its padded chunk (chunk_size, max_action_dim), e.g.
      (50, 32) for pi0, whose padded dimensions are inputs of the next velocity like any other. A DSRL
      noise policy acts in this space: its action is the full (rows, dims) noise, and a noise whose rows
      are all equal (one vector repeated along the chunk) is one such noise, taken as it is.
    - ``predict_chunk(obs, obs_step=None, *, noise=None, inpaint=None, steer=None)``: noise
      (B, *noise_shape) the sampler's start (drawn when None); steer: a `Steer`. The observation is
      encoded once per call, not once per Euler step.
    - ``velocity(obs, x_t, t)`` -> (B, *noise_shape): the flow velocity at x_t (B, *noise_shape) and t
      (a float, or (B,)), with the observation's committed actions (delay augmentation) held clean as
      the sampler holds them.
    - ``latents(obs, x_t, t)`` -> (B, ``latent_dim``): the action expert's last hidden state, as the
      layer that writes the velocity reads it, pooled over the chunk by the mean of its tokens (a policy
      whose expert has one hidden vector for the whole chunk returns that vector).

    A policy without a flow velocity (an epsilon-objective or token policy) refuses the hooks and
    ``steer`` with one line naming the fix.
    """

    @property
    def noise_shape(self) -> tuple[int, ...]: ...

    @property
    def latent_dim(self) -> int: ...

    def velocity(self, obs: Observation, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor: ...

    def latents(self, obs: Observation, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor: ...

    def predict_chunk(self, obs: Observation, obs_step: torch.Tensor | None = None, *, noise: torch.Tensor | None = None,
                      inpaint: tuple[torch.Tensor, torch.Tensor] | None = None,
                      steer: Steer | None = None) -> ActionChunk: ...  # fmt: skip


WorldState = Any
"""A snapshot of one world of a `BatchedEnv`: a picklable dict whose ``episode_step`` is the step of
the world's episode (the time limit counts from it) and whose other entries, the simulator's state,
are the backend's own. It can be loaded into any world of the same task in an env built from the
same config (a LIBERO suite runs several tasks; its states carry their ``task_id`` and are checked)."""

Worlds = Any
"""Which worlds an env call touches: indices (k,) (a sequence of ints, a long array or tensor), an
(N,) bool mask, or None for all N."""


def world_indices(worlds: Any, num_envs: int) -> np.ndarray:
    """`Worlds` -> (k,) int64 world indices, in the order given.

    None selects every world; an (N,) bool mask the worlds where it is True; anything else is read
    as indices, each in [0, N) and none repeated (a repeat would make "world w gets state j" ambiguous).
    """
    if worlds is None:
        return np.arange(num_envs)
    if hasattr(worlds, "cpu"):  # a torch tensor, possibly on an accelerator
        worlds = worlds.cpu()
    array = np.asarray(worlds)
    if array.dtype == np.bool_:
        if array.shape != (num_envs,):
            raise ValueError(f"a world mask must have shape ({num_envs},), got {array.shape}")
        return np.flatnonzero(array)
    index = array.astype(np.int64).reshape(-1)
    if array.size and (not np.issubdtype(array.dtype, np.integer) or index.min() < 0 or index.max() >= num_envs):
        raise ValueError(f"world indices must be integers in [0, {num_envs}), got {array.tolist()}")
    if len(np.unique(index)) != len(index):
        raise ValueError(f"world indices must not repeat, got {index.tolist()}")
    return index


@runtime_checkable
class BatchedEnv(Protocol):
    """N worlds stepped as one batch, with autoreset.

    ``step(actions (N, A))`` returns obs, reward (N,) float32, terminated (N,) bool, truncated (N,)
    bool, info, all tensors on ``device``. ``info["success"]`` (N,) bool: the step just taken
    succeeded; ``info["task_id"]`` (N,) long: each world's task, an index into ``task_names``
    (the env's task list, each a task name its config can run alone, e.g. ``libero_spatial/3``).
    After a world terminates or truncates, the returned obs for that world is already the first
    observation of its next episode; the final observation lives in ``info["final_obs"]``.

    ``features``: LeRobot's feature dict of what the env emits and takes, the one a LeRobotDataset
    of it is created with: ``observation.images.<camera>`` {dtype "image", shape (H, W, 3), names
    ["height", "width", "channels"]} per camera, ``observation.state`` {dtype "float32", shape
    (S,), names: S names}, ``action`` {dtype "float32", shape (A,), names: A names}.

    Resets and snapshots (for RL, whose groups of worlds start from one state):

    - ``reset(seed, worlds=w)`` starts new episodes in the worlds ``w`` only and returns the whole
      batch's observations (the other worlds' unchanged). ``seed`` is an int (world i draws what a
      full ``reset(seed)`` would give it), one int per selected world (worlds given equal seeds
      start from equal states) or one ``np.random.SeedSequence`` per world (a MuJoCo backend's world
      stream: `sim.config.batch_world_seed`), or None (each world draws its next episode, as an autoreset does).
    - ``get_state(w)`` -> one `WorldState` per selected world; ``set_state(states, w)`` loads them
      into the worlds ``w`` (world ``w[j]`` gets ``states[j]``) and returns the batch's
      observations. A loaded world observes and, stepped with the same actions, evolves as the
      world it was saved from did (exactly on the deterministic backends; see each backend).
    """

    num_envs: int
    action_dim: int
    device: torch.device
    control_dt: float  # seconds per control step: inference latencies become steps with it
    features: dict[str, dict[str, Any]]
    task_names: list[str]

    def reset(self, seed: int | Sequence[int] | None = None, *, worlds: Worlds = None) -> Observation: ...

    def step(
        self, actions: torch.Tensor
    ) -> tuple[Observation, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]: ...

    def get_state(self, worlds: Worlds = None) -> list[WorldState]: ...

    def set_state(self, states: Sequence[WorldState], worlds: Worlds = None) -> Observation: ...
