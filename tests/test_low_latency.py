"""ARLI's low-latency policy: it acts every control step inside the window, from step 0, on the freshest
observation and the protocol's context; it starts as the slow policy; RL trains it alone, per control step."""

import pytest
import torch
from shells import CountingEnv, make_shell

from sim.config import EnvConfig
from vla_core.runtime import DelayConfig, DelayModel
from vla_core.types import ActionChunk
from vla_rl.finetune import FinetuneConfig, finetune
from vla_rl.rl.ppo import PPOConfig


class _Recorder:
    """A step policy that adds 100 to every action and keeps what it was given."""

    def __init__(self):
        self.seen = []

    def __call__(self, obs, base, context):
        self.seen.append((obs["observation.state"][0, 0].item(), base[0, 0].item(), context.plan_age[0].item(),
                          context.since_request[0].item(), context.queued[0].tolist()))  # fmt: skip
        return base + 100


def test_the_step_policy_acts_at_every_control_step_from_the_first_with_the_plans_age():
    """d = 3, 4 steps a chunk, chunks of 6 rows, row j of the chunk asked at t is t + j. Steps 0-2 hold (-1) with
    no plan (age -1); chunk 0 arrives at 3 (row 3: its information 3 steps old); the request of step 4 is 0
    steps old there while chunk 0's row 4 runs (age 4); at step 6 chunk 0 has run out (its 6 rows end at step
    5): the shell holds (-1), the plan is its, 6 steps old; chunk 1 (asked at 4) takes over at 7 (age 3). The
    state is the step: the step policy always reads the world as it is now."""
    env = CountingEnv()
    recorder = _Recorder()
    spec_shell = make_shell(env, 6, 4, DelayModel(DelayConfig(kind="fixed", steps=3)), low_latency_rows=3,
                            step_policy=recorder)  # fmt: skip
    spec_shell.reset(seed=0)
    for _ in range(3):
        steps = spec_shell.obs_step
        chunk = (steps[:, None] + torch.arange(6)).float()[..., None]
        spec_shell.step(ActionChunk(chunk, steps))
    state, base, age, since, queued = zip(*recorder.seen[:9], strict=True)
    assert state == tuple(float(t) for t in range(9))
    assert base == (-1, -1, -1, 3, 4, 5, -1, 7, 8)  # the queue's (or the hold) action, before the correction
    assert age == (-1, -1, -1, 3, 4, 5, 6, 3, 4) and since == (0, 1, 2, 3, 0, 1, 2, 3, 0)
    assert queued[2] == [False] * 3 and queued[3] == [True] * 3 and queued[5] == [True, False, False]
    assert queued[6] == [False] * 3
    assert env.applied[0][:9] == [b + 100 for b in base]  # what ran is the step policy's


def test_a_shell_refuses_a_low_latency_policy_without_its_step_policy_and_the_reverse():
    env = CountingEnv()
    with pytest.raises(ValueError, match="give the shell its step policy"):
        make_shell(env, 6, 4, DelayModel(DelayConfig()), low_latency_rows=3)
    with pytest.raises(ValueError, match="has no low-latency part"):
        make_shell(env, 6, 4, DelayModel(DelayConfig()), step_policy=_Recorder())


def test_a_new_low_latency_part_leaves_the_slow_policys_actions_exactly(tiny_checkpoint):
    from vla_core.runtime.protocol import StepContext
    from vla_rl.checkpoint import load_policy

    policy, _ = load_policy(tiny_checkpoint[0])
    policy.add_low_latency(rows=4, max_age=12, cameras=list(policy.config.cameras))
    n, a, size = 3, policy.config.action_dim, policy.config.image_size
    obs = {"observation.state": torch.randn(n, policy.config.state_dim),
           **{f"observation.images.{c}": torch.rand(n, 3, size, size) for c in policy.config.cameras}}  # fmt: skip
    base = torch.randn(n, a) * 0.05 + 0.3
    context = StepContext(torch.randn(n, 4, a), torch.ones(n, 4, dtype=torch.bool), torch.tensor([-1, 3, 7]),
                          torch.tensor([0, 2, 5]))  # fmt: skip
    torch.testing.assert_close(policy.low_latency_step(obs, base, context), base, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        policy.low_latency.mean.bias.fill_(0.1)  # a correction of 0.1 in normalized units on every dimension
    moved = policy.low_latency_step(obs, base, context)
    expected = policy.unnormalize_action(policy.normalize_action(base) + 0.1)
    torch.testing.assert_close(moved, expected)
    with pytest.raises(ValueError, match="has a low-latency part already"):
        policy.add_low_latency(rows=4, max_age=12, cameras=list(policy.config.cameras))


def test_low_latency_rl_trains_the_fast_part_alone_per_control_step_and_the_checkpoint_runs_it(
    tiny_checkpoint, tmp_path
):
    """Two iterations of one episode per world (12 steps, d = 2): each control step is a decision (4 worlds x 12
    steps = 48 per iteration), the slow policy's weights do not move and the part's do; the checkpoint rebuilds
    the part, and `vla-rl eval` runs it deterministically (the mean correction) through the same protocol."""
    from safetensors.torch import load_file

    from vla_rl.checkpoint import load_policy
    from vla_rl.eval import EvalConfig, evaluate

    cfg = FinetuneConfig(
        checkpoint=str(tiny_checkpoint[0]), env=EnvConfig(num_envs=4, max_episode_steps=12), iterations=2,
        update_epochs=1, minibatch_size=16, eval_every=0, output_dir=str(tmp_path / "run"), num_threads=2,
        log_with="none", low_latency=True, delay=DelayConfig(kind="fixed", steps=2),
        ppo=PPOConfig(critic_warmup_iterations=0, episodes_per_world=1),
    )  # fmt: skip
    summary = finetune(cfg)
    assert [h["decisions"] for h in summary["history"]] == [48, 48] and summary["env_steps"] == 96
    policy, _ = load_policy(tmp_path / "run")
    assert policy.config.low_latency and policy.config.low_latency_rows == policy.config.horizon
    assert policy.config.low_latency_max_age == 2 + policy.config.n_action_steps
    before = load_file(str(tiny_checkpoint[0] / "checkpoints/last/pretrained_model/model.safetensors"))
    after = load_file(str(tmp_path / "run/checkpoints/last/pretrained_model/model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the slow policy: frozen
    assert any(not torch.equal(after[k], torch.zeros_like(after[k])) for k in after if k.startswith("low_latency.mean"))
    result = evaluate(EvalConfig(checkpoint=str(tmp_path / "run"), env=EnvConfig(num_envs=2, max_episode_steps=12),
                                 num_episodes=2, delay=DelayConfig(kind="fixed", steps=2),
                                 output_dir=str(tmp_path / "eval"), video_episodes=0))  # fmt: skip
    assert result["episodes"] == 2  # the shell was given the part's step policy (it refuses to run without)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"algo": "grpo"}, "drop --algo=grpo"), ({"latency_aware": True}, "drop --latency_aware=true"),
        ({"ppo": PPOConfig(kl_coef=0.1)}, "drop --ppo.kl_coef"), ({"low_latency_rows": -1}, "must be >= 0"),
    ],
)  # fmt: skip
def test_bad_low_latency_flags_get_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        FinetuneConfig(low_latency=True, **overrides).validate()
    with pytest.raises(ValueError, match="shapes the fast part of --low_latency=true"):
        FinetuneConfig(low_latency_rows=4).validate()


@pytest.mark.parametrize(("d", "s"), [(3, 4), (8, 4), (2, 4)])
def test_the_warm_ups_window_layout_is_the_shells(d, s):
    """The warm-up lays a demonstration out as the shell runs an episode: for every step, the plan's age and the
    steps since the request equal what the protocol tells the step policy (a counting env, chunks of 16)."""
    from vla_core.runtime.delayed_env import window_layout

    env, recorder = CountingEnv(length=40), _Recorder()
    shell = make_shell(env, 16, s, DelayModel(DelayConfig(kind="fixed", steps=d)), low_latency_rows=2,
                       step_policy=recorder)  # fmt: skip
    shell.reset(seed=0)
    while len(env.applied[0]) < 40:
        shell.step(ActionChunk(torch.zeros(1, 16, 1), shell.obs_step))
    _, _, age, since, _ = zip(*recorder.seen[:40], strict=True)
    request, layout_age, layout_since = window_layout(torch.arange(40), d, s)
    assert layout_age.tolist() == list(age) and layout_since.tolist() == list(since)
    assert request.tolist()[: d + 1] == [-1] * d + [0]


def test_the_warm_up_moves_the_plan_toward_what_the_demonstrator_did(tiny_checkpoint, tiny_dataset):
    """After the warm-up, on the demonstrations' frames the corrected action is nearer the demonstrated one than
    the slow policy's plan row it corrects (the squared error in normalized units falls by a third or more)."""
    from vla_core.data import ChunkedDemos, open_dataset
    from vla_core.runtime.delayed_env import window_layout
    from vla_rl.checkpoint import load_policy
    from vla_rl.latency_warmup import LatencyWarmupConfig
    from vla_rl.low_latency_warmup import _episode_start, slow_chunks, warm_up_low_latency, warmup_batch

    policy, _ = load_policy(tiny_checkpoint[0])
    policy.add_low_latency(rows=4, max_age=12, cameras=list(policy.config.cameras))
    demos = ChunkedDemos(open_dataset(str(tiny_dataset[0])), list(policy.config.cameras))
    torch.manual_seed(0)
    losses = warm_up_low_latency(policy, demos, 3, 4, LatencyWarmupConfig(steps=150, batch_size=32, lr=3e-3), seed=0)
    assert len(losses) == 150
    frames = torch.arange(1, len(demos))
    starts = _episode_start(demos, frames)
    request, _, _ = window_layout(frames - starts, 3, 4)
    windows = torch.unique((starts + request)[request >= 0])
    chunks = dict(zip(windows.tolist(), slow_chunks(policy, demos, windows), strict=True))
    inputs, target = warmup_batch(policy, demos, chunks, frames, 3, 4)
    with torch.no_grad():
        after = (policy.low_latency(inputs)[0] - target).square().sum(-1).mean()
    assert after < 0.67 * target.square().sum(-1).mean()
