"""A delay shell for tests, from the few numbers a test cares about instead of a policy's spec."""

from vla_core.runtime import DEFAULT_MID_FRACTION, ChunkingConfig, DelayModel, LatencySpec
from vla_core.runtime.delayed_env import DelayedChunkEnv


def make_shell(env, horizon: int, execute_steps: int, delay: DelayModel, *, merge: str = "latest",
               ensemble_coeff: float = 0.01, committed_rows: int = 0, mid_fraction: float | None = None,
               mid_cameras=(), gamma: float = 1.0, window: int = 4, use: str = "eval",
               lead_steps: int = 0) -> DelayedChunkEnv:  # fmt: skip
    """`DelayedChunkEnv` for a policy of chunk length ``horizon`` that reads ``committed_rows`` rows of the
    delay augmentation (training-time RTC), or, with ``mid_fraction``, a latency-aware one fine-tuned for
    the delay model's delays; it takes RTC guidance. ``execute_steps`` per chunk, ``window`` of the
    measured estimate, ``lead_steps`` from a chunk's arrival to its first action."""
    aware = mid_fraction is not None
    spec = LatencySpec(
        horizon=horizon, n_action_steps=execute_steps, committed_rows=committed_rows, latency_aware=aware,
        latency_max_delay=max(committed_rows, delay.max_steps) if aware else 0,
        mid_fraction=DEFAULT_MID_FRACTION if mid_fraction is None else mid_fraction, mid_cameras=tuple(mid_cameras),
        supports_inpainting=True,
    )  # fmt: skip
    chunking = ChunkingConfig(execute_steps=execute_steps, merge=merge, ensemble_coeff=ensemble_coeff,
                              estimate_window=window, lead_steps=lead_steps)  # fmt: skip
    return DelayedChunkEnv(env, spec, chunking, delay, use=use, gamma=gamma)
