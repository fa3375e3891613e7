"""Turn action chunks into per-step actions for B environments.

``ActionChunkExecutor`` owns the queue of committed actions and the merge rule. The sim delay
wrapper and the robot bridge both drive this one object, so training and deployment agree on
what executes when.

The queue is a window over the next ``horizon`` control steps, relative to each env's current
``step``: slot k holds what is known about absolute step ``step + k``. Every merge mode writes
into the same three running buffers, and the emitted action for a slot is ``sum / weight``:

- ``_sum``    (B, horizon, A): weighted sum of the predictions received for the slot
- ``_weight`` (B, horizon):    sum of their weights
- ``_count``  (B, horizon):    how many predictions were received (0 means nothing queued)
- ``_source`` (B, horizon):    the ``obs_step`` of the newest chunk written to the slot (-1: none), so RL can
  credit each step to the decision whose row runs (`vla_core.runtime.transition`)
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from vla_core.runtime.delay import augmentation
from vla_core.types import ActionChunk

MergeMode = Literal["latest", "ensemble", "rtc"]


def rtc_weights(horizon: int, delay_steps: torch.Tensor, execute_steps: torch.Tensor) -> torch.Tensor:
    """Real-time chunking soft mask (Black et al.): how much chunk index i keeps of the previous plan.

    delay_steps d (B,) and execute_steps s (B,) long -> W (B, horizon) float, with H = horizon:

    - ``W_i = 1`` for i < d: the committed prefix, frozen;
    - ``W_i = c_i (exp(c_i) - 1) / (e - 1)`` with ``c_i = (H - s - i) / (H - s - d + 1)`` for
      d <= i < H - s: the overlap with the previous chunk, decaying toward the new one;
    - ``W_i = 0`` for i >= H - s: the previous chunk has no action there.
    """
    i = torch.arange(horizon, device=delay_steps.device)[None, :]  # (1, H)
    d = delay_steps.long()[:, None]  # (B, 1)
    end = horizon - execute_steps.long()[:, None]  # (B, 1), first index past the previous chunk
    # The clamp only guards an empty overlap (end <= d), where no index uses c.
    c = (end - i).float() / (end - d + 1).clamp(min=1).float()
    soft = c * torch.expm1(c) / (math.e - 1)
    return torch.where(i < d, 1.0, torch.where(i < end, soft, 0.0))


def rtc_blend_weights(horizon: int, delay_steps: torch.Tensor, overlap_end: torch.Tensor) -> torch.Tensor:
    """How much of the previous plan the executor keeps when it blends a new chunk in (``"rtc"`` merge).

    delay_steps d (B,) and overlap_end (B,), the first chunk index past the previous plan (H - s),
    -> W (B, horizon): 1 for i < d (frozen), ``(1 + cos(pi (i - d + 1) / (end - d + 1))) / 2``
    for d <= i < end, 0 after. The cosine eases out of the frozen prefix with zero slope: a blend
    ``W old + (1 - W) new`` moves the command's velocity by ``W' (old - new)``, and RTC's
    exponential mask (:func:`rtc_weights`, right for guidance) is steepest exactly at the seam.
    """
    i = torch.arange(horizon, device=delay_steps.device)[None, :]  # (1, H)
    d = delay_steps.long()[:, None]  # (B, 1)
    end = overlap_end.long()[:, None]  # (B, 1)
    ease = 0.5 * (1 + torch.cos(math.pi * (i - d + 1).float() / (end - d + 1).clamp(min=1).float()))
    return torch.where(i < d, 1.0, torch.where(i < end, ease, 0.0))


class ActionChunkExecutor:
    """Queue of future actions per env, fed by chunks and drained one control step at a time.

    Merge modes:

    - ``"latest"``: the newest chunk defines the future. Its actions replace everything queued,
      and queued actions past its last step are discarded.
    - ``"ensemble"`` (ACT temporal ensembling): the action for a step is
      ``sum_i w_i a_i / sum_i w_i`` over all predictions for that step, with
      ``w_i = exp(-ensemble_coeff * i)`` and i = 0 the oldest prediction. A positive coefficient
      makes older predictions weigh more, as in ACT.
    - ``"rtc"`` (real-time chunking): the newest chunk defines the future as in ``"latest"``, but
      where a previous action is queued the two are blended, ``W_i old + (1 - W_i) new`` with the
      decaying weights of :func:`rtc_blend_weights`. The frozen prefix d is the lag of the chunk
      (steps emitted since its observation; those actions are dropped) plus ``lead_steps``, and the
      previous plan reaches chunk index ``lag + queue_end = H - s``. Flow
      policies also inpaint toward the queued actions themselves, guided by :meth:`rtc_guidance`
      (RTC's own soft mask, :func:`rtc_weights`).

    ``lead_steps`` L: a chunk takes over L steps after it arrives; the L steps from its arrival on keep
    what was queued (they are committed: a robot's trajectory controller already holds them, and the
    chunk needs that long to reach it). Every merge mode starts at slot L; for ``"rtc"`` the frozen
    prefix is then lag + L. 0 (simulation's default): a chunk takes over at once.

    Attributes:
        step: (B,) long, the control step whose action ``next_action()`` emits next, per env.
        emitted_source: (B,) long, the ``obs_step`` of the chunk whose row the last ``next_action()`` emitted; a
            step that held (nothing queued) keeps the chunk it holds the last action of; -1 since a reset
            until a chunk's row runs. Under ``latest`` this is the decision the step's action belongs to.
        emitted_row: (B,) long, that chunk's row (step - obs_step) the last ``next_action()`` emitted; -1 where
            it held.
    """

    def __init__(
        self,
        num_envs: int,
        action_dim: int,
        horizon: int,
        merge: MergeMode = "latest",
        ensemble_coeff: float = 0.01,
        max_delay: int = 0,
        lead_steps: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if merge not in get_args(MergeMode):
            raise ValueError(f"merge must be one of {get_args(MergeMode)}, got {merge!r}")
        if num_envs < 1 or action_dim < 1 or horizon < 1:
            raise ValueError(f"num_envs, action_dim and horizon must be >= 1, got {num_envs}, {action_dim}, {horizon}")
        if max_delay < 0:
            raise ValueError(f"max_delay must be >= 0, got {max_delay}")
        if not 0 <= lead_steps < horizon:
            raise ValueError(f"lead_steps must be in [0, horizon={horizon}), got {lead_steps}")
        if not math.isfinite(ensemble_coeff):
            raise ValueError(f"ensemble_coeff must be finite, got {ensemble_coeff}")
        self.num_envs = num_envs
        self.action_dim = action_dim
        self.horizon = horizon
        self.merge = merge
        self.ensemble_coeff = ensemble_coeff
        self.max_delay = max_delay
        self.lead_steps = lead_steps
        self.device = torch.device(device)

        B, H, A = num_envs, horizon, action_dim
        self.step = torch.zeros(B, dtype=torch.long, device=self.device)
        self._sum = torch.zeros(B, H, A, device=self.device)
        self._weight = torch.zeros(B, H, device=self.device)
        self._count = torch.zeros(B, H, dtype=torch.long, device=self.device)
        self._source = torch.full((B, H), -1, dtype=torch.long, device=self.device)
        self.emitted_source = torch.full((B,), -1, dtype=torch.long, device=self.device)
        self.emitted_row = torch.full((B,), -1, dtype=torch.long, device=self.device)
        self._last_action = torch.zeros(B, A, device=self.device)  # (B, A), held when the queue runs dry

    def queue_length(self) -> torch.Tensor:
        """(B,) long: number of consecutive queued steps starting at ``step``."""
        return (self._count > 0).long().cumprod(dim=1).sum(dim=1)

    def queue_end(self) -> torch.Tensor:
        """(B,) long: one past the last queued slot (0: nothing queued). It is ``queue_length()`` unless a lead
        left slots empty before a chunk's first action (the first chunk after a start or a hold)."""
        slots = torch.arange(1, self.horizon + 1, device=self.device)
        return ((self._count > 0) * slots).amax(dim=1)

    def add_chunk(self, chunk: ActionChunk, env_mask: torch.Tensor | None = None, validate: bool = True) -> None:
        """Merge a chunk into the queue of the envs selected by ``env_mask`` (B,) bool (all when None).

        ``chunk.actions`` (B, H, A) with H <= horizon; ``chunk.actions[b, j]`` is for absolute step
        ``chunk.obs_step[b] + j``. Actions for steps already emitted (a chunk that arrives late
        because inference took time) are dropped. ``validate=False`` skips the value checks (finite
        actions, obs_step not ahead), which read the device, for a caller that checked the chunk when
        it was made (the simulation's delay shell, every control step).
        """
        mask = self._env_mask(env_mask)
        actions = chunk.actions.to(device=self.device, dtype=torch.float32)
        obs_step = chunk.obs_step.to(device=self.device, dtype=torch.long)
        B, H, A = actions.shape
        if B != self.num_envs or A != self.action_dim:
            raise ValueError(
                f"chunk actions must be (num_envs={self.num_envs}, H, action_dim={self.action_dim}), "
                f"got {tuple(actions.shape)}"
            )
        if not 1 <= H <= self.horizon:
            raise ValueError(f"chunk horizon H must be in [1, {self.horizon}], got {H}")
        if validate and not torch.isfinite(actions).all():
            raise ValueError("chunk actions contain NaN or inf")
        # (B,) steps already emitted since the chunk's observation; rows outside the mask are not
        # merged, and their obs_step may be anything (stale, or from an old episode).
        lag = torch.where(mask, self.step - obs_step, 0)
        if validate and (lag < 0).any():
            # A chunk conditioned on a step not yet reached means the caller mixed up step counters
            # (e.g. a chunk from before a reset); its actions would land outside the window.
            raise ValueError(f"chunk obs_step {obs_step.tolist()} is ahead of executor step {self.step.tolist()}")

        # Slot k is absolute step step + k, i.e. chunk index k + lag; the first lead_steps slots stay as queued.
        slots = torch.arange(self.horizon, device=self.device)
        index = slots + lag[:, None]  # (B, horizon)
        takes = mask[:, None] & (slots >= self.lead_steps)  # (B, horizon): the slots this chunk writes
        covered = (index < H) & takes  # (B, horizon)
        gather_index = index.clamp(max=H - 1)[..., None].expand(-1, -1, A)
        new = actions.gather(1, gather_index)  # (B, horizon, A)

        if self.merge == "rtc":
            new = self._rtc_blend(new, lag, H)
        if self.merge in ("latest", "rtc"):
            # With an empty queue the accumulation below stores the new actions with weight 1,
            # so latest-only is "forget the future, then accumulate".
            self._clear_slots(takes)
        self._accumulate(new, covered)
        self._source = torch.where(covered, obs_step[:, None], self._source)

    def next_action(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Emit the action for ``step`` and advance every env by one step.

        Returns actions (B, A) and valid (B,) bool. Where nothing is queued, valid is False and the
        last emitted action is held (zeros if none since the last reset), so the robot does not
        jump to zero when inference is late.
        """
        valid = self._count[:, 0] > 0
        actions = torch.where(valid[:, None], self._queued_actions()[:, 0], self._last_action)
        self._last_action = actions
        self.emitted_source = torch.where(valid, self._source[:, 0], self.emitted_source)
        self.emitted_row = torch.where(valid, self.step - self._source[:, 0], -1)
        # Shift the window: slot k + 1 becomes slot k, and the new last slot is empty.
        self._sum = torch.cat([self._sum[:, 1:], torch.zeros_like(self._sum[:, :1])], dim=1)
        self._weight = torch.cat([self._weight[:, 1:], torch.zeros_like(self._weight[:, :1])], dim=1)
        self._count = torch.cat([self._count[:, 1:], torch.zeros_like(self._count[:, :1])], dim=1)
        self._source = torch.cat([self._source[:, 1:], torch.full_like(self._source[:, :1], -1)], dim=1)
        self.step = self.step + 1
        # A copy, so a caller that edits its actions in place cannot change the held action.
        return actions.clone(), valid

    def plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the queue will emit from step ``step + lead_steps`` on if no chunk merges: actions (B, horizon -
        lead_steps, A), row k for step ``step + lead_steps + k`` (zeros in empty slots), and how many consecutive
        steps from there on are queued (B,) long.

        A robot whose controller takes whole trajectories (`vla-rl serve --output=trajectory`) sends this
        after each merge: the committed prefix (the steps already emitted, and the ``lead_steps`` after them,
        which the controller holds from the trajectory before) is never in it.
        """
        queued = self._count[:, self.lead_steps :] > 0
        return self._queued_actions()[:, self.lead_steps :], queued.long().cumprod(dim=1).sum(dim=1)

    def upcoming(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the queue holds for the next ``rows`` steps from ``step`` on (row 0: the action ``next_action()``
        emits next): actions (B, rows, A) (zeros where nothing is queued), queued (B, rows) bool, and the
        ``obs_step`` of the chunk each row comes from (B, rows) long (-1 where nothing is queued). Rows past the
        window are empty. What a low-latency policy reads every step (`policies.low_latency`)."""
        take = min(rows, self.horizon)
        actions, queued, source = self._queued_actions()[:, :take], self._count[:, :take] > 0, self._source[:, :take]
        if take < rows:
            pad = rows - take
            actions = torch.cat([actions, actions.new_zeros(self.num_envs, pad, self.action_dim)], 1)
            queued = torch.cat([queued, queued.new_zeros(self.num_envs, pad)], 1)
            source = torch.cat([source, source.new_full((self.num_envs, pad), -1)], 1)
        return actions, queued, source

    def discard_queue(self, env_mask: torch.Tensor | None = None, from_slot: int = 0) -> None:
        """Forget the queued actions of the masked envs (all when None) from slot ``from_slot`` on, keeping step and
        held action.

        A robot that stopped to hold position must not resume a plan made before it stopped; a plan its controller
        never got (``from_slot`` = ``lead_steps``: the steps before are the previous trajectory's) must not be
        taken for what runs.
        """
        slots = torch.arange(self.horizon, device=self.device) >= from_slot
        self._clear_slots(self._env_mask(env_mask)[:, None] & slots)

    def rtc_guidance(
        self, delay_steps: torch.Tensor, execute_steps: int | torch.Tensor, validate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a flow policy inpaints toward when it is asked for a chunk now (RTC guidance).

        delay_steps: (B,) long, the expected inference delay d; execute_steps: s (an int, or (B,)
        long), the steps of the previous chunk that ran before this request. Returns target (B,
        horizon, A), the queued actions aligned to the chunk a request made now produces (index i is
        step ``step + i``; zeros where nothing is queued), and weights (B, horizon): :func:`rtc_weights`,
        zero where nothing is queued. ``validate=False`` skips the sign check, which reads the device.
        """
        delay_steps = delay_steps.to(self.device)
        if (
            delay_steps.shape != (self.num_envs,)
            or delay_steps.is_floating_point()
            or (validate and (delay_steps < 0).any())
        ):
            raise ValueError(f"delay_steps must be (num_envs={self.num_envs},) integers >= 0, got {delay_steps}")
        s = torch.as_tensor(execute_steps, device=self.device).expand(self.num_envs)
        if not isinstance(execute_steps, torch.Tensor) and not 1 <= execute_steps <= self.horizon:
            raise ValueError(f"execute_steps must be in [1, horizon={self.horizon}], got {execute_steps}")
        queued = self._count > 0  # (B, horizon)
        weights = rtc_weights(self.horizon, delay_steps, s) * queued
        return self._queued_actions(), weights

    def reset(self, env_mask: torch.Tensor | None = None) -> None:
        """Clear the queue, the held action and the step counter of the masked envs (all when None)."""
        mask = self._env_mask(env_mask)
        self._clear_queue(mask)
        self.step = torch.where(mask, 0, self.step)
        # A new episode must not hold the previous episode's last action.
        self._last_action = torch.where(mask[:, None], 0.0, self._last_action)
        self.emitted_source = torch.where(mask, -1, self.emitted_source)
        self.emitted_row = torch.where(mask, -1, self.emitted_row)

    def delay_augmentation(self, delay_steps: torch.Tensor, validate: bool = True) -> dict[str, torch.Tensor]:
        """The committed actions that run before a chunk requested now can start.

        delay_steps: (B,) long, each in [0, max_delay]. Returns:

        - ``OBS_COMMITTED_ACTIONS``: (B, max_delay, A) float, row j is the queued action for step
          ``step + j`` when j < delay_steps and that step is queued, else zero
        - ``OBS_COMMITTED_MASK``: (B, max_delay) bool, True for the real rows above
        - ``OBS_DELAY_STEPS``: (B,) long, ``delay_steps``
        """
        if delay_steps.shape != (self.num_envs,):
            raise ValueError(f"delay_steps must have shape ({self.num_envs},), got {tuple(delay_steps.shape)}")
        return augmentation(self._queued_actions(), self._count > 0, delay_steps, self.max_delay, validate)

    def _accumulate(self, new: torch.Tensor, covered: torch.Tensor) -> None:
        """Add predictions new (B, horizon, A) to the slots where covered (B, horizon) is True.

        The i-th prediction for a slot (i = count so far, 0 = oldest) gets weight exp(-c * i).
        """
        weight = torch.exp(-self.ensemble_coeff * self._count.float()) * covered  # (B, horizon)
        self._sum = self._sum + weight[..., None] * new
        self._weight = self._weight + weight
        self._count = self._count + covered.long()

    def _rtc_blend(self, new: torch.Tensor, lag: torch.Tensor, chunk_horizon: int) -> torch.Tensor:
        """Blend new (B, horizon, A), aligned to the window, toward the queued actions with RTC weights.

        lag (B,) is the chunk's lag; slot k is chunk index k + lag. The frozen prefix d is lag + lead_steps.
        """
        queued = self._count > 0  # (B, horizon)
        # The previous plan ends at chunk index lag + (its last queued slot + 1) = H - s.
        end = (lag + self.queue_end()).clamp(max=chunk_horizon)
        weights = rtc_blend_weights(chunk_horizon, lag + self.lead_steps, end)  # (B, H), by chunk index
        index = (torch.arange(self.horizon, device=self.device) + lag[:, None]).clamp(max=chunk_horizon - 1)
        w = weights.gather(1, index) * queued  # (B, horizon), by slot; no old action -> take the new one
        return w[..., None] * self._queued_actions() + (1 - w[..., None]) * new

    def _queued_actions(self) -> torch.Tensor:
        """(B, horizon, A): the action each slot would emit now, zeros in empty slots."""
        # A queued slot's weight is >= 1 because its oldest prediction weighs exp(0) = 1;
        # the clamp only keeps empty slots (sum 0, weight 0) at 0 instead of NaN.
        return self._sum / self._weight.clamp(min=1.0)[..., None]

    def _clear_queue(self, mask: torch.Tensor) -> None:
        """Empty the whole window of the envs selected by mask (B,) bool."""
        self._clear_slots(mask[:, None].expand(-1, self.horizon))

    def _clear_slots(self, slots: torch.Tensor) -> None:
        """Empty the slots selected by ``slots`` (B, horizon) bool."""
        # torch.where, not masked assignment: a boolean index would read the mask on the host.
        self._sum = torch.where(slots[..., None], 0.0, self._sum)
        self._weight = torch.where(slots, 0.0, self._weight)
        self._count = torch.where(slots, 0, self._count)
        self._source = torch.where(slots, -1, self._source)

    def _env_mask(self, env_mask: torch.Tensor | None) -> torch.Tensor:
        """Validate env_mask (B,) bool; None selects every env."""
        if env_mask is None:
            return torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        if env_mask.shape != (self.num_envs,) or env_mask.dtype != torch.bool:
            raise ValueError(
                f"env_mask must be a bool tensor of shape ({self.num_envs},), "
                f"got {env_mask.dtype} {tuple(env_mask.shape)}"
            )
        return env_mask.to(self.device)
