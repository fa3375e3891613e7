"""Inference on another machine (`vla-rl policy-server`, `serve --inference=remote`): the worker's messages on the
wire, a request answered through a real gRPC server on loopback, one robot at a time, and a server that disappears
and returns (the request in flight fails, the worker says the server is unreachable, then is ready again).
No ROS here: the node's side is tests/test_remote_inference.py."""

import socket
import threading
import time

import numpy as np
import pytest
from bridge_policies import IMAGE_SIZE, STEP, ramp_policy

from robot_bridge import wire
from robot_bridge.config import SIM_STATE_NAMES, ServeConfig
from robot_bridge.inference import InferenceRequest, InferenceResult, MidObservation, WorkerStatus
from robot_bridge.policy_server import PolicyServer, PolicyServerConfig, RemoteInferenceWorker
from vla_core.types import OBS_STATE, TASK, image_key


def observation(ee_x: float = 0.5) -> dict:
    state = np.zeros((1, len(SIM_STATE_NAMES)), np.float32)
    state[0, 8:11] = (ee_x, 0.1, 0.2)
    return {OBS_STATE: state, TASK: ["lift the cube"], image_key("front"): np.full((1, IMAGE_SIZE, IMAGE_SIZE, 3), 128,
                                                                                  np.uint8)}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


UNREAD: dict[int, list] = {}  # messages a wait_for polled but did not return, by worker, in order


def wait_for(worker, predicate, timeout=30.0):
    """The first message of ``worker`` (polled until one comes) that satisfies ``predicate``; the others it polled
    stay for the next call."""
    end = time.monotonic() + timeout
    unread = UNREAD.setdefault(id(worker), [])
    while time.monotonic() < end:
        unread.extend(worker.poll())
        for i, message in enumerate(unread):
            if predicate(message):
                return unread.pop(i)
        time.sleep(0.01)
    raise AssertionError("no such message from the remote worker in time")


def test_every_message_crosses_the_wire_unchanged_and_nothing_else_does():
    request = InferenceRequest(7, observation(), 12, (np.ones((1, 8, 4), np.float32), np.zeros((1, 8), np.float32)),
                               needs_mid=True, noise=np.arange(32, dtype=np.float32).reshape(1, 8, 4))  # fmt: skip
    back = wire.decode(wire.encode(request))
    assert (back.request_id, back.obs_step, back.needs_mid, back.observation[TASK]) == (7, 12, True, ("lift the cube",))
    for key in (OBS_STATE, image_key("front")):
        np.testing.assert_array_equal(back.observation[key], request.observation[key])
        assert back.observation[key].dtype == request.observation[key].dtype
    np.testing.assert_array_equal(back.noise, request.noise)
    assert isinstance(back.guidance, tuple) and back.guidance[0].shape == (1, 8, 4)
    status = wire.decode(wire.encode(WorkerStatus("ready", info={"horizon": 8, "mid_cameras": ("front",)})))
    assert status == WorkerStatus("ready", info={"horizon": 8, "mid_cameras": ("front",)})
    result = InferenceResult(3, 4, 0.25, np.zeros((1, 8, 4), np.float32), finished=9.0)
    assert wire.decode(wire.encode(result)).compute_s == 0.25 and wire.decode(wire.encode(None)) is None
    mid = wire.decode(wire.encode(MidObservation(3, {"observation.mid.steps": np.array([2])})))
    assert mid.observation["observation.mid.steps"].tolist() == [2]
    with pytest.raises(TypeError, match="not a message of the inference worker"):
        wire.encode({"type": "InferenceRequest"})
    with pytest.raises(TypeError, match="only numeric arrays"):
        wire.encode(MidObservation(1, {"x": np.array(["a"], dtype=object)}))
    forged = b"\x82\xa4type\xa4eval\xa6fields\x80"  # {"type": "eval", "fields": {}}
    for data in (forged, b"\xc1", b"not msgpack at all"):
        with pytest.raises(ValueError, match="not a message of the inference worker"):
            wire.decode(data)


@pytest.fixture
def server():
    """A policy server of the ramp policy on a free loopback port; stopped after the test."""
    cfg = PolicyServerConfig(address=f"127.0.0.1:{free_port()}", load_retry_s=0.2)
    server = PolicyServer(ramp_policy, cfg)
    server.start()
    yield server, cfg
    server.stop()


def test_a_request_is_answered_by_the_server_and_timed_on_the_robots_clock(server):
    _, cfg = server
    worker = RemoteInferenceWorker(cfg.address, retry_s=0.2)
    try:
        ready = wait_for(worker, lambda m: isinstance(m, WorkerStatus) and m.state == "ready")
        assert ready.info["horizon"] == 8 and ready.info["action_dim"] == 4
        sent = time.monotonic()
        worker.submit(InferenceRequest(1, observation(ee_x=0.5), obs_step=3))
        assert worker.busy
        with pytest.raises(RuntimeError, match="already in flight"):
            worker.submit(InferenceRequest(2, observation(), obs_step=3))
        result = wait_for(worker, lambda m: isinstance(m, InferenceResult))
        # The ramp: ee_x of the observed state + STEP * (j + 1), ee_y and ee_z as observed, grip 0.5.
        expected = [[0.5 + STEP * (j + 1), 0.1, 0.2, 0.5] for j in range(8)]
        np.testing.assert_allclose(result.actions[0], expected, atol=1e-6)
        assert (result.request_id, result.obs_step, result.error) == (1, 3, None) and not worker.busy
        assert sent < result.finished <= time.monotonic()  # stamped when it arrived here, not by the server
    finally:
        worker.close()


def test_a_second_robot_is_refused_while_one_is_served(server):
    _, cfg = server
    first = RemoteInferenceWorker(cfg.address, retry_s=0.2)
    wait_for(first, lambda m: isinstance(m, WorkerStatus) and m.state == "ready")
    second = RemoteInferenceWorker(cfg.address, retry_s=60.0)
    try:
        refused = wait_for(second, lambda m: isinstance(m, WorkerStatus) and m.state == "failed")
        assert "RESOURCE_EXHAUSTED" in refused.error and "serves another robot" in refused.error
    finally:
        first.close(), second.close()


def test_a_server_that_disappears_fails_the_request_in_flight_then_serves_again_when_it_returns():
    address = f"127.0.0.1:{free_port()}"
    slow = PolicyServerConfig(address=address, added_latency_s=2.0)  # long enough to be stopped mid-request
    server = PolicyServer(ramp_policy, slow)
    server.start()
    worker = RemoteInferenceWorker(address, retry_s=0.2)
    try:
        wait_for(worker, lambda m: isinstance(m, WorkerStatus) and m.state == "ready")
        worker.submit(InferenceRequest(1, observation(), obs_step=0))
        time.sleep(0.3)
        server.stop(grace_s=0)
        failed = wait_for(worker, lambda m: isinstance(m, InferenceResult))
        assert failed.request_id == 1 and "did not answer" in failed.error and not worker.busy
        down = wait_for(worker, lambda m: isinstance(m, WorkerStatus) and m.state == "failed")
        assert f"policy server at {address} unreachable" in down.error
        UNREAD[id(worker)].clear()  # what came before the outage's report
        time.sleep(0.5)  # two more attempts to connect: the outage is reported once
        assert not [m for m in worker.poll() if isinstance(m, WorkerStatus)]
        worker.submit(InferenceRequest(2, observation(), obs_step=5))  # while it is down: fails at once
        assert "did not answer" in wait_for(worker, lambda m: isinstance(m, InferenceResult)).error
        server = PolicyServer(ramp_policy, PolicyServerConfig(address=address))  # back, on the same port
        server.start()
        wait_for(worker, lambda m: isinstance(m, WorkerStatus) and m.state == "ready")
        worker.submit(InferenceRequest(3, observation(ee_x=0.4), obs_step=6))
        result = wait_for(worker, lambda m: isinstance(m, InferenceResult))
        assert result.error is None and result.actions[0, 0, 0] == pytest.approx(0.4 + STEP)
    finally:
        worker.close()
        server.stop()


def test_reconnecting_to_a_server_that_is_down_leaves_no_thread_behind():
    """Every attempt opens a session whose requests gRPC reads on a thread of its own: 30 attempts (0.05 s apart,
    1.5 s) must end each one's, not leave 30 threads waiting on a robot that moved on."""
    before = threading.active_count()
    worker = RemoteInferenceWorker(f"127.0.0.1:{free_port()}", retry_s=0.05)
    try:
        time.sleep(1.5)
        assert threading.active_count() - before <= 4, [t.name for t in threading.enumerate()]
    finally:
        worker.close()


def test_remote_inference_needs_its_server_and_keeps_the_latency_on_the_server():
    with pytest.raises(ValueError, match="inference: remote and inference_server"):
        ServeConfig(inference="remote").validate()
    with pytest.raises(ValueError, match="give it to the server"):
        ServeConfig(inference="remote", inference_server="gpu-box:50051", added_latency_s=0.1).validate()
    with pytest.raises(ValueError, match=r"give it the steering \(`vla-rl policy-server --steer_dir"):
        ServeConfig(inference="remote", inference_server="gpu-box:50051", steer_dir="steer/steering").validate()
    for steering in ({"steer_mode": "always"}, {"steer_weight": 0.5}, {"steer_best_of": 8}):
        with pytest.raises(
            ValueError, match="steer_mode, steer_weight and steer_best_of steer nothing without steer_dir"
        ):
            ServeConfig(**steering).validate()
    ServeConfig(steer_weight=1.0).validate()  # the former default, in configs copied before it changed
    from robot_bridge.policy_server import PolicyServerConfig

    for steering in ({"steer_mode": "always"}, {"steer_weight": 0.5}, {"steer_best_of": 8}):  # the server as serve
        with pytest.raises(ValueError, match="steer nothing without --steer_dir"):
            PolicyServerConfig(**steering).validate()
    PolicyServerConfig(steer_dir="steer/steering", steer_mode="always").validate()
    ServeConfig(inference="remote", inference_server="gpu-box:50051").validate()
