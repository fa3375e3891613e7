"""A policy server: the inference worker on another machine (the one with the GPU), over gRPC.

`vla-rl policy-server --checkpoint=DIR --address=0.0.0.0:50051` loads the policy and answers one robot
at a time; `vla-rl serve --inference=remote --inference_server=HOST:50051` talks to it through
`RemoteInferenceWorker`, which has the local worker's interface (``submit``, ``send_mid``, ``poll``,
``busy``), so the node and the latency protocol are the same either way. A session is one
bidirectional gRPC stream carrying the worker's own messages (`robot_bridge.wire`); the server runs
the local worker's loop (`robot_bridge.inference.serve_requests`) on it, so a policy behaves alike
in both places.

Why gRPC: LeRobot's asynchronous inference (its policy server and robot client) is built on it, so it
is what a robot engineer expects to open a port for; a stream per robot keeps the request, the
mid-inference observation and the answer in order, and its connection state tells the robot at once
that the server is gone. ROS 2 itself would need message types of our own (no pip wheel generates
them) and DDS discovery across machines; Ray Serve would put a cluster on the robot PC.

Latency: the robot times each request from its submission to the answer's arrival on its own clock
(the server's clock is another machine's), so the measured latency, which the latency protocol
announces and the latency log records, is network plus inference; the answer's ``compute_s`` is the
server's share. When the server disappears the request in flight fails, the worker reports the
server unreachable once (the node holds, naming it) and reconnects every ``retry_s``; the server's
"ready" on reconnection resumes the node.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from robot_bridge import wire
from robot_bridge.config import steering_flags_without_steering
from robot_bridge.inference import InferenceRequest, InferenceResult, MidObservation, WorkerStatus, serve_requests
from vla_core.types import SteerMode

SERVICE, METHOD = "vla_rl.PolicyServer", "Session"
SESSION = f"/{SERVICE}/{METHOD}"
_END = object()  # the end of a session's answers


@dataclass
class PolicyServerConfig:
    """Serve a policy checkpoint to one robot at a time (`vla-rl serve --inference=remote`) over gRPC."""

    checkpoint: str = "outputs/quickstart/train"  # checkpoint dir (or a training output dir) to load
    tokenizer_dir: str = ""  # a LeRobot VLA's tokenizer, in a local folder (as `vla-rl serve --tokenizer_dir`)
    device: str = "cpu"  # torch device of the policy
    steer_dir: str = ""  # steering (RL² or DSRL) composed with the policy (as `vla-rl serve --steer_dir`); "" = none
    steer_mode: SteerMode = "gated"  # gated (where its failure predictor expects a failure) or always
    steer_weight: float = 0.0  # 0: the weight `vla-rl steer` chose
    steer_best_of: int = 0  # RL²'s best-of-N candidates in a steered chunk; 0: the N `vla-rl steer` chose
    address: str = "0.0.0.0:50051"  # host:port to listen on (port 0: any free port, printed at start)
    num_threads: int = 1  # torch CPU threads of the policy
    added_latency_s: float = 0.0  # seconds added to every answer: a slow model's latency on a fast machine
    load_retry_s: float = 5.0  # a checkpoint that fails to load is tried again after this long

    def validate(self) -> None:
        """Raise ValueError naming the fix for flags that would be ignored."""
        if steering_flags_without_steering(self):
            raise ValueError("--steer_mode, --steer_weight and --steer_best_of steer nothing without --steer_dir (a "
                             "`vla-rl steer` output's steering/ folder): set it, or drop them")  # fmt: skip


class _SessionConnection:
    """`serve_requests`' end of a pipe over one gRPC session: decoded messages in (None when the robot is gone),
    encoded answers out."""

    def __init__(self, incoming: queue.Queue, outgoing: queue.Queue):
        self.incoming, self.outgoing = incoming, outgoing
        self._next: Any = _END  # a message `poll` took out of the queue before `recv` asked for it

    def send(self, message: Any) -> None:
        self.outgoing.put(wire.encode(message))

    def poll(self, timeout: float = 0.0) -> bool:
        if self._next is not _END:
            return True
        try:
            self._next = self.incoming.get(timeout=timeout)
        except queue.Empty:
            return False
        return True

    def recv(self) -> Any:
        if self._next is not _END:
            message, self._next = self._next, _END
            return message
        return self.incoming.get()


class PolicyServer:
    """The policy behind a gRPC port, one robot at a time (a second is refused while one is connected).

    ``load_policy`` is called once, at the first session (a failure is reported to that robot and retried);
    every session after it reuses the loaded policy.
    """

    def __init__(self, load_policy: Callable[[], Any], cfg: PolicyServerConfig):
        import grpc

        self.cfg = cfg
        self._load, self._policy, self._load_lock = load_policy, None, threading.Lock()
        self._robot = threading.Lock()  # held for the length of a session
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.stream_stream_rpc_method_handler(self._session)  # bytes in, bytes out
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
        self.port = self.server.add_insecure_port(cfg.address)
        if self.port == 0:
            raise ValueError(f"cannot listen on {cfg.address}: pass a free host:port as --address")

    def start(self) -> None:
        self.server.start()

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait()

    def _policy_once(self):
        with self._load_lock:
            if self._policy is None:
                self._policy = self._load()
            return self._policy

    def _session(self, requests: Iterator[bytes], context) -> Iterator[bytes]:
        import grpc

        if not self._robot.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this policy server serves another robot; start another")
        incoming, outgoing = queue.Queue(), queue.Queue()

        def read() -> None:
            try:
                for data in requests:
                    incoming.put(wire.decode(data))
            except (grpc.RpcError, ValueError):
                pass
            incoming.put(None)  # the robot is gone: the worker loop returns

        def work() -> None:
            cfg = self.cfg
            serve_requests(_SessionConnection(incoming, outgoing), self._policy_once, cpu=-1, num_threads=cfg.num_threads,
                           nice=0, load_retry_s=cfg.load_retry_s, added_latency_s=cfg.added_latency_s)  # fmt: skip
            outgoing.put(_END)

        worker = threading.Thread(target=work, name="policy-server-work", daemon=True)
        threading.Thread(target=read, name="policy-server-read", daemon=True).start()
        worker.start()
        try:
            while context.is_active():
                try:
                    answer = outgoing.get(timeout=0.5)
                except queue.Empty:
                    continue
                if answer is _END:
                    return
                yield answer
        finally:
            incoming.put(None)
            # The policy is free only once this session's inference has returned: a robot reconnecting meanwhile
            # must not run a second one on it (a sampler patched for one call is not thread-safe).
            worker.join()
            self._robot.release()


class RemoteInferenceWorker:
    """`robot_bridge.inference.InferenceWorker`'s interface with the policy on a `PolicyServer` at ``address``
    (host:port). ``submit`` and ``poll`` never block; a thread keeps the session, reconnecting every
    ``retry_s`` while the server is unreachable."""

    mode = "remote"

    def __init__(self, address: str, retry_s: float = 5.0):
        self.address, self.retry_s = address, retry_s
        self.busy = False  # a request is in flight
        self.io_error = ""  # InferenceWorker's interface: a server that stops answering is retried, not an error
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue | None = None  # the live session's, None while disconnected
        self._in_flight: tuple[int, int] | None = None  # (request_id, obs_step) of the request in flight
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_session, name="vla-rl-remote-inference", daemon=True)
        self._thread.start()

    def submit(self, request: InferenceRequest) -> None:
        """Send one request; only one may be in flight. Unconnected, it fails at once (the node holds)."""
        if self.busy:
            raise RuntimeError("an inference request is already in flight; wait for its result")
        with self._lock:
            self.busy, self._in_flight, outbox = True, (request.request_id, request.obs_step), self._outbox
        if outbox is None:
            self._fail_in_flight("not connected")
        else:
            outbox.put(wire.encode(request))

    def send_mid(self, mid: MidObservation) -> None:
        """The mid-inference observation of the request in flight."""
        outbox = self._outbox
        if outbox is not None:
            outbox.put(wire.encode(mid))

    def poll(self) -> list[WorkerStatus | InferenceResult]:
        """Everything that arrived since the last call, without waiting."""
        messages = []
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return messages
            if isinstance(message, InferenceResult):
                with self._lock:
                    if self._in_flight is not None and self._in_flight[0] == message.request_id:
                        self.busy, self._in_flight = False, None
            messages.append(message)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        outbox = self._outbox
        if outbox is not None:
            outbox.put(None)
        self._thread.join(timeout)

    # -- the session ------------------------------------------------------------------------------

    def _keep_session(self) -> None:
        import grpc

        reported = ""  # the outage already reported: one failed status per outage, not one per attempt
        while not self._stop.is_set():
            outbox: queue.Queue = queue.Queue()
            channel = grpc.insecure_channel(self.address)
            session = channel.stream_stream(SESSION)
            with self._lock:
                self._outbox = outbox
            try:
                for data in session(_until_none(outbox)):
                    reported = ""  # connected: the next outage is reported again
                    self._receive(wire.decode(data))
                error = "the server ended the session"
            except grpc.RpcError as err:
                error = f"{err.code().name}: {err.details()}"
            except ValueError as err:  # an answer that is not one of ours: another service on that port
                error = str(err)
            with self._lock:
                self._outbox = None
            outbox.put(None)  # ends gRPC's thread reading this session's requests, which would wait for ever
            channel.close()
            if self._stop.is_set():
                return
            self._fail_in_flight(error)
            if not reported:
                reported = error
                self._inbox.put(WorkerStatus("failed", error=(
                    f"policy server at {self.address} unreachable ({error}); start `vla-rl policy-server` there or "
                    "fix inference_server"
                )))  # fmt: skip
            self._stop.wait(self.retry_s)

    def _receive(self, message: Any) -> None:
        if isinstance(message, InferenceResult):
            # The robot's clock, not the server's (another machine's): the latency is network plus inference.
            message = dataclasses.replace(message, finished=time.monotonic())
        self._inbox.put(message)

    def _fail_in_flight(self, error: str) -> None:
        """The request in flight will not be answered: its result is an error, so the node holds and asks again."""
        with self._lock:
            in_flight = self._in_flight
        if in_flight is not None:
            self._inbox.put(InferenceResult(in_flight[0], in_flight[1], 0.0, error=f"the policy server at "
                                            f"{self.address} did not answer ({error})", finished=time.monotonic()))  # fmt: skip


def _until_none(outbox: queue.Queue) -> Iterator[bytes]:
    """A session's requests: what the robot puts in ``outbox`` until it puts None."""
    while True:
        item = outbox.get()
        if item is None:
            return
        yield item


def run_policy_server(cfg: PolicyServerConfig, load_policy: Callable[[], Any]) -> None:
    """Serve until Ctrl-C; prints the address it listens on."""
    cfg.validate()
    server = PolicyServer(load_policy, cfg)
    server.start()
    host = cfg.address.rsplit(":", 1)[0]
    print(f"policy server for {cfg.checkpoint} listening on {host}:{server.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
