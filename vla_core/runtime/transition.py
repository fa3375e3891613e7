"""RL's credit under delay: each chunk decision is credited with the control steps its own rows ran.

The simulation's shell (`vla_core.runtime.delayed_env.DelayedChunkEnv`) returns with every call what each
world's control steps did (`StepTrace`): the env's reward, and which chunk's row ran, named by the step its
request was conditioned on (``obs_step``, unique within an episode) and the row. `ExecutionCredit` turns a
rollout's traces into one `Window` per decision that ran:

- a decision's window opens at the first step one of its rows runs and closes where the next decision's
  first row runs, or with its episode; steps in between where the queue ran dry and its last action was
  held are its own (it chose that action);
- its reward is the env's rewards over the window, discounted per control step from the window's first
  step, sum_j gamma^j r_j; the next decision's value is worth gamma^steps of it; the episode's final reward
  goes to the decision whose window the episode ends;
- the steps before an episode's first row runs (the shell holds the arm while the first chunk is computed)
  are no decision's: nothing chose their actions;
- a decision none of whose rows ran (its chunk still in flight when the episode ended) gets no window.

Why not from request to request: under a delay of d control steps, the steps after decision i's request
run decision i - 1's rows (all of them when d is at least the steps per chunk), so that credit would pay
decision i for what decision i - 1 did. With merge ``latest`` (the only one fine-tuning allows) every step
runs one decision's row and the windows tile the episode after its first chunk arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepTrace:
    """What each world's control steps of one shell call did: all (N, T), T the steps of the call, on the
    shell's device.

    reward: float32, the env's reward of the step.
    source: long, the ``obs_step`` of the chunk whose row ran (or whose last row was held) at the step; -1
        where no chunk's row has run yet in the episode (the shell's hold action).
    row: long, that chunk's row that ran; -1 where nothing was queued (a hold).
    terminated, truncated, diverged: bool, the episode ended at the step (and why).
    """

    reward: torch.Tensor
    source: torch.Tensor
    row: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    diverged: torch.Tensor

    @staticmethod
    def stack(steps: list[dict[str, torch.Tensor]], num_worlds: int, device: torch.device) -> StepTrace:
        """The trace of a call from its steps' (N,) values, one dict per step with every field's name."""
        names = ("reward", "source", "row", "terminated", "truncated", "diverged")
        if not steps:
            empty = {"reward": torch.float32, "source": torch.long, "row": torch.long}
            return StepTrace(*(torch.zeros(num_worlds, 0, dtype=empty.get(n, torch.bool), device=device)
                               for n in names))  # fmt: skip
        return StepTrace(*(torch.stack([s[n] for s in steps], 1) for n in names))

    def numpy(self) -> dict[str, np.ndarray]:
        """The fields as (N, T) numpy arrays (one read of the device per field)."""
        return {name: value.cpu().numpy() for name, value in vars(self).items()}


@dataclass
class Window:
    """One decision's credit (see the module docstring). world: its world; source: its request's step in the
    episode; first_row, last_row: the rows of its chunk that ran (every row between them ran); steps: the
    window's length; reward: sum_j gamma^j r_j over it; discount: gamma^steps; terminated, truncated: the
    episode ended with the window; diverged: its world blew up in it."""

    world: int
    source: int
    first_row: int
    last_row: int
    steps: int
    reward: float
    discount: float
    terminated: bool
    truncated: bool
    diverged: bool


class ExecutionCredit:
    """Windows of N worlds from their traces (`add`), for one rollout that starts with every world's episode
    (a ledger per rollout: a world restarted outside the traces would carry its window on)."""

    def __init__(self, num_worlds: int, gamma: float = 1.0):
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        self.gamma = gamma
        self._open: list[dict | None] = [None] * num_worlds  # each world's running window

    def add(self, trace: StepTrace) -> list[Window]:
        """Feed one call's trace; returns the windows it closed, in step order within each world."""
        t = trace.numpy()
        closed: list[Window] = []
        for w in range(t["reward"].shape[0]):
            for k in range(t["reward"].shape[1]):
                source, window = int(t["source"][w, k]), self._open[w]
                if source >= 0 and (window is None or window["source"] != source):
                    if window is not None:
                        closed.append(self._close(w, False, False))
                    window = self._open[w] = {"source": source, "first_row": -1, "last_row": -1, "steps": 0,
                                              "reward": 0.0, "discount": 1.0, "diverged": False}  # fmt: skip
                ended = bool(t["terminated"][w, k] or t["truncated"][w, k])
                if window is not None:
                    window["reward"] += window["discount"] * float(t["reward"][w, k])
                    window["discount"] *= self.gamma
                    window["steps"] += 1
                    window["diverged"] |= bool(t["diverged"][w, k])
                    row = int(t["row"][w, k])
                    if row >= 0:
                        window["last_row"] = row
                        window["first_row"] = row if window["first_row"] < 0 else window["first_row"]
                    if ended:
                        closed.append(self._close(w, bool(t["terminated"][w, k]), bool(t["truncated"][w, k])))
                if ended:
                    self._open[w] = None
        return closed

    def _close(self, world: int, terminated: bool, truncated: bool) -> Window:
        window, self._open[world] = self._open[world], None
        return Window(world=world, terminated=terminated, truncated=truncated, **window)
