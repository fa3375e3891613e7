"""The latency protocol: everything that happens between a world asking for a chunk and the chunk's
actions running, as one object that simulation, fine-tuning and the robot all drive.

Two shells drive a `LatencyProtocol` with their own clock and their own stand-in for inference:
`vla_core.runtime.delayed_env.DelayedChunkEnv` (simulated time; a policy call and a drawn delay) and
`robot_bridge.chunk_scheduler.ChunkScheduler` (ticks of the robot; the inference worker process).
Each control step, per world, in this order:

1. ``receive`` the chunks that came back: merged into the queue (`ActionChunkExecutor`) unless
   planned before the world's last hold or restart (its *epoch*); the lag (steps since the chunk's
   observation, plus ``lead_steps``: when its first action runs) feeds the measured delay estimate;
2. ``due``: a world requests when nothing is in flight and ``execute_steps`` steps have passed
   since its last request (one inference at a time, as on a robot);
3. ``open`` a request: it announces a delay d (the oracle's true delay in simulation, else the
   largest lag of the last ``estimate_window`` merged chunks; either plus ``lead_steps``, the steps
   from a chunk's arrival to its first action), and carries the delay augmentation of the queue for d
   and, when the policy takes it, RTC guidance;
4. ``take_asked``: the open requests whose policy input is complete. A latency-aware policy also
   reads a mid-inference observation, taken m = floor(mid_fraction * (d - lead_steps)) steps after the
   request (`mid_inference_steps`: within the inference), so it is asked at t + m; its chunk is still
   conditioned on step t and can arrive no earlier than t + m + 1 (``arrival_step``); every other policy
   is asked at once;
5. ``next_action``: the queue emits the step's action (nothing queued: the shell holds). A policy with a
   low-latency part (ARLI's fast policy, `policies.low_latency`) then corrects it from the freshest
   observation and ``step_context``: the plan the queue holds, its information's age and the steps since
   the request; each shell calls it every control step, with the observation it has.

``hold`` (the robot stopped) empties the queue and starts a new epoch; ``restart`` (a new episode)
also resets the step counter and drops what is in flight; ``abandon`` ends a request without a chunk;
``new_instruction`` (the instruction changed mid-task) drops the plan after its committed lead and what is in
flight, and makes a request due at once (``chunking.on_new_instruction=replan``, simulation's default; ``next_chunk``,
a robot's, for its shell does not react yet: nothing changes).

What a policy can be run with is decided here once, from its `LatencySpec` (its config): the delays it
fits (`LatencySpec.check_delay`) and the merges allowed for each use (`MERGES`), read alike by
``vla-rl eval``, ``vla-rl finetune`` and ``vla-rl serve``. Everything is (N,) torch state on the
executor's device, updated with masks; no method reads the device back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from vla_core.runtime.config import ChunkingConfig
from vla_core.runtime.delay import DelayEstimate, mid_inference_steps, mid_observation
from vla_core.runtime.executor import ActionChunkExecutor, MergeMode
from vla_core.types import ActionChunk

DEFAULT_MID_FRACTION = 0.5  # the mid-inference observation is taken half-way through the inference window

PolicyKind = Literal["plain", "latency_aware", "low_latency"]
Use = Literal["eval", "finetune", "robot"]

# Which merge each kind of policy runs with, per use; the reason a refused merge is refused.
_ANY: tuple[MergeMode, ...] = ("latest", "ensemble", "rtc")
MERGES: dict[Use, dict[PolicyKind, tuple[MergeMode, ...]]] = {
    "eval": {"plain": _ANY, "latency_aware": ("latest",), "low_latency": ("latest",)},
    "robot": {"plain": _ANY, "latency_aware": ("latest",), "low_latency": ("latest",)},
    "finetune": {"plain": ("latest",), "latency_aware": ("latest",), "low_latency": ("latest",)},
}
_WHY = {
    "finetune": "executes actions other than the sampled chunk, which its log-probability does not describe; "
    "fine-tune with --chunking.merge=latest and evaluate other merges with `vla-rl eval`",
    "latency_aware": "is not how a latency-aware policy acts: it was fine-tuned with latest-only merging, and its "
    "chunks start where its mid-inference observation left the world; set chunking.merge to latest",
    "low_latency": "is not how a policy with a low-latency part acts: its fast policy corrects the newest chunk's rows, "
    "as it was fine-tuned (latest-only merging); set chunking.merge to latest",
}


def check_mid_fraction(value: float, name: str = "mid_fraction") -> None:
    """The one range check of where the mid-inference observation is taken: in [0, 1), a point of the
    inference window before its end. At 1 it would be taken as the chunk is due, its answer would come a
    step late every time, and a measured delay estimate would then grow without end."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value} must be in [0, 1): a point of the inference window, before its end")


def check_merge(merge: str, use: Use, kind: PolicyKind | None = None) -> None:
    """Refuse, with the fix, a merge the table `MERGES` does not allow for ``use`` (for ``kind``; None: a
    merge no kind of policy may use there)."""
    kinds = [kind] if kind is not None else list(MERGES[use])
    if all(merge in MERGES[use][k] for k in kinds):
        return
    why = _WHY["finetune"] if use == "finetune" else _WHY[kind or "latency_aware"]
    raise ValueError(f"chunking.merge={merge} {why}")


@dataclass(frozen=True)
class LatencySpec:
    """How a policy meets the latency model: the fields of its config the protocol reads.

    committed_rows: the delay augmentation's rows it reads (training-time RTC's ``max_delay_steps``;
    0: none). A latency-aware policy (ARLI, `policies.latency_head`) also reads committed actions up
    to ``latency_max_delay`` and a mid-inference observation (``mid_fraction``, ``mid_cameras``).
    """

    horizon: int
    n_action_steps: int | None = None
    committed_rows: int = 0
    latency_aware: bool = False
    latency_max_delay: int = 0
    mid_fraction: float = DEFAULT_MID_FRACTION
    mid_cameras: tuple[str, ...] = ()
    supports_inpainting: bool = False
    low_latency_rows: int = 0  # a low-latency part (`policies.low_latency`) reads this many plan rows; 0: none

    @classmethod
    def of(cls, policy) -> LatencySpec:
        """The spec of a policy (anything with a ``config`` as `vla_core.types.PolicyConfigView`)."""
        c = policy.config
        return cls(
            horizon=getattr(c, "horizon", 0) or 0, n_action_steps=getattr(c, "n_action_steps", None),
            committed_rows=getattr(c, "max_delay_steps", 0) or 0, latency_aware=bool(getattr(c, "latency_aware", False)),
            latency_max_delay=getattr(c, "latency_max_delay", 0) or 0,
            mid_fraction=getattr(c, "mid_fraction", DEFAULT_MID_FRACTION), mid_cameras=tuple(getattr(c, "mid_cameras", ())),
            supports_inpainting=bool(getattr(policy, "supports_inpainting", False)),
            low_latency_rows=getattr(c, "low_latency_rows", 0) if getattr(c, "low_latency", False) else 0,
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """Plain values, to cross a process boundary (the robot's inference worker sends it)."""
        return asdict(self)

    @property
    def kind(self) -> PolicyKind:
        return "latency_aware" if self.latency_aware else "low_latency" if self.low_latency_rows else "plain"

    @property
    def reads(self) -> int:
        """The most committed-action rows the policy reads."""
        return max(self.committed_rows, self.latency_max_delay if self.latency_aware else 0)

    def check_delay(self, max_delay: int, on_robot: bool = False, lead_steps: int = 0) -> None:
        """Refuse, before any step, delays up to ``max_delay`` + ``lead_steps`` control steps that no chunk
        survives or the policy was not trained or fine-tuned for (the delay model's largest draw; ``on_robot``,
        the serve config's ``max_delay_steps``, whose fix is to serve faster; ``lead_steps``, the chunking's)."""
        fix = "serve faster" if on_robot else "lower the delay"
        lead = f" plus chunking.lead_steps={lead_steps}" if lead_steps else ""
        reach = (f"this robot's delays reach max_delay_steps={max_delay}{lead} control steps" if on_robot
                 else f"the delay model reaches {max_delay}{lead} control steps")  # fmt: skip
        max_delay += lead_steps
        if max_delay >= self.horizon:
            raise ValueError(
                f"{reach} but a chunk holds {self.horizon}: every chunk would arrive stale; {fix} or train a "
                f"policy with a longer --policy.horizon"
            )
        if self.committed_rows and max_delay > self.committed_rows:
            raise ValueError(
                f"{reach} but the policy was trained for delays up to {self.committed_rows}; {fix} or retrain "
                f"with --delay.kind=uniform --delay.high={max_delay}"
            )
        if self.latency_aware and max_delay > self.latency_max_delay:
            raise ValueError(
                f"{reach} but this latency-aware policy was fine-tuned for delays up to {self.latency_max_delay}; "
                f"{fix} or fine-tune it at {max_delay}"
            )


class LatencyProtocol:
    """The protocol for N worlds (see the module docstring); built from a policy's spec for one use.

    max_delay: the largest delay expected (the delay model's largest draw; a robot's configured
    ``max_delay_steps``), refused when the policy does not fit it. estimate: ``oracle`` (simulation:
    ``open`` is given the true delay) or ``measured``.
    """

    def __init__(self, spec: LatencySpec, chunking: ChunkingConfig, *, use: Use, num_worlds: int, action_dim: int,
                 max_delay: int = 0, estimate: DelayEstimate = "measured", device: torch.device | str = "cpu"):  # fmt: skip
        self.execute_steps = chunking.steps_per_chunk(spec.n_action_steps, spec.horizon)  # validates chunking
        check_merge(chunking.merge, use, spec.kind)
        # A chunk's actions start lead_steps after it arrives: to the policy that is more delay.
        spec.check_delay(max_delay, on_robot=use == "robot", lead_steps=chunking.lead_steps)
        max_delay += chunking.lead_steps
        if spec.latency_aware:
            check_mid_fraction(spec.mid_fraction, "the policy's mid_fraction")
        if estimate not in ("oracle", "measured") or (use == "robot" and estimate == "oracle"):
            raise ValueError(
                f"delay.estimate must be measured on a robot, oracle or measured in simulation, got {estimate!r}"
            )
        self.spec, self.use, self.estimate = spec, use, estimate
        if use == "robot" and chunking.on_new_instruction == "replan":
            raise ValueError("chunking.on_new_instruction=replan: the robot's shell does not react to a new instruction "
                             "yet (serve applies it from the next request on); drop the setting")  # fmt: skip
        # "": the shell's own rule, replan in simulation, next_chunk on a robot
        self.on_new_instruction = chunking.on_new_instruction or ("next_chunk" if use == "robot" else "replan")
        # As wide as the policy reads, and as the largest delay expected: rows past what the policy reads
        # are never looked at, and a delay above it is announced as the width (counted by the robot).
        self.executor = ActionChunkExecutor(
            num_worlds, action_dim, spec.horizon, merge=chunking.merge, ensemble_coeff=chunking.ensemble_coeff,
            max_delay=max(spec.reads, max_delay), lead_steps=chunking.lead_steps, device=device,
        )  # fmt: skip
        self.mid_fraction = spec.mid_fraction if spec.latency_aware else None
        self.sends_guidance = chunking.merge == "rtc" and spec.supports_inpainting
        n, dev = num_worlds, self.executor.device
        long, flag = torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.bool, device=dev)
        self.in_flight = flag.clone()  # a request is open: waiting for its policy input or for its chunk
        self.pending = flag.clone()  # open, but its policy is not asked yet (the mid observation is to come)
        self.next_request = long.clone()  # step of the next request
        self.announced = long.clone()  # delay told to the latest request
        self.lags = torch.zeros(n, chunking.estimate_window, dtype=torch.long, device=dev)  # newest last
        self.request_step, self.ask_step = long.clone(), long.clone()  # of the latest request: t, t + m
        self.epoch, self.request_epoch = long.clone(), long.clone()  # bumped by hold and restart
        self.augmentation: dict[str, torch.Tensor] = {}  # each open request's delay augmentation (rows)
        self.guidance: tuple[torch.Tensor, torch.Tensor] | None = None  # each open request's RTC guidance (rows)

    @property
    def step(self) -> torch.Tensor:
        """(N,) long: the step whose action is emitted next, which a request made now is conditioned on."""
        return self.executor.step

    @property
    def lead_steps(self) -> int:
        """Steps from a chunk's arrival to its first action (``chunking.lead_steps``)."""
        return self.executor.lead_steps

    @property
    def width(self) -> int:
        """D of the delay augmentation (``observation.committed_*`` rows)."""
        return self.executor.max_delay

    def saved_lags(self) -> dict[str, Any]:
        """The measured lags, to save with a run, and the lead each of them counts."""
        return {"lags": self.lags.cpu(), "lead_steps": self.lead_steps}

    def restore_lags(self, saved: dict[str, Any] | torch.Tensor, source: str) -> None:
        """Give back `saved_lags` (``source`` names the file in the refusal). Every lag counts the lead it was
        measured with, so lags of another ``chunking.lead_steps`` are refused. A bare tensor (saved before the lead
        was saved beside it) names no lead: it is taken as measured with this run's, as it was before."""
        lags, lead = (saved["lags"], saved["lead_steps"]) if isinstance(saved, dict) else (saved, self.lead_steps)
        if lead != self.lead_steps:
            raise ValueError(f"{source} measured its delays with chunking.lead_steps={lead} (each lag counts the lead); "
                             f"resume it with --chunking.lead_steps={lead}, not {self.lead_steps}")  # fmt: skip
        self.lags = lags.to(self.lags.device)

    def due(self) -> torch.Tensor:
        """(N,) bool: the worlds that request now."""
        return ~self.in_flight & (self.executor.step >= self.next_request)

    def estimated_delay(self) -> torch.Tensor:
        """(N,) long: the measured estimate, the largest of the last ``estimate_window`` lags (each counts the
        ``lead_steps`` its chunk waited after arriving), and at least the lead."""
        return self.lags.amax(dim=1).clamp(min=self.lead_steps)

    def open(self, worlds: torch.Tensor, true_delay: torch.Tensor | None = None) -> None:
        """Open a request in ``worlds`` (N,) bool, conditioned on the current step. true_delay (N,) long: the
        delay each request will get, which the oracle estimate announces (simulation only)."""
        ex = self.executor
        if self.estimate == "oracle" and true_delay is None:
            raise ValueError("the oracle delay estimate needs the true delay; the robot must use measured")
        estimate = true_delay.to(ex.device) + self.lead_steps if self.estimate == "oracle" else self.estimated_delay()
        # A delay of a whole chunk leaves nothing to guide or blend: the chunk's last index is the cap.
        self.announced = torch.where(worlds, estimate.clamp(max=ex.horizon - 1), self.announced)
        self.in_flight, self.pending = self.in_flight | worlds, self.pending | worlds
        self.next_request = torch.where(worlds, ex.step + self.execute_steps, self.next_request)
        self.request_step = torch.where(worlds, ex.step, self.request_step)
        # The mid point is in the inference's window, which the lead (after the chunk arrives) is not part of.
        inference = (self.announced - self.lead_steps).clamp(min=0)
        mid = 0 if self.mid_fraction is None else mid_inference_steps(inference, self.mid_fraction)
        self.ask_step = torch.where(worlds, ex.step + mid, self.ask_step)
        self.request_epoch = torch.where(worlds, self.epoch, self.request_epoch)
        told = ex.delay_augmentation(self.announced.clamp(max=ex.max_delay), validate=False)
        self.augmentation = merge_rows(self.augmentation, told, worlds)
        if self.sends_guidance:
            # The previous plan reaches chunk index queue_end, i.e. s = H - queue_end steps of it ran.
            ran = (ex.horizon - ex.queue_end()).clamp(min=1, max=ex.horizon)
            guidance = ex.rtc_guidance(self.announced, ran, validate=False)
            old = self.guidance or tuple(torch.zeros_like(g) for g in guidance)
            self.guidance = tuple(torch.where(worlds.view(-1, *[1] * (g.ndim - 1)), g, o)
                                  for g, o in zip(guidance, old, strict=True))  # fmt: skip

    def take_asked(self) -> torch.Tensor:
        """(N,) bool: the open requests whose policy is asked now (their input complete); no longer pending."""
        asked = self.pending & (self.executor.step >= self.ask_step)
        self.pending = self.pending & ~asked
        return asked

    def mid_observation(self, observation: dict[str, Any], worlds: torch.Tensor | None = None) -> dict[str, Any]:
        """``observation.mid.*`` from the current observation (torch batch of N, or numpy batch of the one
        world ``worlds`` selects on a robot): its state, the policy's mid cameras, the steps since the request."""
        steps = self.executor.step - self.request_step
        if worlds is not None:
            steps = steps[worlds].numpy()
        return mid_observation(observation, self.spec.mid_cameras, steps)

    def step_context(self, rows: int) -> StepContext:
        """What a low-latency policy reads of the protocol now, before the step's action is emitted."""
        ex = self.executor
        plan, queued, source = ex.upcoming(rows)
        running = torch.where(queued[:, 0], source[:, 0], ex.emitted_source)  # the chunk whose row runs (or last ran)
        return StepContext(plan, queued, torch.where(running >= 0, ex.step - running, -1), ex.step - self.request_step)

    def arrival_step(self, true_delay: torch.Tensor) -> torch.Tensor:
        """(N,) long: when the latest requests' chunks arrive, ``true_delay`` steps after their request, but a
        step after their mid observation at the earliest (the fast part runs once it is in)."""
        arrival = self.request_step + true_delay
        waited = self.ask_step > self.request_step
        return torch.where(waited, torch.maximum(arrival, self.ask_step + 1), arrival)

    def receive(self, chunk: ActionChunk, worlds: torch.Tensor, validate: bool = True) -> torch.Tensor:
        """The chunks of ``worlds`` (N,) bool came back: each request ends, and its chunk merges unless its
        world held or restarted since the request. Returns (N,) bool, the merged ones."""
        ex = self.executor
        merged = worlds & (self.request_epoch == self.epoch)
        lag = ex.step - chunk.obs_step.to(ex.device) + self.lead_steps  # its actions start lead_steps from now
        ex.add_chunk(chunk, env_mask=merged, validate=validate)
        shifted = torch.cat([self.lags[:, 1:], lag[:, None].clamp(min=0)], dim=1)
        self.lags = torch.where(merged[:, None], shifted, self.lags)
        self.in_flight = self.in_flight & ~worlds
        return merged

    def abandon(self, worlds: torch.Tensor) -> None:
        """The open requests of ``worlds`` end without a chunk (the inference failed)."""
        self.in_flight, self.pending = self.in_flight & ~worlds, self.pending & ~worlds

    def hold(self, worlds: torch.Tensor) -> None:
        """``worlds`` stop to hold position: the queued plan and any chunk still in flight (planned before
        the hold) must never run. The request stays in flight, one at a time, until its answer is dropped."""
        self.executor.discard_queue(worlds)
        self.epoch = torch.where(worlds, self.epoch + 1, self.epoch)

    def new_instruction(self, worlds: torch.Tensor) -> None:
        """The instruction of ``worlds`` (N,) bool changed at the current step (the observation a request made now
        would be conditioned on is the first to carry it). With ``on_new_instruction=replan``: the queue is dropped
        from slot ``lead_steps`` on (the rows before are committed: a trajectory controller already holds them), so
        the arm holds until the new chunk; the request in flight is abandoned and its answer, planned under the old
        instruction, never merges (a new epoch); a request is due at once. With ``next_chunk`` nothing changes:
        the old plan runs out and the next request on schedule carries the new instruction."""
        if self.on_new_instruction == "next_chunk":
            return
        self.executor.discard_queue(worlds, from_slot=self.lead_steps)
        self.epoch = torch.where(worlds, self.epoch + 1, self.epoch)
        self.abandon(worlds)
        self.next_request = torch.where(worlds, self.executor.step, self.next_request)

    def restart(self, worlds: torch.Tensor) -> None:
        """New episodes in ``worlds``: empty queue, step 0, nothing in flight, a request at once. The lags
        stay: they measure the inference, not the episode."""
        self.executor.reset(worlds)
        self.abandon(worlds)
        self.epoch = torch.where(worlds, self.epoch + 1, self.epoch)
        self.next_request = torch.where(worlds, 0, self.next_request)

    def next_action(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The queue's actions (N, A) and valid (N,) for this step; advances every world one step."""
        return self.executor.next_action()


@dataclass
class StepContext:
    """What a low-latency policy reads of the protocol at a control step, for N worlds: ``plan`` (N, R, A) the
    queue's next R actions from this step on (zeros where empty) and ``queued`` (N, R) bool; ``plan_age`` (N,)
    long, steps since the observation the chunk running now was conditioned on (-1: no chunk has run yet this
    episode); ``since_request`` (N,) long, steps since the latest request."""

    plan: torch.Tensor
    queued: torch.Tensor
    plan_age: torch.Tensor
    since_request: torch.Tensor


def merge_rows(old: dict[str, Any], new: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """``new``'s values in ``rows`` (N,) bool, ``old``'s elsewhere (all of ``new`` where ``old`` lacks a
    key): tensors with a leading world dim, or per-world lists (the instructions)."""
    merged: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if torch.is_tensor(value):
            if before is None or before.shape != value.shape:
                merged[key] = value.clone()
            else:
                mask = rows.to(value.device).view(-1, *([1] * (value.ndim - 1)))
                merged[key] = torch.where(mask, value, before)
        else:
            picked = rows.tolist()
            merged[key] = (
                list(value)
                if before is None
                else [v if p else b for v, b, p in zip(value, before, picked, strict=True)]
            )
    return merged
