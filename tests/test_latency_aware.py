"""Latency-aware policies (ARLI): the fast head over the committed actions and the mid-inference observation."""

import re

import pytest
import torch
from tiny_policies import TASK, make_policy

from vla_core.types import (
    OBS_COMMITTED_ACTIONS,
    OBS_COMMITTED_MASK,
    OBS_DELAY_STEPS,
    OBS_MID_STATE,
    OBS_MID_STEPS,
    OBS_STATE,
    image_key,
    mid_image_key,
)

B, D = 3, 4


def _obs(seed=0, delay=(2, 3, 0)):
    """A batch of 3 with the ARLI keys: request and mid observations differ, delays d per row."""
    g = torch.Generator().manual_seed(seed)
    delay = torch.tensor(delay)
    mask = torch.arange(D)[None] < delay[:, None]
    return {
        image_key("front"): torch.rand(B, 3, 16, 16, generator=g),
        OBS_STATE: torch.randn(B, 3, generator=g),
        "task": [TASK] * B,
        OBS_COMMITTED_ACTIONS: torch.where(mask[..., None], torch.rand(B, D, 2, generator=g), 0.0),
        OBS_COMMITTED_MASK: mask,
        OBS_DELAY_STEPS: delay,
        OBS_MID_STATE: torch.randn(B, 3, generator=g),
        mid_image_key("front"): torch.rand(B, 3, 16, 16, generator=g),
        OBS_MID_STEPS: delay // 2,
    }


def _aware(cameras=("front",), kind="diffusion"):
    policy = make_policy(kind)
    policy.add_latency_head(D, 0.5, list(cameras))
    return policy


# Every policy with an RL actor takes a fast head: the small diffusion policy and the VLA, both objectives.
KINDS = ["diffusion", "flow", "ddpm"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_new_fast_head_leaves_the_imitation_policy_exactly_as_it_was(kind):
    plain, aware = make_policy(kind), _aware(kind=kind)
    obs, noise = _obs(), torch.randn(B, 6, 2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(plain.predict_chunk(obs, noise=noise).actions, aware.predict_chunk(obs, noise=noise).actions)
    assert aware.config.latency_aware and aware.config.latency_max_delay == D and aware.config.mid_cameras == ["front"]


def test_a_policy_without_a_condition_has_no_fast_head():
    from types import SimpleNamespace

    from policies import PreTrainedPolicy

    lerobot = SimpleNamespace(config=SimpleNamespace(type="lerobot"))
    with pytest.raises(
        ValueError, match="the 'lerobot' policy has no fast head .* fine-tune it without --latency_aware"
    ):
        PreTrainedPolicy.latency_head_inputs(lerobot)


@pytest.mark.parametrize("kind", KINDS)
def test_a_trained_fast_head_reads_the_mid_observation_and_the_committed_actions_but_not_the_padding(kind):
    policy = _aware(kind=kind)
    with torch.no_grad():
        for p in policy.latency_head.mlp[-1].parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.5)
    noise = torch.randn(B, 6, 2, generator=torch.Generator().manual_seed(1))

    def chunk(obs):
        return policy.predict_chunk(obs, noise=noise).actions

    base = chunk(_obs())
    for key in (OBS_MID_STATE, mid_image_key("front"), OBS_COMMITTED_ACTIONS):
        changed = _obs()
        changed[key] = (
            changed[key] + 0.3 * changed[OBS_COMMITTED_MASK][..., None]
            if key == OBS_COMMITTED_ACTIONS
            else changed[key] + 0.3
        )
        moved = (chunk(changed) - base).abs().flatten(1).amax(1)
        assert (moved[:2] > 1e-4).all(), key  # rows with committed steps (and every row's mid observation)
    padded = _obs()
    padded[OBS_COMMITTED_ACTIONS] = torch.where(
        padded[OBS_COMMITTED_MASK][..., None], padded[OBS_COMMITTED_ACTIONS], 99.0
    )
    assert torch.equal(chunk(padded), base)  # rows outside the mask are never read


def test_missing_keys_and_delays_past_the_head_are_refused_with_the_fix():
    policy = _aware()
    obs = _obs()
    del obs[OBS_MID_STATE]
    with pytest.raises(ValueError, match=re.escape("this latency-aware policy reads observation.mid.state")):
        policy.predict_chunk(obs)
    too_long = _obs()
    too_long[OBS_COMMITTED_MASK] = torch.ones(B, D + 2, dtype=torch.bool)
    too_long[OBS_COMMITTED_ACTIONS] = torch.zeros(B, D + 2, 2)
    with pytest.raises(ValueError, match=re.escape(f"fine-tuned for delays up to {D}")):
        policy.predict_chunk(too_long)
    with pytest.raises(ValueError, match="latency-aware already"):
        policy.add_latency_head(D, 0.5, [])
    plain = make_policy("diffusion")
    with pytest.raises(ValueError, match=r"policy.mid_fraction=1.0 must be in \[0, 1\)"):
        plain.add_latency_head(D, 1.0, [])
    assert plain.latency_head is None and not plain.config.latency_aware  # a refused head changes nothing


def test_the_shell_refuses_a_delay_past_what_the_policy_was_fine_tuned_for():
    from sim.config import EnvConfig
    from sim.factory import make_env
    from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
    from vla_core.runtime.delayed_env import DelayedChunkEnv

    spec, chunking = LatencySpec.of(_aware()), ChunkingConfig(execute_steps=2)
    with make_env(EnvConfig(num_envs=1, cameras=[])) as env:
        shell = DelayedChunkEnv(env, spec, chunking, DelayModel(DelayConfig(kind="fixed", steps=D)))
        p = shell.protocol
        assert p.mid_fraction == 0.5 and p.spec.mid_cameras == ("front",) and p.width == D
        with pytest.raises(ValueError, match=re.escape(f"fine-tuned for delays up to {D}; lower the delay")):
            DelayedChunkEnv(env, spec, chunking, DelayModel(DelayConfig(kind="fixed", steps=D + 1)))
        # The robot's stricter rule holds in evaluation too: a latency-aware policy acts with latest only.
        with pytest.raises(ValueError, match="chunking.merge=ensemble is not how a latency-aware policy acts"):
            DelayedChunkEnv(env, spec, ChunkingConfig(merge="ensemble"), DelayModel(DelayConfig(kind="fixed", steps=D)))


@pytest.mark.parametrize("kind", KINDS)
def test_the_slow_part_computed_before_the_mid_observation_gives_the_same_chunk(kind):
    """On a robot the request's observation is encoded before the mid-inference one exists
    (`prepare_request`, `vla_core.types.LatencyAwarePolicy`); the chunk is the one computed from
    everything at once."""
    from vla_core.types import LatencyAwarePolicy

    policy = _aware(kind=kind)
    assert isinstance(policy, LatencyAwarePolicy)
    with torch.no_grad():
        for p in policy.latency_head.mlp[-1].parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    obs = _obs()
    request = {k: v for k, v in obs.items() if not k.startswith("observation.mid.")}
    noise = torch.randn(B, 6, 2, generator=torch.Generator().manual_seed(1))
    prepared = policy.prepare_request(request)
    together = policy.predict_chunk(obs, noise=noise).actions
    assert torch.equal(policy.predict_chunk(obs, noise=noise, prepared=prepared).actions, together)
    stale = policy.prepare_request({**request, OBS_STATE: request[OBS_STATE] + 1.0})
    assert not torch.equal(policy.predict_chunk(obs, noise=noise, prepared=stale).actions, together)


# -- the fast head fitted on demonstrations before RL (vla_rl.latency_warmup) -------------------------


def _demos(frames_per_episode=(6, 4), size=16):
    """Demonstrations in memory with values that name their frame: action i = (i, 10 i), state i =
    (i, i, i), every pixel of image i = 10 i; two episodes (frames 0-5 and 6-9)."""
    from vla_core.data import ChunkedDemos

    n = sum(frames_per_episode)
    demos = ChunkedDemos.__new__(ChunkedDemos)
    frame = torch.arange(n)
    demos.cameras = ["front"]
    demos.images = {"front": (frame * 10).to(torch.uint8)[:, None, None, None].expand(n, 3, size, size).clone()}
    demos.state = frame.float()[:, None].expand(n, 3).clone()
    demos.action = torch.stack([frame.float(), 10.0 * frame.float()], -1)
    demos.episode = torch.repeat_interleave(torch.arange(len(frames_per_episode)), torch.tensor(frames_per_episode))
    demos.task_index = torch.zeros(n, dtype=torch.long)
    demos.tasks = [TASK]
    ends = torch.cumsum(torch.tensor(frames_per_episode), 0)
    demos.episode_end = ends[demos.episode]
    return demos


def test_a_demonstration_frame_under_delay_is_what_the_shell_would_show_the_policy():
    """Frame t under delay d: committed = the demonstrated actions t .. t+d-1, the chunk = t .. t+H-1 with
    its rows j < d left out of the loss, mid observation = frame t + floor(d / 2). Worked out by hand."""
    from vla_rl.latency_warmup import delayed_sample

    idx, delays = torch.tensor([1, 4, 5, 7]), torch.tensor([2, 1, 3, 0])
    batch = delayed_sample(_demos(), idx, delays, 0.5, ["front"], horizon=4, max_delay=4)
    # request observation: frames 1, 4, 5, 7
    assert batch[OBS_STATE][:, 0].tolist() == [1.0, 4.0, 5.0, 7.0]
    assert batch[image_key("front")][:, 0, 0, 0].tolist() == pytest.approx([v / 255 for v in (10, 40, 50, 70)])
    # t=1, d=2: actions 1, 2; t=4, d=1: action 4; t=5, d=3: only action 5 (6 and 7 are the next
    # episode's); t=7, d=0: none
    assert batch[OBS_COMMITTED_MASK].tolist() == [
        [True, True, False, False], [True, False, False, False], [True, False, False, False], [False] * 4,
    ]  # fmt: skip
    assert batch[OBS_COMMITTED_ACTIONS][:, :, 0].tolist() == [[1, 2, 0, 0], [4, 0, 0, 0], [5, 0, 0, 0], [0] * 4]
    assert batch[OBS_DELAY_STEPS].tolist() == [2, 1, 3, 0]
    # row j is the action for step t + j; frames past episode 0's last (5) repeat it as padding
    assert batch["action"][:, :, 1].tolist() == [[10, 20, 30, 40], [40, 50, 50, 50], [50] * 4, [70, 80, 90, 90]]
    # padding: rows j < d (over before the chunk arrives) and rows past the episode's end
    assert batch["action_is_pad"].tolist() == [
        [True, True, False, False], [True, False, True, True], [True] * 4, [False, False, False, True],
    ]  # fmt: skip
    # mid observation: m = floor(d / 2) = 1, 0, 1, 0 -> frames 2, 4, 6 (past the end: clamped to 5; the
    # shell drops that request, and every row is padding), 7
    assert batch[OBS_MID_STATE][:, 0].tolist() == [2.0, 4.0, 5.0, 7.0]
    assert batch[mid_image_key("front")][:, 0, 0, 0].tolist() == pytest.approx([v / 255 for v in (20, 40, 50, 70)])
    assert batch[OBS_MID_STEPS].tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize("lead", [0, 2])
def test_a_demonstration_replayed_through_the_shell_gives_the_warm_up_its_samples(lead):
    """Ties `delayed_sample` to `DelayedChunkEnv`: a counting env (state = step) whose "policy" replays a
    demonstration (action at step s = 100 + s), a delay of d = 4 steps and a lead of L steps (the chunk's first
    action runs L steps after it arrives), so every request announces D = d + L and its mid observation comes
    m = floor(0.5 d) = 2 steps after it. At every request at step t >= D (before, part of the committed window
    holds: the episode's start), the shell's request state, committed actions, mask, mid state and mid steps are
    the sample of frame t, the sample trains rows D .. min(H, 30 - t) - 1 (worked out by hand from the layout),
    and each of them is the action the env then ran at step t + j. The request at step 28 dies with its 30-step
    episode before its mid observation: the shell drops it and the sample trains nothing."""
    from shells import make_shell
    from test_delay import CountingEnv

    from vla_core.data import ChunkedDemos
    from vla_core.runtime import DelayConfig, DelayModel
    from vla_core.types import ActionChunk
    from vla_rl.latency_warmup import delayed_sample

    # H covers a request's window and the next's delay (D + 4 steps), so execution never holds after the start
    length, horizon, d = 30, 8 + lead, 4
    announced = d + lead
    env = CountingEnv(length=length)
    shell = make_shell(env, horizon, 4, DelayModel(DelayConfig(kind="fixed", steps=d)), mid_fraction=0.5,
                       lead_steps=lead)  # fmt: skip
    asked = {}
    obs, need = shell.reset(seed=0)
    while len(env.applied[0]) < length:
        t = shell.obs_step.item()
        if need.item():
            asked[t] = {k: v.clone() for k, v in obs.items() if isinstance(v, torch.Tensor)}
        chunk = (100.0 + t + torch.arange(horizon, dtype=torch.float32)).reshape(1, horizon, 1)
        obs, _, _, _, _, need = shell.step(ActionChunk(chunk, shell.obs_step))
    ran = env.applied[0][:length]  # the first episode's steps 0 .. 29

    demos = ChunkedDemos.__new__(ChunkedDemos)
    frame = torch.arange(length)
    demos.cameras, demos.images, demos.tasks = [], {}, ["count"]
    demos.state, demos.action = frame.float()[:, None], (100.0 + frame.float())[:, None]
    demos.episode = demos.task_index = torch.zeros(length, dtype=torch.long)
    demos.episode_end = torch.full((length,), length)

    assert sorted(asked) == list(range(0, 28, 4))  # every 4 steps; 28's mid observation (30) never comes
    for t, seen in asked.items():
        sample = delayed_sample(demos, torch.tensor([t]), torch.tensor([announced]), 0.5, [], horizon, announced, lead)
        assert seen[OBS_STATE].item() == sample[OBS_STATE].item() == t
        assert seen[OBS_MID_STATE].item() == sample[OBS_MID_STATE].item() == t + 2
        assert seen[OBS_MID_STEPS].item() == sample[OBS_MID_STEPS].item() == 2
        if t >= announced:  # an episode's first requests find part of their window held: not reproduced
            assert torch.equal(seen[OBS_COMMITTED_MASK], sample[OBS_COMMITTED_MASK])
            assert torch.equal(seen[OBS_COMMITTED_ACTIONS], sample[OBS_COMMITTED_ACTIONS])
        trained = (~sample["action_is_pad"][0]).nonzero().flatten().tolist()
        assert trained == list(range(announced, min(horizon, length - t)))
        assert all(sample["action"][0, j, 0].item() == ran[t + j] for j in trained)
    dropped = delayed_sample(demos, torch.tensor([28]), torch.tensor([announced]), 0.5, [], horizon, announced, lead)
    assert dropped["action_is_pad"].all()


def test_the_warm_up_trains_the_fast_head_alone_and_lowers_its_loss_on_delayed_frames():
    from vla_core.runtime import DelayConfig
    from vla_rl.latency_warmup import LatencyWarmupConfig, delayed_sample, warm_up_latency_head

    demos = _demos((12, 12))
    frame = demos.action[:, 0]  # actions inside the policy's range [-2, 2] x [0, 1], still one per frame
    demos.action = torch.stack([torch.sin(frame), 0.5 + 0.5 * torch.cos(frame)], -1)
    delay = DelayConfig(kind="uniform", low=0, high=D, seed=0)
    warm = LatencyWarmupConfig(steps=150, dataset="unused here", lr=1e-2)

    def fresh():
        policy = make_policy("diffusion")
        policy.add_latency_head(D, 0.5, ["front"])
        return policy

    def held_out_loss(policy):  # fixed frames, delays, noise and timesteps
        g = torch.Generator().manual_seed(11)
        idx, d = torch.randint(0, len(demos), (256,), generator=g), torch.randint(0, D + 1, (256,), generator=g)
        with torch.no_grad():
            return policy(delayed_sample(demos, idx, d, 0.5, ["front"], 6, D), generator=g).item()

    policy = fresh()
    policy.obs_proj[0].weight.requires_grad_(False)  # handed in frozen: it must come back frozen
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    loss_before = held_out_loss(policy)
    losses = warm_up_latency_head(policy, demos, delay, 0.05, warm, seed=0)
    assert len(losses) == 150
    after = policy.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("latency_head.") for k in changed)  # the imitation policy is untouched
    assert "latency_head.mlp.4.weight" in changed
    assert [n for n, p in policy.named_parameters() if not p.requires_grad] == ["obs_proj.0.weight"]
    assert held_out_loss(policy) < 0.8 * loss_before  # measured 1.38 -> 0.97; a head left at zero stays at 1.38
    again = fresh()  # the same seed gives the same head
    again.obs_proj[0].weight.requires_grad_(False)
    warm_up_latency_head(again, demos, delay, 0.05, warm, seed=0)
    assert all(torch.equal(again.state_dict()[k], after[k]) for k in after)
