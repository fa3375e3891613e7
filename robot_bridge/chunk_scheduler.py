"""The robot's shell around the latency model: ask the inference worker for chunks and merge them.

After each control tick (off the latency path) the node calls :meth:`ChunkScheduler.prepare_next_action`,
which runs the steps of `vla_core.runtime.ChunkSchedule` in the order the simulation's delay shell
(`vla_core.runtime.delayed_env.DelayedChunkEnv`) runs them: merge any chunk that came back, ask for the next one when
due (every ``chunking.execute_steps`` steps, one request in flight at a time), and take the next
step's action from `vla_core.runtime.ActionChunkExecutor`. A request announces the measured delay
estimate (the largest lag of the last ``delay_estimate_window`` chunks) and carries its delay
augmentation and, with the ``rtc`` merge and a flow policy, RTC guidance. A chunk takes effect from
the step after the tick that found it. Entering a hold discards the queued plan and any chunk still
in flight. Every measured inference latency is written to ``latency_log`` (JSON lines, with the
control period), which ``--delay.kind=histogram`` replays in simulation. No ROS import here.

A latency-aware policy (``mid_inference: true``) also gets a mid-inference observation, as in
simulation (`vla_core.runtime.delayed_env.DelayedChunkEnv`): a request at step t announcing delay d is submitted at
once, and m = floor(mid_fraction * d) ticks later the node sends the worker the freshest joint
state and images as ``observation.mid.*`` (with m = 0, the request's own, at once); the worker runs
the policy on both, so its chunk is found at tick t + m + 1 at the earliest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from robot_bridge.config import ServeConfig
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.inference import (
    InferenceRequest,
    InferenceResult,
    InferenceWorker,
    MidObservation,
    WorkerStatus,
    chunk_problem,
)
from robot_bridge.inputs import JOINT_STATES, BridgeInputs
from robot_bridge.log_limit import LogLimiter
from vla_core.runtime import ActionChunkExecutor, ChunkSchedule, LatencyLog, mid_inference_steps, mid_observation
from vla_core.types import ActionChunk, Policy


@dataclass
class InFlightRequest:
    """The one chunk request the worker is computing, and what its result is checked and reported against."""

    request_id: int
    sent: float  # monotonic time it was submitted
    epoch: int  # hold epoch it was made in; a result from an older epoch planned before a hold: dropped
    delay_steps: int  # the delay d announced to the policy (the measured estimate)
    obs_stamp: float  # header stamp of the joint state it was conditioned on, seconds
    obs_arrival: float  # monotonic arrival of that joint state
    guided: bool  # it carries RTC guidance toward the queued actions
    instruction: str


class ChunkScheduler:
    """The inference worker, the in-flight request, and the `ActionChunkExecutor` its chunks merge into.

    ``publish_chunk`` receives each merged chunk's metadata; ``logger`` has rclpy's ``info``/``error``.
    """

    def __init__(
        self,
        config: ServeConfig,
        load_policy: Callable[[], Policy],
        inputs: BridgeInputs,
        diagnostics: BridgeDiagnostics,
        log_limiter: LogLimiter,
        logger,
        publish_chunk: Callable[[dict[str, Any]], None],
    ) -> None:
        self.config, self.inputs, self.diagnostics = config, inputs, diagnostics
        self.log_limiter, self.logger, self.publish_chunk = log_limiter, logger, publish_chunk
        self.executor: ActionChunkExecutor | None = None  # built once the policy tells its horizon
        self.schedule: ChunkSchedule | None = None  # drives the executor; built with it
        self.max_delay_steps = 0  # D_max of the delay augmentation: the policy's max_delay_steps
        self.latency_aware = False  # the policy reads a mid-inference observation
        # The request waiting for its mid-inference observation: (request id, step to send it at, request step)
        self.pending_mid: tuple[int, int, int] | None = None
        self._request_observation: dict[str, Any] | None = None  # its observation, if no fresher one comes
        self.latency_log = LatencyLog(config.latency_log, 1.0 / config.control_hz) if config.latency_log else None
        self.policy_info: dict[str, Any] = {}
        self.execute_steps = 0  # steps per chunk, chunking.execute_steps or the policy's, once it is loaded
        self.worker_state = "loading"  # loading, ready or failed
        self.worker_error: str | None = None
        self.policy_error: str | None = None  # the last chunk request raised or returned an unusable chunk
        self.policy_error_kind = ""  # policy_raised or invalid_chunk
        self._retry_at = 0.0
        self.in_flight: InFlightRequest | None = None
        self._request_id = 0
        self._epoch = 0  # bumped by every hold
        self._holding = False
        self._merged = False  # a chunk was merged since the last action was prepared
        self.seam_obs_arrival = 0.0  # arrival of the joint state the newest merged chunk was conditioned on
        # The action prepared for the next tick: (A,) or None (nothing queued), its executor step,
        # and whether it is the first from a newly merged chunk.
        self.next_target: np.ndarray | None = None
        self.next_step = -1
        self.next_is_seam = False
        cfg = config
        self.worker = InferenceWorker(
            load_policy, mode=cfg.inference, cpu=cfg.inference_cpu, num_threads=cfg.inference_threads,
            nice=cfg.inference_nice, load_retry_s=cfg.load_retry_s, added_latency_s=cfg.added_latency_s,
        )  # fmt: skip

    def worker_problem(self) -> tuple[str, str] | None:
        """(key, text) while the policy is loading, failed to load or its worker died; else None."""
        if self.worker_state != "ready":
            return f"worker {self.worker_state}", self.worker_error or "loading the policy"
        if not self.worker.alive():
            self.worker_state, self.worker_error = "failed", "the inference worker died; restart the node"
            self.logger.error(self.worker_error)
            return "worker died", self.worker_error
        return None

    def policy_problem(self) -> tuple[str, str] | None:
        """(key, text) after the policy raised or returned an unusable chunk, until its next good chunk."""
        return None if self.policy_error is None else (f"policy {self.policy_error_kind}", self.policy_error)

    def queue_depth(self) -> int:
        return int(self.executor.queue_length()[0]) if self.executor is not None else 0

    def prepare_next_action(self, cause: str | None, now: float) -> None:
        """Merge returned chunks, request the next one when due, and take the next step's action.

        cause: why this tick held (None: it did not).
        """
        self._poll(now)
        ex = self.executor
        self.next_target, self.next_step, self.next_is_seam = None, -1, False
        if ex is None:
            return
        if cause is not None and not self._holding:
            ex.discard_queue()
            self._epoch += 1
        self._holding = cause is not None
        self._maybe_send_mid()
        self._maybe_request(cause, now)
        self.next_step = int(ex.step[0])
        action, valid = ex.next_action()  # also while holding: the step counter keeps time
        if bool(valid[0]) and not self._holding:
            self.next_target = action[0].numpy()
            self.next_is_seam = self._merged
            self._merged = False

    @property
    def delay_steps(self) -> int:
        """The delay the next request announces: the measured estimate, in control steps."""
        return int(self.schedule.estimated_delay()[0]) if self.schedule is not None else 0

    def close(self) -> None:
        self.worker.close()
        if self.latency_log is not None:
            self.latency_log.close()

    # -- results ---------------------------------------------------------------------------------

    def _poll(self, now: float) -> None:
        for message in self.worker.poll():
            if isinstance(message, WorkerStatus):
                self._on_worker_status(message)
            elif self.in_flight is not None and message.request_id == self.in_flight.request_id:
                request, self.in_flight = self.in_flight, None
                self._on_result(message, request, now)

    def _on_worker_status(self, status: WorkerStatus) -> None:
        if status.state == "failed":
            self.diagnostics.count("load_failures")
            self.worker_state, self.worker_error = "failed", status.error
            self.logger.error(f"{status.error}; retrying in {self.config.load_retry_s:g} s")
        elif status.state == "loading":
            self.worker_state = "loading" if self.worker_state != "failed" else "failed"
        elif status.state == "ready":
            self.policy_info = status.info
            self.inputs.policy_image_size = status.info.get("image_size")
            problem = self._check_policy(status.info)
            if problem:
                self.worker_state, self.worker_error = "failed", problem
                self.logger.error(problem)
                return
            cfg = self.config
            self.max_delay_steps = int(status.info.get("max_delay_steps") or 0)
            self.latency_aware = bool(status.info.get("latency_aware"))
            reads = max(
                self.max_delay_steps, int(status.info.get("latency_max_delay") or 0) if self.latency_aware else 0
            )
            self.executor = ActionChunkExecutor(
                1, len(cfg.action_names), cfg.horizon or status.info["horizon"], merge=cfg.chunking.merge,
                ensemble_coeff=cfg.chunking.ensemble_coeff, max_delay=reads,
            )  # fmt: skip
            self.schedule = ChunkSchedule(
                self.executor, self.execute_steps, estimate="measured", window=cfg.delay_estimate_window
            )
            self.worker_state, self.worker_error = "ready", None
            self.logger.info(f"policy ready: {status.info}")

    def _check_policy(self, info: dict[str, Any]) -> str | None:
        """A one-line config error when the loaded policy does not fit the config, else None.

        Sets ``execute_steps`` when the policy fits.
        """
        cfg = self.config
        if info.get("state_dim") not in (None, len(cfg.state_names)):
            return f"the policy expects {info['state_dim']} state values but state_names lists {len(cfg.state_names)}"
        if info.get("action_dim") not in (None, len(cfg.action_names)):
            return f"the policy outputs {info['action_dim']} action dims but action_names lists {len(cfg.action_names)}"
        horizon = cfg.horizon or info.get("horizon")
        if not horizon:
            return "the policy does not tell its chunk length; set horizon in the serve config"
        try:
            self.execute_steps = cfg.chunking.steps_per_chunk(info.get("n_action_steps"), horizon)
        except ValueError as err:
            return str(err)
        if info.get("latency_aware"):
            if not cfg.mid_inference:
                return (
                    "this checkpoint is latency-aware: it reads a mid-inference observation; set mid_inference: true "
                    "in the serve config (the node then sends the freshest joint state and images part-way through "
                    "each inference)"
                )
            if cfg.chunking.merge != "latest":
                return "a latency-aware checkpoint acts with latest-only merging (as it was fine-tuned); set chunking.merge: latest"
            tuned = int(info.get("latency_max_delay") or 0)
            if cfg.max_delay_steps > tuned:
                return (
                    f"this robot's delays reach max_delay_steps={cfg.max_delay_steps} control steps but the latency-aware "
                    f"policy was fine-tuned for delays up to {tuned}; fine-tune it at {cfg.max_delay_steps} or serve faster"
                )
        trained = int(info.get("max_delay_steps") or 0)
        if trained and cfg.max_delay_steps > trained:
            return (
                f"this robot's delays reach max_delay_steps={cfg.max_delay_steps} control steps but the policy was "
                f"trained for delays up to {trained}; retrain with --delay.kind=uniform --delay.high={cfg.max_delay_steps} or serve faster"
            )
        return None

    def _on_result(self, result: InferenceResult, request: InFlightRequest, now: float) -> None:
        # From the submission to the worker's answer: the inference's own latency, not rounded to the
        # tick that found it (the simulation rounds it up to steps when it replays the log).
        latency = result.finished - request.sent
        ex, everyone = self.executor, torch.ones(1, dtype=torch.bool)
        if result.error is not None:
            self.schedule.abandon(everyone)
            self._policy_failed(result.error, "policy_raised", now)
            return
        actions = result.actions
        problem = chunk_problem(actions, ex.horizon, self.config.action_names)
        if problem is not None:  # never merged: a NaN or misshapen plan must not reach the safety filter
            self.schedule.abandon(everyone)
            self._policy_failed(problem, "invalid_chunk", now)
            return
        # Steps that ran between the observation and now: the chunk's delay, in the steps the delay
        # augmentation counts (the sim's d); a merged chunk's lag feeds the measured delay estimate.
        lag = int(ex.step[0]) - result.obs_step
        if self.latency_log is not None:
            self.latency_log.write(latency, request_id=result.request_id, lag_steps=lag)
        if request.epoch != self._epoch:
            self.schedule.abandon(everyone)
            self.diagnostics.count("dropped_chunks")  # planned before a hold: stale by definition
            return
        self.schedule.receive(ActionChunk(torch.from_numpy(actions), torch.tensor([result.obs_step])), everyone)
        self._merged = True
        self.seam_obs_arrival = request.obs_arrival
        self.policy_error = None
        self.diagnostics.count("chunks")
        self.diagnostics.latencies_ms.append(latency * 1e3)
        if self.executor.max_delay and lag > self.executor.max_delay:
            self.diagnostics.count("delay_clamped")  # the policy is told its largest trained delay instead
        self.publish_chunk({
            "chunk_id": result.request_id, "obs_stamp": request.obs_stamp, "obs_step": result.obs_step,
            "merged_at_step": int(ex.step[0]), "lag_steps": lag, "inference_latency_ms": round(latency * 1e3, 3),
            "compute_ms": round(result.compute_s * 1e3, 3), "delay_steps": request.delay_steps,
            "horizon": int(actions.shape[1]), "merge": self.config.chunking.merge, "guided": request.guided,
            "instruction": request.instruction, "dry_run": self.config.dry_run,
        })  # fmt: skip

    def _policy_failed(self, error: str, kind: str, now: float) -> None:
        """Hold on a policy that raised (kind policy_raised) or returned an unusable chunk (invalid_chunk);
        ask again after ``error_retry_s``."""
        self.diagnostics.count("policy_errors" if kind == "policy_raised" else "invalid_chunks")
        self._retry_at = now + self.config.error_retry_s
        retry = f"; holding, asking again in {self.config.error_retry_s:g} s"
        self.log_limiter(f"policy {kind}", "error", error + retry)
        self.policy_error, self.policy_error_kind = error, kind
        self.diagnostics.last_error = error

    # -- requests --------------------------------------------------------------------------------

    def _maybe_request(self, cause: str | None, now: float) -> None:
        """Ask for the next chunk when one is due and the inputs are good (never blocks).

        A hold for a policy error still asks (after ``error_retry_s``): only a good chunk clears it.
        """
        ex, schedule = self.executor, self.schedule
        if ex is None or self.worker.busy or self.in_flight is not None:
            return
        if cause is not None and cause != self.policy_error:
            return
        if not bool(schedule.due()[0]) or (self.policy_error is not None and now < self._retry_at):
            return
        observation = self.inputs.observation()
        if observation is None:
            return
        step = int(ex.step[0])
        everyone = torch.ones(1, dtype=torch.bool)
        request = schedule.request(everyone)
        observation.update({k: v.numpy() for k, v in request.augmentation.items()})
        needs_mid = False
        if self.latency_aware:
            mid_steps = int(mid_inference_steps(request.delay_steps, self.policy_info.get("mid_fraction", 0.5))[0])
            if mid_steps == 0:  # the mid point is the request itself
                observation.update(self._mid_observation(observation, 0))
            else:
                needs_mid = True
                self.pending_mid = (self._request_id + 1, step + mid_steps, step)
                self._request_observation = observation
        guidance = None
        if request.guidance is not None and self.policy_info.get("supports_inpainting"):
            guidance = tuple(g.numpy() for g in request.guidance)
        self._request_id += 1
        self.worker.submit(InferenceRequest(self._request_id, observation, step, guidance, needs_mid=needs_mid))
        self.in_flight = InFlightRequest(
            self._request_id, sent=now, epoch=self._epoch, delay_steps=int(request.delay_steps[0]),
            obs_stamp=self.inputs.stamp.get(JOINT_STATES, 0.0), obs_arrival=self.inputs.arrival[JOINT_STATES],
            guided=guidance is not None, instruction=self.inputs.instruction,
        )  # fmt: skip

    def _mid_observation(self, observation: dict[str, Any], steps: int) -> dict[str, Any]:
        """``observation.mid.*`` from an observation batch of one: its state, the policy's mid cameras."""
        return mid_observation(observation, self.policy_info.get("mid_cameras", []), np.array([steps], dtype=np.int64))

    def _maybe_send_mid(self) -> None:
        """Send the request in flight its mid-inference observation once its step has come: the freshest
        inputs (the request's own if they are rejected right now). Sent while holding too: the worker
        waits for it, and a chunk planned before a hold is dropped anyway."""
        if self.pending_mid is None or self.executor is None:
            return
        request_id, at, requested = self.pending_mid
        step = int(self.executor.step[0])
        if step < at:
            return
        observation = self.inputs.observation()
        steps = step - requested
        if observation is None:  # rejected right now: the request's own observation, said to be of its step
            observation, steps = self._request_observation, 0
        self.worker.send_mid(MidObservation(request_id, self._mid_observation(observation, steps)))
        self.pending_mid, self._request_observation = None, None
