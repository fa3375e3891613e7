"""`vla-rl serve` with a low-latency part (`robot_bridge.low_latency`): its load in the control process, the hold
until it is loaded, and the rule when it cannot act. Its timeline against simulation's is in
tests/test_latency_parity.py."""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

import numpy as np
import torch

from robot_bridge.chunk_scheduler import ChunkScheduler
from robot_bridge.config import SIM_ACTION_NAMES, SIM_STATE_NAMES, CameraTopic, ServeConfig
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.inputs import BridgeInputs
from robot_bridge.log_limit import LogLimiter
from robot_bridge.low_latency import LowLatencyRunner
from vla_core.runtime.protocol import StepContext

A = len(SIM_ACTION_NAMES)


class _Part:
    """A policy whose part returns NaN, then raises, then moves the base by +1 on every later call."""

    def __init__(self):
        self.calls = 0

    def low_latency_step(self, obs, base, context):
        self.calls += 1
        if self.calls == 1:
            return torch.full_like(base, float("nan"))
        if self.calls == 2:
            raise RuntimeError("boom")
        return base + 1


def _loaded(runner: LowLatencyRunner) -> LowLatencyRunner:
    runner._thread.join(timeout=10)
    return runner


def test_the_runner_says_why_it_cannot_load():
    def broken():
        raise OSError("no such checkpoint")

    assert _loaded(LowLatencyRunner(broken)).error == "the low-latency part failed to load: OSError: no such checkpoint"
    plain = _loaded(LowLatencyRunner(lambda: SimpleNamespace()))
    assert not plain.ready and "has no low_latency_step" in plain.error
    assert _loaded(LowLatencyRunner(_Part)).ready


def _scheduler(lines: list[str]) -> ChunkScheduler:
    config = ServeConfig(checkpoint="(probe)", inference="thread", inference_cpu=-1,
                         cameras=[CameraTopic("front", "/camera/front/image_raw")])  # fmt: skip
    logger = SimpleNamespace(info=lambda *_: None, error=lambda *_: None, warning=lambda *_: None)
    diagnostics, limiter = BridgeDiagnostics(), LogLimiter(lambda level, line: lines.append(line))
    inputs = BridgeInputs(config, diagnostics, limiter, logger.info)
    inputs.state = np.zeros(len(SIM_STATE_NAMES))
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    inputs.images["front"], inputs.frames["front"] = image, deque([(0.0, image)])
    inputs.state_arrival, inputs.state_time = 0.0, 0.0  # the state's message: arrived and stamped at 0 s
    return ChunkScheduler(config, _no_slow_policy, inputs, diagnostics, limiter, logger, lambda chunk: None)


def _no_slow_policy():
    raise RuntimeError("these tests ask the low-latency part only")  # the worker reports it and waits to retry


def test_a_tick_whose_part_cannot_act_sends_the_uncorrected_action_and_counts_it():
    """The rule: NaN or a raise from the part, or no paired observation, sends the action the part would have
    corrected (the queue's; None when the queue ran dry, so the node holds), counted in low_latency_fallbacks; a
    part that acts corrects the queue's action, or the hold when the queue ran dry."""
    lines: list[str] = []
    scheduler = _scheduler(lines)
    try:
        scheduler.low_latency = _loaded(LowLatencyRunner(_Part))
        scheduler.next_context = StepContext(torch.zeros(1, 2, A), torch.zeros(1, 2, dtype=torch.bool),
                                             torch.tensor([-1]), torch.tensor([0]))  # fmt: skip
        queued, hold = np.array([0.1, 0.2, 0.3, 1.0]), np.array([0.0, 0.0, 0.5, 0.0])
        assert scheduler.low_latency_target(queued, hold) is queued  # NaN
        assert scheduler.low_latency_target(None, hold) is None  # raised: the hold stays a hold
        np.testing.assert_allclose(scheduler.low_latency_target(queued, hold), queued + 1)
        np.testing.assert_allclose(scheduler.low_latency_target(None, hold), hold + 1)
        image = scheduler.inputs.images["front"]  # its only frame 10 s from the state: no paired observation
        scheduler.inputs.frames["front"] = deque([(-10.0, image)])
        assert scheduler.low_latency_target(queued, hold) is queued
        assert scheduler.diagnostics.counters["low_latency_fallbacks"] == 3
        assert scheduler.low_latency.policy.calls == 4  # the missing observation never reached the part
        assert len(scheduler.diagnostics.low_latency_ms) == 5  # every tick the part was asked, timed
        assert scheduler.diagnostics.counters["unpaired_observations"] == 0  # the requests count those, not the part
        values = scheduler.diagnostics.values("RUNNING", None, {})
        assert float(values["low_latency_p99_ms"]) >= 0 and values["low_latency_fallbacks"] == "3"
        assert "returned (4,) with non-finite values" in lines[0]
    finally:
        scheduler.close()


def test_the_node_holds_until_the_part_is_loaded_and_fails_with_its_error():
    """The worker is ready and the policy fits, but the protocol (and so every request and action) waits for the
    part; a part that fails to load leaves the node failed with the part's error."""
    scheduler = _scheduler([])
    try:
        release = threading.Event()

        def slow():
            release.wait(10)
            return _Part()

        fitted = object()
        scheduler.low_latency, scheduler._fitted = LowLatencyRunner(slow), fitted
        scheduler._finish_loading()
        assert scheduler.protocol is None and scheduler.health.worker_state == "loading"
        release.set()
        _loaded(scheduler.low_latency)
        scheduler._finish_loading()
        assert scheduler.protocol is fitted and scheduler.health.worker_state == "ready"

        def broken():
            raise OSError("gone")

        scheduler.protocol, scheduler._fitted = None, fitted
        scheduler.low_latency = _loaded(LowLatencyRunner(broken))
        scheduler._finish_loading()
        assert scheduler.protocol is None and scheduler.health.worker_state == "failed"
        assert scheduler.health.worker_error == "the low-latency part failed to load: OSError: gone"
    finally:
        scheduler.close()
