"""RL's credit under delay: each decision gets the control steps its own rows ran, worked out by hand.

The counting env's reward is the in-episode index of the step taken (0, 1, 2, ...), so a window's reward
names its steps. Episodes of 30 steps, chunks of 16 rows, a request every 4 steps when nothing is in flight.
The chunk of the request at step t arrives at t + d (a latency-aware policy is asked at t + floor(d / 2) and
its chunk still arrives at t + d), and its first row to run is row d; it runs until the next chunk arrives.

    d = 0: requests 0, 4, ..., 28; window k = steps 4k .. 4k+3 (rows 0-3); the last (28) runs steps 28, 29.
    d = 3: requests 0, 4, ..., 28; window k = steps 4k+3 .. 4k+6 (rows 3-6); steps 0-2 hold (no decision's);
           request 24's window is steps 27-29 (rows 3-5); request 28's chunk is in flight at the end: no window.
    d = 8: requests 0, 8, 16, 24 (one inference at a time); window k = steps 8k+8 .. 8k+15 (rows 8-15);
           request 16's window is steps 24-29 (rows 8-13); request 24's chunk never arrives.
"""

from types import SimpleNamespace

import pytest
import torch
from shells import CountingEnv, make_shell

from vla_core.runtime import DelayConfig, DelayModel
from vla_core.runtime.transition import ExecutionCredit
from vla_core.types import ActionChunk
from vla_rl.rl.rollout import collect

HORIZON, EVERY, LENGTH = 16, 4, 30

# d -> [(request step, first step, last step, first row, last row)] of the decisions that ran, by hand.
WINDOWS = {
    0: [(4 * k, 4 * k, min(4 * k + 3, 29), 0, min(3, 29 - 4 * k)) for k in range(8)],
    3: [(4 * k, 4 * k + 3, min(4 * k + 6, 29), 3, min(6, 29 - 4 * k)) for k in range(7)],
    8: [(0, 8, 15, 8, 15), (8, 16, 23, 8, 15), (16, 24, 29, 8, 13)],
}


class _Steps:
    """A decision kind that records the step its chunk was conditioned on (`vla_core.rl.Decision`)."""

    def __init__(self, obs_step: torch.Tensor):
        self.obs_step = obs_step

    def __len__(self) -> int:
        return len(self.obs_step)

    def select(self, rows):
        return _Steps(self.obs_step[rows])

    def to(self, device):
        return self

    @staticmethod
    def cat(parts):
        return _Steps(torch.cat([p.obs_step for p in parts]))


class _StepActor:
    """Chunks whose row j is the step it is meant for (obs_step + j); each decision is its obs_step."""

    def __init__(self):
        self.policy = SimpleNamespace(config=SimpleNamespace(horizon=HORIZON, action_dim=1))
        self.device = torch.device("cpu")

    def act(self, obs, obs_step):
        actions = (obs_step[:, None] + torch.arange(HORIZON))[..., None].float()
        return ActionChunk(actions, obs_step), _Steps(obs_step.clone())


def _rollout(d: int, aware: bool, gamma: float = 1.0, worlds: int = 1):
    env = CountingEnv(num_envs=worlds, length=LENGTH)
    shell = make_shell(env, HORIZON, EVERY, DelayModel(DelayConfig(kind="fixed", steps=d)), use="finetune",
                       mid_fraction=0.5 if aware else None)  # fmt: skip
    rollout, stats = collect(_StepActor(), shell, episodes_per_world=1, seed=0, gamma=gamma)
    return rollout, stats, env


@pytest.mark.parametrize("aware", [False, True], ids=["plain", "latency_aware"])
@pytest.mark.parametrize("d", [0, 3, 8])
def test_each_decision_is_credited_with_the_steps_its_own_rows_ran(d, aware):
    rollout, stats, env = _rollout(d, aware)
    expected = WINDOWS[d]
    assert rollout.obs_step.tolist() == [w[0] for w in expected]  # a chunk in flight at the end is left out
    assert rollout.decision.obs_step.tolist() == [w[0] for w in expected]  # each row's own decision
    assert rollout.steps.tolist() == [last - first + 1 for _, first, last, _, _ in expected]
    assert rollout.reward.tolist() == [sum(range(first, last + 1)) for _, first, last, _, _ in expected]
    rows = torch.arange(HORIZON)
    executed = torch.stack([(rows >= lo) & (rows <= hi) for *_, lo, hi in expected])
    assert torch.equal(rollout.executed, executed)
    assert rollout.done.tolist() == [False] * (len(expected) - 1) + [True]
    assert rollout.truncated.tolist() == rollout.done.tolist()  # the time limit ended the episode
    assert stats.episodes == 1 and stats.env_steps >= LENGTH
    # The steps before the first chunk arrives hold, and no decision is paid for them.
    assert env.applied[0][:d] == [-1.0] * d and env.applied[0][d:LENGTH] == list(range(d, LENGTH))
    assert float(rollout.reward.sum()) == sum(range(d, LENGTH))


def test_request_to_request_credit_would_pay_each_decision_for_the_previous_ones_rows():
    """At d = 8 the steps between the request of step 8 and the next request (8 .. 15) run the first chunk's
    rows 8 .. 15; the decision of step 8 is paid for steps 16 .. 23, where its own rows run."""
    rollout, _, env = _rollout(8, aware=False)
    assert env.applied[0][8:16] == list(range(8, 16))  # actions of the chunk conditioned on step 0 (row j = 0 + j)
    second = rollout.obs_step.tolist().index(8)
    assert rollout.reward[second] == sum(range(16, 24)) and rollout.executed[second].nonzero().flatten().tolist() == [
        *range(8, 16)
    ]


def test_the_window_is_discounted_per_executed_step_from_its_first():
    """gamma = 0.5, d = 3: the first window runs steps 3-6 (rewards 3, 4, 5, 6): 3 + 2 + 1.25 + 0.75 = 7, and
    the next decision's value is worth 0.5^4; the last (steps 27-29): 27 + 14 + 7.25 = 48.25, worth 0.5^3."""
    rollout, _, _ = _rollout(3, aware=False, gamma=0.5)
    assert rollout.reward[0] == 7.0 and rollout.discount[0] == 0.5**4
    assert rollout.reward[-1] == 48.25 and rollout.discount[-1] == 0.5**3


def test_every_world_gets_its_own_windows():
    rollout, stats, _ = _rollout(3, aware=True, worlds=3)
    assert stats.episodes == 3 and rollout.world.tolist() == sorted([0, 1, 2] * 7)
    per_world = rollout.reward.view(3, 7)
    assert torch.equal(per_world, per_world[:1].expand(3, 7))  # the same fixed delay, the same windows


def test_a_ledger_refuses_a_discount_outside_0_1():
    with pytest.raises(ValueError, match="gamma must be in"):
        ExecutionCredit(2, gamma=0.0)
