"""A delay shell for tests, from the few numbers a test cares about instead of a policy's spec, and a counting
env whose every step says what it ran."""

import numpy as np
import torch

from vla_core.runtime import DEFAULT_MID_FRACTION, ChunkingConfig, DelayModel, LatencySpec
from vla_core.runtime.delayed_env import DelayedChunkEnv


def make_shell(env, horizon: int, execute_steps: int, delay: DelayModel, *, merge: str = "latest",
               ensemble_coeff: float = 0.01, committed_rows: int = 0, mid_fraction: float | None = None,
               mid_cameras=(), window: int = 4, use: str = "eval",
               lead_steps: int = 0, low_latency_rows: int = 0, step_policy=None,
               on_new_instruction: str = "replan") -> DelayedChunkEnv:  # fmt: skip
    """`DelayedChunkEnv` for a policy of chunk length ``horizon`` that reads ``committed_rows`` rows of the
    delay augmentation (training-time RTC), or, with ``mid_fraction``, a latency-aware one fine-tuned for
    the delay model's delays; it takes RTC guidance. ``execute_steps`` per chunk, ``window`` of the
    measured estimate, ``lead_steps`` from a chunk's arrival to its first action; a low-latency part reading
    ``low_latency_rows`` plan rows acts through ``step_policy``; ``on_new_instruction`` as the chunking's."""
    aware = mid_fraction is not None
    spec = LatencySpec(
        horizon=horizon, n_action_steps=execute_steps, committed_rows=committed_rows, latency_aware=aware,
        latency_max_delay=max(committed_rows, delay.max_steps + lead_steps) if aware else 0,
        mid_fraction=DEFAULT_MID_FRACTION if mid_fraction is None else mid_fraction, mid_cameras=tuple(mid_cameras),
        supports_inpainting=True, low_latency_rows=low_latency_rows,
    )  # fmt: skip
    chunking = ChunkingConfig(execute_steps=execute_steps, merge=merge, ensemble_coeff=ensemble_coeff,
                              estimate_window=window, lead_steps=lead_steps,
                              on_new_instruction=on_new_instruction)  # fmt: skip
    return DelayedChunkEnv(env, spec, chunking, delay, use=use, step_policy=step_policy)


class CountingEnv:
    """A minimal env with 1-D actions that records what is applied, with the reset/step part of the
    BatchedEnv contract the delay shell uses; episodes last `length` steps (one length, or one per world). With
    ``switch_at`` k, the observation after k steps of an episode, and every later one, says "count again"."""

    def __init__(self, num_envs=1, length=1000, switch_at=None):
        self.num_envs, self.action_dim, self.device = num_envs, 1, torch.device("cpu")
        self.length, self.switch_at = np.asarray(length), switch_at
        self.applied: list[list[float]] = [[] for _ in range(num_envs)]
        self.t = np.zeros(num_envs, dtype=np.int64)

    def _obs(self):
        return {
            "observation.state": torch.from_numpy(self.t[:, None].astype(np.float32)),
            "task": ["count again" if self.switch_at is not None and t >= self.switch_at else "count" for t in self.t],
        }

    def reset(self, seed=None, *, worlds=None):
        self.t[slice(None) if worlds is None else worlds] = 0
        return self._obs()

    def get_state(self, worlds=None):
        return [{"t": int(self.t[w]), "episode_step": int(self.t[w])} for w in range(self.num_envs)
                if worlds is None or w in worlds]  # fmt: skip

    def set_state(self, states, worlds=None):
        for w, state in zip(range(self.num_envs) if worlds is None else worlds, states, strict=True):
            self.t[w] = state["t"]
        return self._obs()

    def step(self, actions):
        for i in range(self.num_envs):
            self.applied[i].append(float(actions[i, 0]))
        reward = torch.from_numpy(self.t.astype(np.float32))  # the index of the step just taken
        self.t += 1
        final = self._obs()  # what the step reached, before an ended episode starts again
        trunc = torch.from_numpy(self.t >= self.length)
        self.t[trunc.numpy()] = 0
        zeros = torch.zeros(self.num_envs, dtype=torch.bool)
        return self._obs(), reward, zeros, trunc, {"success": zeros.clone(), "final_obs": final}

    def hold_actions(self):
        return torch.full((self.num_envs, 1), -1.0)
