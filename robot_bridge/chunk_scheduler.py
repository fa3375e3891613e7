"""The robot's shell around the latency protocol (`vla_core.runtime.protocol`): the control loop's ticks are
its clock, and the inference worker (`robot_bridge.inference`) stands in for inference.

After each control tick (off the latency path) the node calls :meth:`ChunkScheduler.prepare_next_action`,
which drives the protocol in the order the simulation's shell does: merge the chunk that came back
(a chunk takes effect ``chunking.lead_steps`` after the step after the tick that found it; one planned
before a hold is dropped), send the mid-inference observation of a latency-aware policy's request once its step has
come (the freshest joint state and images; the request's own if the inputs are rejected right now),
open the next request when due (never while holding, except to retry a failed policy), and take the
next step's action. Every measured latency goes to ``latency_log`` (JSON lines with the control
period, and the request's episode and index in it), which ``--delay.kind=histogram`` draws from and
``--delay.kind=trace`` replays, request by request, in simulation. No ROS import here.

A checkpoint with a low-latency part (`robot_bridge.low_latency`): :meth:`prepare_next_action` also keeps the
protocol's `StepContext` of the next step (read before its action is taken, as simulation's shell reads it), and
the node asks :meth:`low_latency_target` at the tick for the action the part makes of the queue's action (or the
hold) on the freshest observation (with trajectory output, :meth:`low_latency_correction`, which the node sends as
the trajectory's next point). The node holds until the part is loaded too.

With the robot's episode status (``topics.episode``), the node calls :meth:`start_episode_if_due`
before each tick's command: from the first joint state stamped after an episode's end, the protocol
restarts as simulation's does at an episode's end (empty queue, step 0, a new epoch: the request
still in flight is answered, logged and dropped), and requests are numbered from 0 again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from robot_bridge import inference as worker
from robot_bridge.config import ServeConfig
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.inputs import BridgeInputs
from robot_bridge.log_limit import LogLimiter
from robot_bridge.low_latency import LowLatencyRunner
from robot_bridge.policy_health import PolicyHealth, fit_protocol
from vla_core.runtime import LatencyLog, LatencyProtocol, mid_observation, request_noise
from vla_core.types import ActionChunk, Policy

ONE = torch.ones(1, dtype=torch.bool)  # the robot is one world


class ChunkScheduler:
    """``publish_chunk`` receives each merged chunk's metadata; ``logger`` has rclpy's ``info``/``error``."""

    def __init__(self, config: ServeConfig, load_policy: Callable[[], Policy], inputs: BridgeInputs,
                 diagnostics: BridgeDiagnostics, log_limiter: LogLimiter, logger, publish_chunk) -> None:  # fmt: skip
        self.config, self.inputs, self.diagnostics = config, inputs, diagnostics
        self.logger, self.publish_chunk, self.log_limiter = logger, publish_chunk, log_limiter
        self.health = PolicyHealth(config, diagnostics, log_limiter, logger)
        self.protocol: LatencyProtocol | None = None  # built once the policy is loaded and fits
        self.latency_log = LatencyLog(config.latency_log, 1.0 / config.control_hz) if config.latency_log else None
        self.policy_info: dict[str, Any] = {}
        self.in_flight: worker.InFlightRequest | None = None
        self._request_id, self._holding = 0, False
        self._seam_step: int | None = None  # the step the newest merged chunk's first action runs at
        self.episode, self.episode_requests = 0, 0  # the robot's episode (topics.episode) and its requests so far
        self.seam_obs_arrival = 0.0  # arrival of the joint state the newest merged chunk was conditioned on
        # The next tick's action ((A,) or None: nothing queued), its step, whether a new chunk starts there.
        self.next_target, self.next_step, self.next_is_seam = None, -1, False
        # After a call of prepare_next_action that merged a chunk the protocol keeps: (its first step, the
        # executor's plan from there (P, A)), the trajectory `output=trajectory` sends; else None.
        self.merged_plan: tuple[int, np.ndarray] | None = None
        self._load_policy = load_policy
        self.low_latency = None  # the checkpoint's low-latency part (`LowLatencyRunner`), when it has one
        self._fitted: LatencyProtocol | None = None  # the protocol, until the low-latency part is loaded too
        self.next_context = None  # the next step's StepContext, for the low-latency part
        c = config
        if c.inference == "remote":  # the policy on a `vla-rl policy-server`, same interface
            from robot_bridge.policy_server import RemoteInferenceWorker

            self.worker = RemoteInferenceWorker(c.inference_server, retry_s=c.load_retry_s)
        else:
            self.worker = worker.InferenceWorker(load_policy, mode=c.inference, cpu=c.inference_cpu, num_threads=c.inference_threads,
                                          nice=c.inference_nice, load_retry_s=c.load_retry_s, added_latency_s=c.added_latency_s)  # fmt: skip

    @property
    def delay_steps(self) -> int:
        """The delay the next request announces: the measured estimate, in control steps."""
        return int(self.protocol.estimated_delay()[0]) if self.protocol is not None else 0

    def queue_depth(self) -> int:
        return int(self.protocol.executor.queue_length()[0]) if self.protocol is not None else 0

    def prepare_next_action(self, cause: str | None, now: float) -> None:
        """Merge returned chunks, send a due mid observation, request when due, and take the next step's
        action. cause: why this tick held (None: it did not)."""
        self.merged_plan = None
        for message in self.worker.poll():
            if isinstance(message, worker.WorkerStatus):
                self._on_worker_status(message)
            elif self.in_flight is not None and message.request_id == self.in_flight.request_id:
                request, self.in_flight = self.in_flight, None
                self._on_result(message, request, now)
        if self._fitted is not None:
            self._finish_loading()
        p = self.protocol
        self.next_target, self.next_step, self.next_is_seam, self.next_context = None, -1, False, None
        if p is None:
            return
        if cause is not None and not self._holding:
            p.hold(ONE)  # the plan made before the hold never runs, nor the chunk in flight
            self.merged_plan = None
        self._holding = cause is not None
        if self.in_flight is not None and bool(p.take_asked()[0]):  # sent while holding too: the worker waits
            self._send_mid()
        # Between the robot's episodes (its end announced, the next not begun) the newest observation is the ended
        # episode's: nothing to ask about, as in simulation, where an episode's end opens the next one's request.
        between = self.inputs.ended_episode is not None
        if self.health.may_ask(cause, now) and not self.worker.busy and self.in_flight is None and bool(p.due()[0]) \
                and not between:  # fmt: skip
            self._request(now)
        self.next_step = int(p.step[0])
        if self.low_latency is not None:  # before the step's action is taken, as simulation's shell reads it
            self.next_context = p.step_context(p.spec.low_latency_rows)
        action, valid = p.next_action()  # also while holding: the step counter keeps time
        if bool(valid[0]) and not self._holding:
            self.next_target = action[0].numpy()
            self.next_is_seam = self._seam_step is not None and self.next_step >= self._seam_step
            if self.next_is_seam:
                self._seam_step = None

    def low_latency_target(self, target: np.ndarray | None, hold: np.ndarray) -> np.ndarray | None:
        """The tick's action with the low-latency part: its correction of ``target`` (the queue's action; None: the
        queue ran dry, and the part corrects ``hold`` (A,), the command the robot holds) on the freshest
        observation. Without a part, ``target``. When the part cannot act (`robot_bridge.low_latency`'s rule):
        ``target``, counted in ``low_latency_fallbacks``."""
        corrected = self.low_latency_correction(hold if target is None else target)
        return target if corrected is None else corrected

    def low_latency_correction(self, base: np.ndarray) -> np.ndarray | None:
        """The part's correction (A,) of ``base`` (A,) on the freshest observation; None without a part or a step
        context, or when the part cannot act (then counted in ``low_latency_fallbacks`` and logged)."""
        if self.low_latency is None or self.next_context is None:
            return None
        start = time.perf_counter()
        observation = self.inputs.observation(quiet=True)  # pairing problems are counted and logged by requests
        if observation is None:
            action, why = None, "no paired observation for the low-latency part"
        else:
            action, why = self.low_latency.act(observation, base, self.next_context)
        self.diagnostics.low_latency_ms.append((time.perf_counter() - start) * 1e3)
        if action is None:
            self.low_latency_fell_back(why)
        return action

    def low_latency_fell_back(self, why: str) -> None:
        """A tick whose correction could not go out: counted in ``low_latency_fallbacks``, logged once a second."""
        self.diagnostics.count("low_latency_fallbacks")
        self.log_limiter("low_latency_fallback", "error", f"{why}; sending the uncorrected action")

    def _finish_loading(self) -> None:
        """The policy fits and its worker is ready: ready once the low-latency part is loaded in this process."""
        if self.low_latency.error is not None:
            self._fitted = None
            self.health.load_failed(self.low_latency.error, counted=False)
        elif self.low_latency.ready:
            self.protocol, self._fitted = self._fitted, None
            self.health.ready()
            self.logger.info("low-latency part loaded: it corrects every tick's action")

    def discard_plan(self, first_step: int) -> None:
        """The merged plan from ``first_step`` never reached the robot (trajectory output, a waypoint out of the IK's
        reach): the queue forgets it from that step on, so the latency protocol does not take it for the committed
        prefix. The steps before (the lead's) stay: the controller runs them from the trajectory before."""
        if self.protocol is not None:
            from_slot = max(first_step - int(self.protocol.step[0]), 0)  # the step moved on since the merge
            self.protocol.executor.discard_queue(ONE, from_slot=from_slot)
        self.merged_plan = None

    def start_episode_if_due(self) -> bool:
        """Start the robot's next episode when the newest joint state is stamped after the end the robot
        announced (`BridgeInputs.ended_episode`); True when it did, and the node then anchors its hold anew."""
        ended = self.inputs.ended_episode
        if ended is None or self.inputs.state_time <= ended[1]:
            return False
        self.inputs.ended_episode = None
        self.episode, self.episode_requests = ended[0] + 1, 0
        p = self.protocol
        if p is not None:
            if self.in_flight is not None and bool(p.pending[0]):
                self._send_mid()  # the worker waits for it; its answer will be dropped
            p.restart(ONE)
            # The new episode's first tick may run the part: on the restarted queue, as simulation's does.
            self.next_context = p.step_context(p.spec.low_latency_rows) if self.low_latency is not None else None
        self.next_target, self.next_is_seam, self._seam_step = None, False, None
        return True

    def close(self) -> None:
        self.worker.close()
        if self.latency_log is not None:
            self.latency_log.close()

    def _on_worker_status(self, status: worker.WorkerStatus) -> None:
        if status.state == "failed":
            self.health.load_failed(status.error)
        elif status.state == "loading":
            self.health.loading()
        elif status.state == "ready":
            self.policy_info = status.info
            self.inputs.policy_image_size = status.info.get("image_size")
            try:
                protocol = fit_protocol(self.config, status.info)
            except ValueError as err:  # the checkpoint does not fit this robot's config: say why, and hold
                self.health.load_failed(str(err), counted=False)
                return
            self.logger.info(f"policy ready: {status.info}")
            if protocol.spec.low_latency_rows:  # hold until this process has the part too
                if self.low_latency is None or self.low_latency.error is not None:  # a failed load is tried again
                    self.low_latency = LowLatencyRunner(self._load_policy)
                self._fitted = protocol
                self._finish_loading()
                return
            self.protocol = protocol
            self.health.ready()

    def _on_result(self, result: worker.InferenceResult, request: worker.InFlightRequest, now: float) -> None:
        # From the submission to the worker's answer: the inference's own latency, not rounded to the tick
        # that found it (the simulation rounds it up to steps when it replays the log).
        p, latency = self.protocol, result.finished - request.sent
        problem = result.error or worker.chunk_problem(result.actions, p.spec.horizon, self.config.action_names)
        if problem is not None:  # never merged: a NaN or misshapen plan must not reach the safety filter
            p.abandon(ONE)
            self.health.policy_failed(problem, raised=result.error is not None, now=now)
            return
        lag = int(p.step[0]) - result.obs_step  # steps that ran since the observation: the chunk's delay
        chunk = ActionChunk(torch.from_numpy(result.actions), torch.tensor([result.obs_step]))
        merged = bool(p.receive(chunk, ONE)[0])
        if self.latency_log is not None:
            self.latency_log.write(latency, episode=request.episode, request=request.index, request_id=result.request_id,
                                   obs_step=result.obs_step, lag_steps=lag, merged=merged,
                                   compute_s=round(result.compute_s, 6))  # fmt: skip
        if not merged:
            self.diagnostics.count("dropped_chunks")  # planned before a hold or a new episode: stale by definition
            return
        self.seam_obs_arrival, self.health.policy_error = request.obs_arrival, None
        # The chunk's first action: lead_steps after the step past this tick's. The committed prefix (and the lead,
        # which the controller runs from the previous trajectory) is behind it.
        self._seam_step = int(p.step[0]) + p.lead_steps
        actions, queued = p.executor.plan()  # from the seam step on
        if int(queued[0]):  # a chunk that came a whole chunk late leaves nothing to run: the robot runs out, holds
            self.merged_plan = (self._seam_step, actions[0, : int(queued[0])].numpy().astype(np.float64))
        self.diagnostics.count("chunks")
        self.diagnostics.latencies_ms.append(latency * 1e3)
        if p.width and lag + p.lead_steps > p.width:
            self.diagnostics.count("delay_clamped")  # the policy is told the widest delay it reads instead
        self.publish_chunk(request.report(result, int(p.step[0]), lag, self.config.chunking.merge, self.config.dry_run))

    def _send_mid(self) -> None:
        """The mid-inference observation of the request in flight: the freshest inputs, or, when they are
        rejected right now, the request's own observation, said to be of its step."""
        observation, p = self.inputs.observation(), self.protocol
        if observation is not None:
            mid = p.mid_observation(observation, ONE)
        else:
            mid = mid_observation(self.in_flight.observation, p.spec.mid_cameras, np.zeros(1, dtype=np.int64))
        self.worker.send_mid(worker.MidObservation(self.in_flight.request_id, mid))

    def _request(self, now: float) -> None:
        """Open and submit the next request, when the inputs are good (never blocks)."""
        p, observation = self.protocol, self.inputs.observation()
        if observation is None:
            return
        p.open(ONE)
        request = {**observation, **{k: v.numpy() for k, v in p.augmentation.items()}}
        asked = bool(p.take_asked()[0])  # a latency-aware request whose mid point is later waits for it
        if asked and p.mid_fraction is not None:
            request.update(p.mid_observation(observation, ONE))
        guidance = tuple(g.numpy() for g in p.guidance) if p.sends_guidance else None
        noise = None
        if self.config.noise_seed >= 0:  # keyed as `vla-rl eval --noise_seed` keys the same request in simulation
            shape = self.policy_info.get("noise_shape") or (p.spec.horizon, len(self.config.action_names))
            noise = request_noise(self.config.noise_seed, self.episode, self.episode_requests, *shape).numpy()
        self._request_id += 1
        self.worker.submit(worker.InferenceRequest(self._request_id, request, int(p.step[0]), guidance,
                                                   needs_mid=not asked, noise=noise))  # fmt: skip
        self.in_flight = worker.InFlightRequest(
            self._request_id, sent=now, delay_steps=int(p.announced[0]), obs_stamp=self.inputs.state_time,
            obs_arrival=self.inputs.state_arrival, guided=guidance is not None,
            instruction=self.inputs.instruction, observation=observation, episode=self.episode,
            index=self.episode_requests,
        )  # fmt: skip
        self.episode_requests += 1
