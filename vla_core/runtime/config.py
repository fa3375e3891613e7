"""How chunks execute: the one chunking config, embedded as ``chunking`` in the eval, finetune and serve
configs (``--chunking.execute_steps``, ``--chunking.merge``, ``--chunking.ensemble_coeff``,
``--chunking.estimate_window``, ``--chunking.lead_steps``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from vla_core.runtime.executor import MergeMode

# What a world does when its instruction changes (`vla_core.runtime.protocol.LatencyProtocol.new_instruction`).
OnNewInstruction = Literal["", "replan", "next_chunk"]


@dataclass
class ChunkingConfig:
    """Steps executed per chunk, how overlapping chunks merge (see `ActionChunkExecutor`), and how far
    back a request looks to announce the delay it expects (`vla_core.runtime.protocol`).

    The inference delay is not set here: eval and finetune draw it from ``delay``, and serve measures
    it. With ``merge=rtc`` a flow policy is also guided toward the queued actions (eval and serve);
    its guidance clip is the policy's ``rtc_max_guidance``. Which merge a policy may run with is the
    protocol's table (`vla_core.runtime.protocol.MERGES`).
    """

    # Steps of each chunk executed before the next request (more while an inference is still
    # running); 0 = the policy's own n_action_steps.
    execute_steps: int = 0
    merge: MergeMode = "latest"  # latest, ensemble (ACT temporal ensembling) or rtc (real-time chunking)
    ensemble_coeff: float = 0.01  # ensemble: weight exp(-c * i) of the i-th prediction of a step, i = 0 the oldest
    # The measured delay estimate (the robot's, and eval's --delay.estimate=measured): a request announces
    # the largest lag of the last this-many merged chunks.
    estimate_window: int = 4
    # Steps from a chunk's arrival to its first action: the steps before keep what was queued (committed).
    # A robot's trajectory controller (serve --output=trajectory) needs them to receive the chunk before its
    # first point; the delay a request announces counts them. 0: a chunk takes over at the next step.
    lead_steps: int = 0
    # When the instruction changes mid-task (SwitchVLA): replan = the queued plan is dropped after its committed
    # lead_steps, the request in flight is abandoned (its chunk, planned under the old instruction, never runs) and
    # a request under the new instruction goes out at once; next_chunk = the queue and the request in flight run
    # out and the next request on schedule carries it (the behaviour before 0.3); "" = the shell's own rule:
    # replan in simulation, next_chunk on a robot, whose shell does not react yet (replan is refused there).
    on_new_instruction: OnNewInstruction = ""

    def validate(self) -> None:
        """Raise ValueError naming the field (as ``--chunking.<name>``) for a value no run could use."""
        allowed = get_args(MergeMode)
        if self.merge not in allowed:
            raise ValueError(
                f"chunking.merge={self.merge!r} is not one of {allowed}; set --chunking.merge={allowed[0]}"
            )
        if self.execute_steps < 0:
            raise ValueError(
                f"chunking.execute_steps must be >= 0 (0: the policy's n_action_steps), got {self.execute_steps}"
            )
        if not math.isfinite(self.ensemble_coeff):
            raise ValueError(f"chunking.ensemble_coeff must be finite, got {self.ensemble_coeff}")
        if self.estimate_window < 1:
            raise ValueError(f"chunking.estimate_window must be >= 1, got {self.estimate_window}")
        if self.on_new_instruction not in get_args(OnNewInstruction):
            raise ValueError(f"chunking.on_new_instruction={self.on_new_instruction!r} is not one of "
                             f"{get_args(OnNewInstruction)}; set --chunking.on_new_instruction=replan or drop it")  # fmt: skip
        if self.lead_steps < 0:
            raise ValueError(f"chunking.lead_steps must be >= 0 (0: a chunk takes over at once), got {self.lead_steps}")

    def steps_per_chunk(self, policy_steps: int | None, horizon: int) -> int:
        """``execute_steps``, or the policy's ``n_action_steps`` (``policy_steps``) when it is 0, checked against
        the chunk length ``horizon``: a chunk cannot run for more steps than it has."""
        self.validate()
        steps = self.execute_steps or policy_steps
        if not steps:
            raise ValueError("the policy does not tell its n_action_steps; set --chunking.execute_steps")
        if steps > horizon:
            source = "chunking.execute_steps" if self.execute_steps else "the policy's n_action_steps"
            raise ValueError(f"{source}={steps} exceeds the chunk length {horizon}; lower --chunking.execute_steps")
        return steps
