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
    new_instruction: bool, the observation after the step carries another instruction than the one before it, in
        the same episode (SwitchVLA's switch; `vla_core.runtime.protocol.LatencyProtocol.new_instruction`).
    """

    reward: torch.Tensor
    source: torch.Tensor
    row: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    diverged: torch.Tensor
    new_instruction: torch.Tensor

    @staticmethod
    def stack(steps: list[dict[str, torch.Tensor]], num_worlds: int, device: torch.device) -> StepTrace:
        """The trace of a call from its steps' (N,) values, one dict per step with every field's name."""
        names = ("reward", "source", "row", "terminated", "truncated", "diverged", "new_instruction")
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


@dataclass
class Reaction:
    """How one ended episode met a switch of its instruction: world; switch_step, the episode step whose observation
    first carried the new instruction (-1: no switch); reaction_steps, from it to the first step that ran a row of
    a chunk conditioned on an observation at or after it (-1: none ran before the episode ended)."""

    world: int
    switch_step: int
    reaction_steps: int


class SwitchReactions:
    """Each world's switch and reaction to it (`Reaction`), from the shell's traces (`add`), over episodes that start
    with the ledger (or at `restart`): the one definition of reaction time, `vla-rl eval`'s and `bench switch`'s."""

    def __init__(self, num_worlds: int):
        self._step = np.zeros(num_worlds, dtype=np.int64)  # each world's episode step (the next step's index)
        self._switch = np.full(num_worlds, -1, dtype=np.int64)
        self._reaction = np.full(num_worlds, -1, dtype=np.int64)

    def restart(self) -> None:
        """Every world starts an episode (a reset of the whole batch)."""
        self._step[:], self._switch[:], self._reaction[:] = 0, -1, -1

    def add(self, trace: StepTrace) -> list[Reaction]:
        """Feed one call's trace; returns the episodes it ended, in step order."""
        t = trace.numpy()
        ended: list[Reaction] = []
        for k in range(t["reward"].shape[1]):
            for w in range(t["reward"].shape[0]):
                step, switch = int(self._step[w]), int(self._switch[w])
                # the step ran a row of a chunk planned on the new instruction's observations
                if switch >= 0 and self._reaction[w] < 0 and t["row"][w, k] >= 0 and t["source"][w, k] >= switch:
                    self._reaction[w] = step - switch
                if t["new_instruction"][w, k] and switch < 0:  # the observation after this step carries it
                    self._switch[w] = step + 1
                self._step[w] += 1
                if t["terminated"][w, k] or t["truncated"][w, k]:
                    ended.append(Reaction(w, int(self._switch[w]), int(self._reaction[w])))
                    self._step[w], self._switch[w], self._reaction[w] = 0, -1, -1
        return ended


def reaction_quartiles(reactions: list[int]) -> list[float] | None:
    """The 25th, 50th and 75th percentiles of reaction times (steps; `Reaction.reaction_steps` of the episodes that
    met their switch); None for none."""
    return [float(q) for q in np.percentile(reactions, [25, 50, 75])] if reactions else None
