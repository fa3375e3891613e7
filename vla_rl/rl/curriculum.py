"""A task curriculum from success rates and learning progress (CAMRL-style), for multi-task fine-tuning.

Each task keeps two exponential moving averages of its rollout success, a fast one (rate ``fast``)
and a slow one (rate ``slow``). Their gap is the task's learning progress, the success still
missing its room to improve; a task is rolled out with a probability proportional to

    priority_t = (1 - fast_t) + progress_weight * |fast_t - slow_t| + floor

so tasks that are far from solved or are changing fast get the rollouts, and a solved, settled
task still gets ``floor``'s share, so it is not forgotten unseen. Its state (the averages and its
random stream) is saved with every checkpoint.
"""

from __future__ import annotations

import torch


class TaskCurriculum:
    def __init__(self, tasks: list[str], *, fast: float = 0.5, slow: float = 0.1, progress_weight: float = 2.0,
                 floor: float = 0.05, seed: int = 0):  # fmt: skip
        self.tasks = list(tasks)
        self.fast, self.slow, self.progress_weight, self.floor = fast, slow, progress_weight, floor
        self.fast_success = torch.zeros(len(tasks))
        self.slow_success = torch.zeros(len(tasks))
        self.seen = torch.zeros(len(tasks), dtype=torch.bool)
        self.generator = torch.Generator().manual_seed(seed)

    def priorities(self) -> torch.Tensor:
        """(T,) sampling weights, summing to 1. A task never rolled out counts as unsolved."""
        progress = (self.fast_success - self.slow_success).abs()
        raw = (1 - self.fast_success) + self.progress_weight * progress + self.floor
        return raw / raw.sum()

    def choose(self, count: int) -> list[int]:
        """``count`` distinct task indices drawn by priority, in increasing order."""
        if count >= len(self.tasks):
            return list(range(len(self.tasks)))
        drawn = torch.multinomial(self.priorities(), count, replacement=False, generator=self.generator)
        return sorted(drawn.tolist())

    def update(self, task: int, success_rate: float) -> None:
        """Record a rollout's success rate for ``task``; the first one initializes both averages."""
        if not self.seen[task]:
            self.fast_success[task] = self.slow_success[task] = success_rate
            self.seen[task] = True
            return
        self.fast_success[task] += self.fast * (success_rate - self.fast_success[task])
        self.slow_success[task] += self.slow * (success_rate - self.slow_success[task])

    def state_dict(self) -> dict:
        return {"fast": self.fast_success.clone(), "slow": self.slow_success.clone(), "seen": self.seen.clone(),
                "generator": self.generator.get_state()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.fast_success, self.slow_success, self.seen = (
            state["fast"].clone(),
            state["slow"].clone(),
            state["seen"].clone(),
        )
        self.generator.set_state(state["generator"])
