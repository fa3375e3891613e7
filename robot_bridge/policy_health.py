"""Whether the served policy can be asked: whether it fits the serve config (`fit_protocol`, once it is
loaded), its worker's state (loading, ready, failed; a dead process) and the last request's failure (it
raised, or returned an unusable chunk), with when to ask again.

`robot_bridge.hold.Hold` reads the problems as hold causes; `robot_bridge.chunk_scheduler` reports
what happened. No ROS import here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from robot_bridge.config import ServeConfig
from robot_bridge.diagnostics import BridgeDiagnostics
from robot_bridge.log_limit import LogLimiter
from vla_core.runtime import LatencyProtocol, LatencySpec


def fit_protocol(config: ServeConfig, info: dict[str, Any]) -> LatencyProtocol:
    """The latency protocol of the loaded policy (``info``: `robot_bridge.inference.policy_info`) on this
    robot, or ValueError with a one-line fix when it does not fit the config: its state and action sizes,
    a latency-aware policy without the mid-inference source, and the protocol's own rules (the merge
    table, the delays it was trained or fine-tuned for up to ``max_delay_steps``)."""
    if info.get("state_dim") not in (None, len(config.state_names)):
        raise ValueError(
            f"the policy expects {info['state_dim']} state values but state_names lists {len(config.state_names)}"
        )
    if info.get("action_dim") not in (None, len(config.action_names)):
        raise ValueError(
            f"the policy outputs {info['action_dim']} action dims but action_names lists {len(config.action_names)}"
        )
    spec = LatencySpec(**{f.name: info[f.name] for f in dataclasses.fields(LatencySpec) if f.name in info})
    spec = dataclasses.replace(spec, horizon=config.horizon or spec.horizon)
    if not spec.horizon:
        raise ValueError("the policy does not tell its chunk length; set horizon in the serve config")
    if spec.latency_aware and not info.get("splits_inference", True):
        raise ValueError(
            "this latency-aware policy has no prepare_request (vla_core.types.LatencyAwarePolicy: the slow part, run "
            "before the mid-inference observation arrives); implement it, or serve a policy that is not latency-aware"
        )
    if spec.low_latency_rows and (config.inference == "remote" or config.action_mode != "absolute"):
        raise ValueError(
            "this checkpoint has a low-latency part (vla-rl finetune --low_latency), which vla-rl serve runs per tick "
            "in its own process on absolute targets: set inference: process (or thread) and action_mode: absolute, "
            "or serve the checkpoint its run started from (initial_checkpoint.txt in the run's folder)"
        )
    if spec.latency_aware and not config.mid_inference:
        raise ValueError(
            "this checkpoint is latency-aware: it reads a mid-inference observation; set mid_inference: true in the "
            "serve config (the node then sends the freshest joint state and images part-way through each inference)"
        )
    return LatencyProtocol(spec, config.chunking, use="robot", num_worlds=1, action_dim=len(config.action_names),
                           max_delay=config.max_delay_steps)  # fmt: skip


class PolicyHealth:
    """``worker_state`` (loading, ready or failed) with ``worker_error``; ``policy_error`` of kind
    ``policy_raised`` or ``invalid_chunk`` until the next good chunk. ``logger`` has rclpy's ``error``."""

    def __init__(self, config: ServeConfig, diagnostics: BridgeDiagnostics, log_limiter: LogLimiter, logger):
        self.config, self.diagnostics, self.log_limiter, self.logger = config, diagnostics, log_limiter, logger
        self.worker_state, self.worker_error = "loading", None
        self.policy_error: str | None = None
        self.policy_error_kind = ""
        self.retry_at = 0.0  # monotonic time after which a failed policy is asked again

    def loading(self) -> None:
        self.worker_state = "loading" if self.worker_state != "failed" else "failed"

    def load_failed(self, error: str, counted: bool = True) -> None:
        """The checkpoint failed to load (counted, retried by the worker) or does not fit the config."""
        if counted:
            self.diagnostics.count("load_failures")
        self.worker_state, self.worker_error = "failed", error
        self.logger.error(f"{error}; retrying in {self.config.load_retry_s:g} s" if counted else error)

    def ready(self) -> None:
        self.worker_state, self.worker_error = "ready", None

    def worker_problem(self, alive: bool, why: str = "") -> tuple[str, str] | None:
        """(key, text) while the policy is loading, failed to load or its worker died (``alive`` False; ``why``:
        the worker's ``io_error``, when its messages stopped moving)."""
        if self.worker_state != "ready":
            return f"worker {self.worker_state}", self.worker_error or "loading the policy"
        if not alive:
            died = f"the inference worker stopped ({why})" if why else "the inference worker died"
            self.worker_state, self.worker_error = "failed", f"{died}; restart the node"
            self.logger.error(self.worker_error)
            return "worker died", self.worker_error
        return None

    def policy_problem(self) -> tuple[str, str] | None:
        """(key, text) after the policy raised or returned an unusable chunk, until its next good chunk."""
        return None if self.policy_error is None else (f"policy {self.policy_error_kind}", self.policy_error)

    def policy_failed(self, error: str, raised: bool, now: float) -> None:
        """Hold on a policy that raised or returned an unusable chunk; ask again after ``error_retry_s``."""
        kind = "policy_raised" if raised else "invalid_chunk"
        self.diagnostics.count("policy_errors" if raised else "invalid_chunks")
        self.retry_at = now + self.config.error_retry_s
        self.log_limiter(
            f"policy {kind}", "error", f"{error}; holding, asking again in {self.config.error_retry_s:g} s"
        )
        self.policy_error, self.policy_error_kind, self.diagnostics.last_error = error, kind, error

    def may_ask(self, cause: str | None, now: float) -> bool:
        """Whether a request may go out on a tick that holds for ``cause``: never while holding, except to
        retry a failed policy after ``error_retry_s`` (only a good chunk clears that hold)."""
        if cause is not None and cause != self.policy_error:
            return False
        return self.policy_error is None or now >= self.retry_at
