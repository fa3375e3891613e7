"""When chunks are requested and what each request is told: the part of the latency model that the
simulation's delay shell (`vla_core.runtime.delayed_env.DelayedChunkEnv`) and the robot's node
(`robot_bridge.chunk_scheduler.ChunkScheduler`) share, so both do the same thing on the same timeline.

Per world, every control step runs in this order (both shells):

1. ``receive`` any chunk that came back: it merges into the `ActionChunkExecutor` queue, its lag
   (steps emitted since its observation) feeds the measured delay estimate;
2. ``due()``: a world requests when no inference is in flight and ``execute_steps`` steps have
   passed since its last request (one inference at a time, as on a robot);
3. ``request``: the request is announced a delay d (the estimate), gets the delay augmentation of
   the queue for that d and, with the ``rtc`` merge, the guidance toward the queued actions;
4. ``next_action``: the executor emits the step's action.

The delay estimate: ``oracle`` announces the delay the request will really get (simulation only,
where it is drawn before the request); ``measured`` announces the largest lag of the world's last
``window`` merged chunks (0 before any), which is what the robot can know. RTC guidance uses the
estimate as it is (up to the chunk length); the delay augmentation clamps it to ``max_delay``, the
largest delay the policy trained with.

A world whose episode ends (simulation) is ``restart``-ed: an empty queue, nothing in flight, a
request at once. A chunk that must not be merged (planned before a hold, or a failed inference)
is ``abandon``-ed. Everything is (N,) torch state on the executor's device, updated with masks, and
no method reads the device back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vla_core.runtime.delay import DelayEstimate
from vla_core.runtime.executor import ActionChunkExecutor
from vla_core.types import ActionChunk


@dataclass
class ChunkRequest:
    """What the requesting worlds are told. Rows of worlds that did not request hold stale values.

    augmentation: the delay augmentation (`ActionChunkExecutor.delay_augmentation`) for ``delay_steps``.
    guidance: with the ``rtc`` merge, (target (N, H, A), weights (N, H)) for `Policy.predict_chunk`'s
        ``inpaint``; None otherwise.
    """

    delay_steps: torch.Tensor  # (N,) long, the estimated delay (the augmentation's is clamped to max_delay)
    augmentation: dict[str, torch.Tensor]
    guidance: tuple[torch.Tensor, torch.Tensor] | None


class ChunkSchedule:
    """One inference in flight per world, when the next request goes out, and what it announces."""

    def __init__(
        self,
        executor: ActionChunkExecutor,
        execute_steps: int,
        estimate: DelayEstimate = "measured",
        window: int = 4,
    ) -> None:
        if not 1 <= execute_steps <= executor.horizon:
            raise ValueError(f"execute_steps must be in [1, horizon={executor.horizon}], got {execute_steps}")
        if estimate not in ("oracle", "measured"):
            raise ValueError(f"estimate must be oracle or measured, got {estimate!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.executor = executor
        self.execute_steps = execute_steps
        self.estimate = estimate
        n, device = executor.num_envs, executor.device
        self.in_flight = torch.zeros(n, dtype=torch.bool, device=device)
        self.next_request = torch.zeros(n, dtype=torch.long, device=device)  # step of the next request
        self.announced = torch.zeros(n, dtype=torch.long, device=device)  # delay told to the latest request
        self.lags = torch.zeros(n, window, dtype=torch.long, device=device)  # last `window` lags, newest last

    @property
    def step(self) -> torch.Tensor:
        """(N,) long: the step whose action is emitted next, which a request made now is conditioned on."""
        return self.executor.step

    def due(self) -> torch.Tensor:
        """(N,) bool: the worlds that request now."""
        return ~self.in_flight & (self.executor.step >= self.next_request)

    def estimated_delay(self) -> torch.Tensor:
        """(N,) long: the measured estimate, the largest of the last ``window`` lags."""
        return self.lags.amax(dim=1)

    def request(self, worlds: torch.Tensor, true_delay: torch.Tensor | None = None) -> ChunkRequest:
        """Open a request in ``worlds`` (N,) bool: in flight from now, the next one ``execute_steps`` on.

        true_delay (N,) long: the delay each request will get, needed by the oracle estimate.
        """
        ex = self.executor
        if self.estimate == "oracle":
            if true_delay is None:
                raise ValueError("the oracle delay estimate needs the true delay; the robot must use measured")
            estimate = true_delay.to(ex.device)
        else:
            estimate = self.estimated_delay()
        # A delay of a whole chunk leaves nothing to guide or blend: the chunk's last index is the cap.
        self.announced = torch.where(worlds, estimate.clamp(max=ex.horizon - 1), self.announced)
        self.in_flight = self.in_flight | worlds
        self.next_request = torch.where(worlds, ex.step + self.execute_steps, self.next_request)
        guidance = None
        if ex.merge == "rtc":
            # The previous plan reaches chunk index queue_length, i.e. s = H - queue_length steps of it ran.
            ran = (ex.horizon - ex.queue_length()).clamp(min=1, max=ex.horizon)
            guidance = ex.rtc_guidance(self.announced, ran, validate=False)
        augmentation = ex.delay_augmentation(self.announced.clamp(max=ex.max_delay), validate=False)
        return ChunkRequest(self.announced.clone(), augmentation, guidance)

    def receive(self, chunk: ActionChunk, worlds: torch.Tensor, validate: bool = True) -> None:
        """Merge the chunks of ``worlds`` (N,) bool that came back; their lag feeds the measured estimate."""
        ex = self.executor
        lag = ex.step - chunk.obs_step.to(ex.device)
        ex.add_chunk(chunk, env_mask=worlds, validate=validate)
        shifted = torch.cat([self.lags[:, 1:], lag[:, None].clamp(min=0)], dim=1)
        self.lags = torch.where(worlds[:, None], shifted, self.lags)
        self.in_flight = self.in_flight & ~worlds

    def abandon(self, worlds: torch.Tensor) -> None:
        """The in-flight request of ``worlds`` ends without a chunk (stale after a hold, or it failed)."""
        self.in_flight = self.in_flight & ~worlds

    def restart(self, worlds: torch.Tensor) -> None:
        """New episodes in ``worlds``: empty queue, step 0, nothing in flight, a request at once. The lags
        stay: they measure the inference, not the episode."""
        self.executor.reset(worlds)
        self.in_flight = self.in_flight & ~worlds
        self.next_request = torch.where(worlds, 0, self.next_request)

    def next_action(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The executor's actions (N, A) and valid (N,) for this step; advances every world one step."""
        return self.executor.next_action()
