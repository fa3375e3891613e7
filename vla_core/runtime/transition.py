"""Chunk-level transitions for RL: what each world's chunk earned from its request to its next request or
the end of its episode (`vla_core.runtime.delayed_env.DelayedChunkEnv` keeps one per world)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkTransition:
    """Each world's chunk-level transition, from its latest chunk request up to now. All (N,), on the env's device.

    start_step: long, the control step of the request (the step the chunk was conditioned on).
    steps: long, env steps taken since the request.
    reward: float32, the env's reward summed over those steps.
    discounted_reward: float32, the same rewards discounted per control step from the request:
        sum_i gamma^i r_i (RL's chunk-level reward).
    discount: float32, gamma^steps: what the value of the next request is worth from this one.
    terminated, truncated: bool, the episode ended on the last of them (a transition never spans
        two episodes; the episode's last observation is then ``info["final_obs"]``).
    diverged: bool, the episode ended because its world blew up (``info["diverged"]``).
    ready: bool, the transition is complete: the world requests a new chunk now, or its episode
        ended. Other rows are still running and hold their values so far.
    """

    start_step: torch.Tensor
    steps: torch.Tensor
    reward: torch.Tensor
    discounted_reward: torch.Tensor
    discount: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    diverged: torch.Tensor
    ready: torch.Tensor
    gamma: float = 1.0  # the discount per control step, in (0, 1]

    @classmethod
    def zeros(cls, n: int, device: torch.device | str = "cpu", gamma: float = 1.0) -> ChunkTransition:
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        long, flag = torch.zeros(n, dtype=torch.long, device=device), torch.zeros(n, dtype=torch.bool, device=device)
        real = torch.zeros(n, device=device)
        return cls(
            long, long.clone(), real, real.clone(), real + 1, flag, flag.clone(), flag.clone(), flag.clone(), gamma
        )

    def clone(self) -> ChunkTransition:
        return ChunkTransition(*(t.clone() if torch.is_tensor(t) else t for t in vars(self).values()))

    def start(self, worlds: torch.Tensor, step: torch.Tensor) -> None:
        """Open a new transition in ``worlds`` ((N,) bool), requested at control step ``step`` (N,)."""
        self.start_step = torch.where(worlds, step, self.start_step)
        for name in ("steps", "reward", "discounted_reward", "terminated", "truncated", "diverged", "ready"):
            running = getattr(self, name)
            setattr(self, name, torch.where(worlds, torch.zeros_like(running), running))
        self.discount = torch.where(worlds, torch.ones_like(self.discount), self.discount)

    def add_step(
        self,
        reward: torch.Tensor,
        terminated: torch.Tensor,
        truncated: torch.Tensor,
        diverged: torch.Tensor | None = None,
    ) -> None:
        """Every world took one env step: (N,) each, float32 and bool."""
        self.steps = self.steps + 1
        self.reward = self.reward + reward
        self.discounted_reward = self.discounted_reward + self.discount * reward
        self.discount = self.discount * self.gamma
        self.terminated = self.terminated | terminated
        self.truncated = self.truncated | truncated
        if diverged is not None:
            self.diverged = self.diverged | diverged
