"""Asynchronous inference: the policy runs in its own process (or thread) so the control loop never waits.

The control loop sends one request at a time (``submit``) and collects what came back with
``poll``; neither blocks: a sender and a receiver thread move the messages through the pipe, and
``poll`` takes only whole ones. In ``"process"`` mode the worker is a spawned process pinned to its
own core with one torch thread and a higher niceness: inference saturating its core cannot delay
the control loop through the CPU or Python's GIL. The worker loads the policy itself (through the
``load_policy`` callable), so a checkpoint that fails to load is a status message, retried after
``load_retry_s``, while the node keeps running.

Messages from the worker are ``WorkerStatus`` (loading / ready / failed) and ``InferenceResult``.
Observations travel as numpy: images (1, H, W, 3) uint8, the rest float or long arrays, ``task``
a list of strings. A latency-aware policy's request says ``needs_mid``: the worker then waits for
the request's ``MidObservation`` (``observation.mid.*``, sent by the node part-way through the
inference window) and runs the policy on both.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from robot_bridge.scheduling import normal_scheduling, use_normal
from vla_core.lifetime import exit_with_parent
from vla_core.runtime.noise import noise_shape
from vla_core.runtime.protocol import LatencySpec
from vla_core.types import OBS_IMAGES, OBS_MID, TASK, LatencyAwarePolicy, Policy


@dataclass
class InferenceRequest:
    request_id: int
    observation: dict[str, Any]  # numpy batch of one; images (1, H, W, 3) uint8
    obs_step: int  # executor step the chunk is conditioned on
    guidance: tuple[np.ndarray, np.ndarray] | None = None  # RTC target (1, H, A) and weights (1, H)
    needs_mid: bool = False  # wait for this request's MidObservation before running the policy
    noise: np.ndarray | None = None  # (1, H, A) float32 sampler start (serve's noise_seed); None: the policy draws it


@dataclass
class MidObservation:
    request_id: int
    observation: dict[str, Any]  # observation.mid.state (1, S), .steps (1,), .images.<cam> (1, H, W, 3) uint8


@dataclass
class InferenceResult:
    request_id: int
    obs_step: int
    compute_s: float  # time inside the worker, observation conversion included
    actions: np.ndarray | None = None  # (1, H, A) float32, None when the policy raised
    error: str | None = None
    finished: float = 0.0  # time.monotonic() when the worker sent it (one clock across processes on Linux)


@dataclass
class WorkerStatus:
    state: str  # "loading", "ready" or "failed"
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # when ready: horizon, n_action_steps, image_size, ...


@dataclass
class InFlightRequest:
    """The node's record of the request the worker is computing, and what its result is reported against."""

    request_id: int
    sent: float  # monotonic time it was submitted
    delay_steps: int  # the delay announced to the policy (the measured estimate)
    obs_stamp: float  # header stamp of the joint state it was conditioned on, seconds
    obs_arrival: float  # monotonic arrival of that joint state
    guided: bool  # it carries RTC guidance toward the queued actions
    instruction: str
    observation: dict[str, Any]  # its observation (numpy), the mid observation's fallback
    episode: int = 0  # the robot's episode it was made in (0 without topics.episode)
    index: int = 0  # its index among that episode's requests, from 0

    def report(self, result: InferenceResult, merged_at_step: int, lag: int, merge: str, dry_run: bool) -> dict:
        """The metadata of its merged chunk, as the node publishes it (JSON on the chunk-info topic)."""
        latency = result.finished - self.sent
        return {
            "chunk_id": result.request_id, "obs_stamp": self.obs_stamp, "obs_step": result.obs_step,
            "merged_at_step": merged_at_step, "lag_steps": lag, "inference_latency_ms": round(latency * 1e3, 3),
            "compute_ms": round(result.compute_s * 1e3, 3), "delay_steps": self.delay_steps,
            "horizon": int(result.actions.shape[1]), "merge": merge, "guided": self.guided,
            "instruction": self.instruction, "dry_run": dry_run,
        }  # fmt: skip


def chunk_problem(actions: np.ndarray | None, horizon: int, action_names: list[str]) -> str | None:
    """Why a policy's chunk cannot be executed (wrong shape, non-finite values), or None when it can.

    actions must be (1, h, A) with 1 <= h <= horizon and A = len(action_names), all finite. The
    node holds instead of merging such a chunk: NaN would poison the ensemble or RTC blend of every
    later chunk, and a misshapen one means the checkpoint does not fit the serve config.
    """
    a = len(action_names)
    if actions is None or actions.ndim != 3 or actions.shape[0] != 1 or actions.shape[2] != a \
            or not 1 <= actions.shape[1] <= horizon:  # fmt: skip
        shape = None if actions is None else tuple(actions.shape)
        return (
            f"policy returned a chunk of shape {shape}, expected (1, 1..{horizon}, {a}) for action_names "
            f"{action_names}; serve a checkpoint whose action_dim and horizon match the serve config"
        )
    bad = ~np.isfinite(actions[0])
    if bad.any():
        step, dim = (int(i[0]) for i in np.nonzero(bad))
        return (
            f"policy returned a chunk with {int(bad.sum())} non-finite (NaN/inf) values of {bad.size}, the first at "
            f"step {step}, {action_names[dim]}; check the checkpoint's weights and normalization statistics"
        )
    return None


def to_policy_batch(observation: dict[str, Any]):
    """numpy batch -> torch batch: images (1, H, W, 3) uint8 -> (1, 3, H, W) float in [0, 1]."""
    import torch

    batch: dict[str, Any] = {}
    for key, value in observation.items():
        if key == TASK:
            batch[key] = list(value)
        elif key.startswith((OBS_IMAGES + ".", OBS_MID + ".images.")):
            batch[key] = torch.from_numpy(value).permute(0, 3, 1, 2).float().div_(255.0)
        else:
            batch[key] = torch.from_numpy(np.asarray(value))
    return batch


def policy_info(policy: Policy) -> dict[str, Any]:
    """What the node needs to know about a loaded policy before its first request: its input sizes and how
    it meets the latency model (`LatencySpec`'s fields: horizon, n_action_steps, the delay augmentation it
    reads, whether it is latency-aware, its mid-inference observation, whether it takes RTC guidance)."""
    config = getattr(policy, "config", None)
    return {
        "image_size": getattr(config, "image_size", None),
        "state_dim": getattr(config, "state_dim", None),
        "action_dim": getattr(config, "action_dim", None),
        **LatencySpec.of(policy).as_dict(),
        "splits_inference": isinstance(policy, LatencyAwarePolicy),  # has prepare_request (the slow part)
        "noise_shape": noise_shape(policy),  # one sample's sampler noise, which serve's noise_seed draws
    }


def serve_requests(
    conn: Connection,
    load_policy: Callable[[], Policy],
    cpu: int,
    num_threads: int,
    nice: int,
    load_retry_s: float,
    added_latency_s: float = 0.0,
    parent_pid: int = 0,
) -> None:
    """Worker body: load the policy (retrying), then answer requests until a ``None`` request arrives.
    parent_pid: in a worker process, the node's: the worker ends with it, even if it is killed (0: a thread).
    added_latency_s: an artificial inference delay, a slow model's on a fast machine: slept before each answer,
    or, for a request that waits for its mid-inference observation, in its slow part, before that wait."""
    if parent_pid:
        exit_with_parent(parent_pid)
    # A thread started from the real-time control thread inherits its SCHED_FIFO (a process is
    # started without it); inference must never preempt control, so it goes back to normal first.
    use_normal()
    import torch

    if cpu >= 0 and hasattr(os, "sched_setaffinity"):
        # pid 0 is the calling thread, so in thread mode only the inference thread is pinned.
        os.sched_setaffinity(0, {cpu % (os.cpu_count() or 1)})
    if nice > 0:
        os.nice(nice)
    torch.set_num_threads(num_threads)
    policy = None
    while policy is None:
        conn.send(WorkerStatus("loading"))
        try:
            policy = load_policy()
        except Exception as err:  # noqa: BLE001 (a bad checkpoint: report and retry, never crash the node)
            conn.send(WorkerStatus("failed", error=f"checkpoint failed to load: {type(err).__name__}: {err}"))
            if conn.poll(load_retry_s) and conn.recv() is None:
                return
    conn.send(WorkerStatus("ready", info=policy_info(policy)))
    while True:
        request: InferenceRequest | None = conn.recv()
        if request is None:
            return
        prepared, slow_s = None, 0.0
        if request.needs_mid:  # the node sends it part-way through the window; older ones are of dropped requests
            # The slow part runs now, on the request's observation (`LatencyAwarePolicy.prepare_request`, the
            # contract of a latency-aware policy); only the fast part waits for the mid-inference observation.
            slow_start = time.perf_counter()
            try:
                with torch.no_grad():
                    prepared = policy.prepare_request(to_policy_batch(request.observation))
            except Exception:  # noqa: BLE001 (a failure here is reported below: the whole request runs again there)
                prepared = None
            # A slow model's time is its slow part's: it runs while the window the mid observation is taken in
            # passes. Slept after the mid observation instead, it came on top of that window, and the delay a
            # latency-aware policy announces grew with it to its fixed point, d = added / ((1 - mid_fraction) dt).
            if added_latency_s > 0:
                time.sleep(added_latency_s)
            slow_s = time.perf_counter() - slow_start
            mid = conn.recv()
            while mid is not None and (not isinstance(mid, MidObservation) or mid.request_id != request.request_id):
                mid = conn.recv()
            if mid is None:
                return
            request.observation = {**request.observation, **mid.observation}
        start = time.perf_counter()
        try:
            # no_grad, not inference_mode: RTC guidance takes a vector-Jacobian product of the flow
            # policy's denoiser, which inference mode forbids even under enable_grad.
            with torch.no_grad():
                batch = to_policy_batch(request.observation)
                obs_step = torch.tensor([request.obs_step])
                given = {} if request.noise is None else {"noise": torch.from_numpy(request.noise)}
                if request.guidance is not None:
                    target, weights = (torch.from_numpy(a) for a in request.guidance)
                    chunk = policy.predict_chunk(batch, obs_step, inpaint=(target, weights), **given)
                elif prepared is not None:
                    chunk = policy.predict_chunk(batch, obs_step, prepared=prepared, **given)
                else:
                    chunk = policy.predict_chunk(batch, obs_step, **given)
                actions = chunk.actions.detach().to("cpu", torch.float32).numpy()
            if added_latency_s > 0 and not request.needs_mid:
                time.sleep(added_latency_s)
            compute_s = slow_s + time.perf_counter() - start  # the slow and fast parts, not the wait between
            conn.send(
                InferenceResult(request.request_id, request.obs_step, compute_s, actions, finished=time.monotonic())
            )
        except Exception as err:  # noqa: BLE001 (a policy that raises: report, keep serving)
            last = traceback.extract_tb(err.__traceback__)[-1]
            message = f"policy raised {type(err).__name__}: {err} ({os.path.basename(last.filename)}:{last.lineno})"
            conn.send(InferenceResult(
                request.request_id, request.obs_step, time.perf_counter() - start, error=message, finished=time.monotonic()
            ))  # fmt: skip


class InferenceWorker:
    """The policy behind a pipe. ``submit``, ``send_mid`` and ``poll`` never block the caller."""

    def __init__(
        self,
        load_policy: Callable[[], Policy],
        mode: str = "process",
        cpu: int = -1,
        num_threads: int = 1,
        nice: int = 10,
        load_retry_s: float = 5.0,
        added_latency_s: float = 0.0,
    ) -> None:
        if mode not in ("process", "thread"):
            raise ValueError(f"inference mode must be process or thread, got {mode!r}")
        self._conn, child = multiprocessing.Pipe()
        # A thread shares the node's process: its niceness would be the control loop's too.
        args = (child, load_policy, cpu, num_threads, nice if mode == "process" else 0, load_retry_s, added_latency_s,
                os.getpid() if mode == "process" else 0)  # fmt: skip
        if mode == "process":
            # spawn, not fork: the parent holds ROS and torch threads that must not be copied mid-flight.
            self._runner = multiprocessing.get_context("spawn").Process(
                target=serve_requests, args=args, name="vla-rl-inference", daemon=True
            )
        else:
            self._runner = threading.Thread(target=serve_requests, args=args, name="vla-rl-inference", daemon=True)
        self.mode = mode
        self.busy = False  # a request is in flight
        # Started from the real-time control thread, a process would import torch at its priority.
        with normal_scheduling() if mode == "process" else nullcontext():
            self._runner.start()
        if mode == "process":
            child.close()  # the worker has its own copy; ours open, the receiver would never read the pipe's end
        self._child = child if mode == "thread" else None  # a worker thread's end, closed at close()
        # Why threads move the messages rather than the caller: a message over 16 KiB (a long chunk's actions, a
        # request with its images) leaves in two writes, its length then its bytes, and a ``recv`` after the first
        # waits for the second. The worker is niced on a loaded core, so that wait is the competing load's time
        # slice (tens of ms); and a message larger than the pipe's buffer waits, when sent, for the worker to read
        # it (it does not while it loads or computes). The control loop would miss its ticks either way.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # whole messages from the worker, for poll
        # Messages to the worker, pickled by the caller (a snapshot: the arrays may change after submit), in order;
        # the last is the pickled None that ends the worker.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.io_error = ""  # why a message could not be moved (the worker then counts as dead: alive() is False)
        self._receiver = threading.Thread(target=self._receive, name="vla-rl-inference-inbox", daemon=True)
        self._sender = threading.Thread(target=self._send, name="vla-rl-inference-outbox", daemon=True)
        self._receiver.start()
        self._sender.start()

    def _receive(self) -> None:
        """Receiver thread: every whole message from the worker into the inbox, until the pipe closes."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                return
            except BaseException as err:  # noqa: BLE001 (a message that does not unpickle: say so, stop taking any)
                self.io_error = f"unreadable message from the inference worker: {type(err).__name__}: {err}"
                return
            self._inbox.put(message)

    def _send(self) -> None:
        """Sender thread: the outbox's pickled messages to the worker, in order (what ``Connection.send`` writes),
        until the last."""
        while True:
            payload, last = self._outbox.get()
            try:
                self._conn.send_bytes(payload)
            except OSError:  # the worker is gone: alive() says so
                return
            if last:
                return

    def _put(self, message: Any, last: bool = False) -> None:
        self._outbox.put((ForkingPickler.dumps(message), last))

    def submit(self, request: InferenceRequest) -> None:
        """Send one request; only one may be in flight."""
        if self.busy:
            raise RuntimeError("an inference request is already in flight; wait for its result")
        self._put(request)
        self.busy = True

    def send_mid(self, mid: MidObservation) -> None:
        """The mid-inference observation of the request in flight."""
        self._put(mid)

    def poll(self) -> list[WorkerStatus | InferenceResult]:
        """Everything the worker sent since the last call, without waiting."""
        messages = []
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return messages
            if isinstance(message, InferenceResult):
                self.busy = False
            messages.append(message)

    def alive(self) -> bool:
        """The worker runs and its messages move (False also after an unreadable message: see ``io_error``)."""
        return self._runner.is_alive() and self._receiver.is_alive() and self._sender.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        self._put(None, last=True)
        self._sender.join(timeout)
        self._runner.join(timeout)
        if isinstance(self._runner, multiprocessing.process.BaseProcess) and self._runner.is_alive():
            self._runner.terminate()
            self._runner.join(timeout)
        if self._child is not None:
            self._child.close()
        # Wake a receiver still reading (a copy of the worker's end may live on in a forked process), then close the
        # pipe only once no thread reads it: a closed descriptor's number can be reused by the next socket opened.
        try:
            wake = socket.socket(fileno=os.dup(self._conn.fileno()))
            wake.shutdown(socket.SHUT_RDWR)
            wake.close()
        except OSError:
            pass
        self._receiver.join(timeout)
        if not self._receiver.is_alive() and not self._sender.is_alive():
            self._conn.close()
