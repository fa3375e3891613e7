"""The low-latency part of a served checkpoint (`policies.low_latency`, from ``vla-rl finetune --low_latency``),
run in the control process at every tick, on the freshest joint state and images, as simulation's shell runs it
(`vla_core.runtime.delayed_env.DelayedChunkEnv`'s step policy).

The slow policy stays in the inference worker; this process loads the same checkpoint once more, in a thread so
that the control loop never waits for it, and runs only the part's mean correction (`low_latency_step`) on the
CPU: one small network per tick. The node holds until it is loaded.

The part acts on the joint state and images of the tick its action goes out at: one control period fresher than
the observation the slow policy's request of that step was made from (the node prepares a step's action at the
tick before; simulation's shell reads one observation for both), its step context the one prepared with the
action. A part that fails to load leaves the node failed with its error (restart it once the checkpoint is fixed).

With ``output: trajectory`` the correction goes out as the trajectory's next point: each tick that does not hold
sends the trajectory from its step on, the corrected point first, then the plan's later points
(`robot_bridge.trajectory.TrajectoryPlanner.correct`), so a lost tick leaves the controller on the plan.

The rule when the part cannot act (stated in README's serve section): the tick's inputs are refused (no joint
state or image within the pairing tolerance), or the part raises or returns a non-finite action (with trajectory
output also: the IK does not reach the corrected point), the tick sends the action the part would have corrected
(the queue's, or the hold; with trajectory output nothing is sent and the trajectory sent before runs on), counts
``low_latency_fallbacks`` and logs why (rate-limited). A stale observation never reaches it: the hold's staleness
checks hold the tick before (the hold is not corrected then). No ROS import here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from robot_bridge.inference import to_policy_batch
from robot_bridge.scheduling import use_normal


class LowLatencyRunner:
    """Loads the checkpoint with ``load_policy`` in a background thread; :meth:`act` corrects one tick's action.
    ``ready`` once loaded; ``error`` (text) when the load failed or the checkpoint has no low-latency part."""

    def __init__(self, load_policy: Callable[[], Any]) -> None:
        self.policy: Any = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._load, args=(load_policy,), daemon=True, name="low-latency-load")
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.policy is not None

    def _load(self, load_policy: Callable[[], Any]) -> None:
        # Started from the control thread, this thread inherits its real-time priority and its core: loading a
        # checkpoint there would keep the control loop (same priority, same core) off the CPU for seconds.
        use_normal()
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        try:
            policy = load_policy()
        except Exception as err:  # noqa: BLE001 (reported as the node's load failure, never a crash)
            self.error = f"the low-latency part failed to load: {type(err).__name__}: {err}"
            return
        if not callable(getattr(policy, "low_latency_step", None)):
            self.error = "the checkpoint announced a low-latency part but its policy has no low_latency_step"
            return
        if hasattr(policy, "eval"):
            policy.eval()
        self.policy = policy

    def act(self, observation: dict[str, Any], base: np.ndarray, context) -> tuple[np.ndarray | None, str]:
        """(the corrected action (A,) float64, or None when the part could not act; why not). observation: the
        inputs' numpy batch of one (`BridgeInputs.observation`); base (A,): the action the part corrects; context:
        the protocol's `StepContext` of this step."""
        try:
            with torch.no_grad():
                action = self.policy.low_latency_step(
                    to_policy_batch(observation), torch.as_tensor(base, dtype=torch.float32)[None], context
                )
            action = action[0].detach().cpu().numpy().astype(np.float64)
        except Exception as err:  # noqa: BLE001 (the tick falls back to the uncorrected action)
            return None, f"the low-latency part raised {type(err).__name__}: {err}"
        if action.shape != base.shape or not np.isfinite(action).all():
            return None, f"the low-latency part returned {action.shape} with non-finite values or a wrong size"
        return action, ""
