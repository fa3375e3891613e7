"""The inference worker's pipe: ``poll`` never waits on a message the worker has only half written."""

import threading
import time
from functools import partial
from multiprocessing.connection import Connection

import numpy as np
from bridge_policies import IMAGE_SIZE, STEP, ramp_policy

from robot_bridge.inference import InferenceRequest, InferenceResult, InferenceWorker, MidObservation, WorkerStatus
from vla_core.types import TASK, image_key

HORIZON = 2000  # (1, 2000, 4) float32 = 32,000 bytes: over the 16 KiB above which a message leaves in two writes
PAUSE_S = 0.5  # the worker stalls this long between a message's length and its bytes


def test_poll_returns_at_once_while_the_worker_is_between_a_results_two_writes(monkeypatch):
    """A long chunk leaves the worker as two writes (its 4-byte length, then its bytes). Here the worker pauses
    between them, as a niced worker preempted by a training run on its core does. The control loop's ``poll`` must
    come back at once meanwhile (reading the length and then waiting for the bytes blocked it for the whole pause),
    and hand over the whole result once it is written."""
    original_send = Connection._send
    pauses = []

    def send_then_stall_after_a_length(self, buf, write=None):
        original_send(self, buf)
        if threading.current_thread().name == "vla-rl-inference" and len(buf) == 4:
            pauses.append(len(buf))
            time.sleep(PAUSE_S)

    monkeypatch.setattr(Connection, "_send", send_then_stall_after_a_length)
    worker = InferenceWorker(partial(ramp_policy, HORIZON, True), mode="thread")
    try:
        statuses, deadline = [], time.monotonic() + 30
        while not any(s.state == "ready" for s in statuses) and time.monotonic() < deadline:
            statuses += worker.poll()
            time.sleep(0.01)
        assert [s.state for s in statuses] == ["loading", "ready"] and all(
            isinstance(s, WorkerStatus) for s in statuses
        )
        observation = {image_key("front"): np.zeros((1, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8), TASK: [""]}
        worker.submit(InferenceRequest(request_id=7, observation=observation, obs_step=3))
        longest, results, deadline = 0.0, [], time.monotonic() + 30
        while not results and time.monotonic() < deadline:
            start = time.perf_counter()
            results = worker.poll()
            longest = max(longest, time.perf_counter() - start)
            time.sleep(0.001)
    finally:
        worker.close()
    assert pauses, "the result never left in two writes: the test would show nothing"
    assert longest < 0.1 * PAUSE_S, f"poll waited {longest:.3f} s on a half-written message"
    (result,) = results
    assert isinstance(result, InferenceResult) and (result.request_id, result.obs_step) == (7, 3)
    assert result.actions.shape == (1, HORIZON, 4)
    expected = np.zeros((1, HORIZON, 4), np.float32)
    expected[..., 0] = STEP  # the delta ramp: every action moves ee_x by STEP
    np.testing.assert_array_equal(result.actions, expected)
    assert not worker.busy  # the result ended the request in flight


def slow_loading_ramp_policy(load_s: float):
    time.sleep(load_s)
    return ramp_policy(8, True)


def test_submit_returns_at_once_while_the_worker_cannot_read_a_request_larger_than_the_pipe(monkeypatch):
    """A request with two 320x320 cameras (614,400 bytes, more than the pipe buffers) while the worker still loads
    its policy for 1 s and reads nothing: ``submit`` must not wait for it (sending from the caller did, for the
    whole load), and the request is answered once the policy is in."""
    worker = InferenceWorker(partial(slow_loading_ramp_policy, 1.0), mode="thread")
    try:
        big, front = np.zeros((1, 320, 320, 3), np.uint8), np.zeros((1, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
        observation = {image_key("front"): front, image_key("wrist"): big, image_key("side"): big, TASK: [""]}
        start = time.perf_counter()
        worker.submit(InferenceRequest(request_id=1, observation=observation, obs_step=0))
        submit_s = time.perf_counter() - start
        messages, deadline = [], time.monotonic() + 30
        while not any(isinstance(m, InferenceResult) for m in messages) and time.monotonic() < deadline:
            messages += worker.poll()
            time.sleep(0.01)
    finally:
        worker.close()
    assert submit_s < 0.1, f"submit waited {submit_s:.3f} s for the worker to read"
    assert [type(m).__name__ for m in messages] == ["WorkerStatus", "WorkerStatus", "InferenceResult"]
    assert messages[-1].error is None and messages[-1].actions.shape == (1, 8, 4)


def test_close_ends_both_threads_in_either_mode():
    """Process mode is the default: the node must not keep a thread reading a pipe whose worker is gone. The
    closing protocol, not the machine's speed: with a join timeout no load reaches, the worker ends on the closing
    message (a process exits 0, where one close had to terminate would exit -15) and both threads are gone."""
    for mode in ("thread", "process"):
        worker = InferenceWorker(partial(ramp_policy, 8, True), mode=mode)
        statuses, deadline = [], time.monotonic() + 60
        while "ready" not in statuses and time.monotonic() < deadline:  # a process's start-up is not close's time
            statuses += [m.state for m in worker.poll()]
            time.sleep(0.01)
        worker.close(timeout=600.0)
        if mode == "process":
            assert worker._runner.exitcode == 0, worker._runner.exitcode  # ended by the closing message itself
        assert not (worker._receiver.is_alive() or worker._sender.is_alive() or worker.alive()), mode


def _refuse_to_rebuild():
    raise ValueError("cannot rebuild")


class RaisesOnUnpickle:
    """Pickles; unpickling it raises (a message the control side cannot read)."""

    def __reduce__(self):
        return _refuse_to_rebuild, ()


def unreadable_ready_policy():
    policy = ramp_policy(8, True)
    policy.config.image_size = RaisesOnUnpickle()  # goes out in the worker's "ready" status
    return policy


def test_an_unreadable_message_stops_the_worker_with_the_reason():
    """Reading in a thread must not hide a message that cannot be read: the worker then counts as dead (the node
    holds, `PolicyHealth.worker_problem`) and says why."""
    worker = InferenceWorker(unreadable_ready_policy, mode="thread")
    try:
        deadline = time.monotonic() + 30
        while worker.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker.alive()
        assert worker.io_error == "unreadable message from the inference worker: ValueError: cannot rebuild"
        assert [m.state for m in worker.poll()] == ["loading"]  # the message before it came through
    finally:
        worker.close()


def _ready(worker: InferenceWorker) -> None:
    statuses, deadline = [], time.monotonic() + 30
    while not any(s.state == "ready" for s in statuses) and time.monotonic() < deadline:
        statuses += worker.poll()
        time.sleep(0.01)
    assert any(s.state == "ready" for s in statuses)


def test_an_added_latency_runs_in_a_mid_inference_requests_slow_part_not_after_its_mid_observation():
    """A slow model (0.6 s added) answering a latency-aware request whose mid observation the node sends 0.3 s
    in: the slow part's 0.6 s covers that wait, so the answer comes about 0.6 s after the request. Slept after the
    mid observation it came at 0.9 s, and on a robot the announced delay grew to its fixed point (2.4 times the
    added latency at mid_fraction 0.5, measured 15 steps for a 0.3625 s delay at 20 Hz). ``compute_s`` holds the
    two parts, 0.6 s and the ramp's microseconds, not the wait between them."""
    added, mid_at = 0.6, 0.3
    worker = InferenceWorker(partial(ramp_policy, 8, True), mode="thread", added_latency_s=added)
    try:
        _ready(worker)
        observation = {image_key("front"): np.zeros((1, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8), TASK: [""]}
        sent = time.monotonic()
        worker.submit(InferenceRequest(request_id=1, observation=observation, obs_step=0, needs_mid=True))
        time.sleep(mid_at)
        worker.send_mid(MidObservation(1, {}))
        results, deadline = [], time.monotonic() + 30
        while not results and time.monotonic() < deadline:
            results = [r for r in worker.poll() if isinstance(r, InferenceResult)]
            time.sleep(0.005)
        answered = time.monotonic() - sent
        # a request that needs no mid observation sleeps the same 0.6 s before its answer
        sent = time.monotonic()
        worker.submit(InferenceRequest(request_id=2, observation=observation, obs_step=4))
        plain = []
        while not plain and time.monotonic() < deadline:
            plain = [r for r in worker.poll() if isinstance(r, InferenceResult)]
            time.sleep(0.005)
        answered_plain = time.monotonic() - sent
    finally:
        worker.close()
    (result,) = results
    assert result.error is None and result.request_id == 1
    assert added <= answered < added + mid_at - 0.1, f"answered {answered:.3f} s after the request"
    assert added <= result.compute_s < added + 0.1
    assert plain[0].request_id == 2 and added <= answered_plain < added + 0.2
