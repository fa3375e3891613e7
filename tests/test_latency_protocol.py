"""The one latency object, `LatencyProtocol`, driven directly (no shell), with values worked out by hand:
the request schedule and the measured estimate, epochs (a hold or a restart drops what was planned
before it), the mid-inference point and the arrival floor, the merge table, the augmentation's width,
guidance, and the seeding rule of the delay streams. `tests/test_latency_parity.py` runs one
end-to-end timeline through each shell."""

import pytest
import torch

from vla_core.runtime import (
    MERGES,
    ChunkingConfig,
    DelayConfig,
    DelayModel,
    LatencyProtocol,
    LatencySpec,
    check_merge,
    check_mid_fraction,
)
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_DELAY_STEPS, OBS_MID_STEPS, ActionChunk

ONE = torch.ones(1, dtype=torch.bool)


def protocol(horizon=8, steps=3, window=2, merge="latest", use="eval", max_delay=0, lead=0, **spec) -> LatencyProtocol:
    chunking = ChunkingConfig(execute_steps=steps, merge=merge, estimate_window=window, lead_steps=lead)
    return LatencyProtocol(LatencySpec(horizon=horizon, **spec), chunking, use=use, num_worlds=1, action_dim=1,
                           max_delay=max_delay)  # fmt: skip


def chunk(k: int, obs_step: int, horizon: int = 8) -> ActionChunk:
    """The k-th chunk: action j is 10 k + j."""
    return ActionChunk(
        (10 * k + torch.arange(horizon, dtype=torch.float32)).view(1, horizon, 1), torch.tensor([obs_step])
    )


def run_timeline(p: LatencyProtocol, delays: list[int], steps: int) -> tuple[list, list, list]:
    """Drive a plain policy's protocol for ``steps`` steps, request k's chunk landing ``delays[k]`` steps after it:
    (step, announced delay) per request, the action emitted per step (None: nothing queued), and each request's
    delay augmentation."""
    delays = iter(delays)
    requests, arrival, emitted, augmentation = [], None, [], []
    for step in range(steps):
        if arrival is not None and step == arrival[0]:
            assert p.receive(chunk(len(requests) - 1, arrival[1]), ONE).tolist() == [True]
            arrival = None
        if p.due()[0]:
            p.open(ONE)
            assert p.take_asked().tolist() == [True]  # a plain policy is asked at once
            requests.append((step, int(p.announced[0])))
            augmentation.append({k: v.clone() for k, v in p.augmentation.items()})
            arrival = (step + next(delays), step)
        action, valid = p.next_action()
        emitted.append(action.item() if valid else None)
    return requests, emitted, augmentation


def test_one_request_in_flight_announcing_the_largest_recent_lag():
    """Delays 2, 1, 3 steps, execute_steps 3, window 2. Request 0 at step 0 announces 0 and lands at 2
    (lag 2); request 1 is due at 3 and announces 2; it lands at 4 (lag 1); request 2 at 6 announces
    max(2, 1) = 2 and lands at 9 (lag 3); request 3, due at 9, announces max(1, 3) = 3."""
    p = protocol(committed_rows=4, max_delay=4)
    requests, emitted, augmentation = run_timeline(p, [2, 1, 3, 4], 10)
    assert requests == [(0, 0), (3, 2), (6, 2), (9, 3)]
    # chunk k conditioned on step t runs 10 k + j at step t + j, from its arrival on
    assert emitted == [None, None, 2, 3, 11, 12, 13, 14, 15, 23]
    # Request 1 (step 3, announced 2): the committed rows are chunk 0's actions for steps 3 and 4.
    assert augmentation[1][OBS_COMMITTED_ACTIONS][0, :, 0].tolist() == [3, 4, 0, 0]
    assert augmentation[1][OBS_COMMITTED_MASK].tolist() == [[True, True, False, False]]
    assert augmentation[1][OBS_DELAY_STEPS].tolist() == [2]
    assert p.estimated_delay().tolist() == [3] and p.lags.tolist() == [[1, 3]]


def test_a_lead_is_delay_announced_committed_and_measured():
    """lead_steps 1, delays 2 then 1, execute_steps 3, window 2. Request 0 at step 0 announces the lead, 1 (no lag
    yet); its chunk lands at 2 (lag 2) and takes over a step later: steps 0-2 run nothing, step 3 runs chunk 0's
    row 3. Its lag counts the lead: 3. Request 1 at step 3 announces 3: committed are steps 3, 4, 5 (3, 4, 5). It
    lands at 4 (lag 1 + 1 = 2): step 4 keeps 4, step 5 runs chunk 1's row 2 = 12. Request 2 at 6 announces
    max(3, 2) = 3. The oracle announces the true delay plus the lead."""
    p = protocol(committed_rows=4, max_delay=3, lead=1)
    requests, emitted, augmentation = run_timeline(p, [2, 1, 5], 8)
    assert requests == [(0, 1), (3, 3), (6, 3)]
    assert emitted == [None, None, None, 3, 4, 12, 13, 14]
    assert augmentation[1][OBS_COMMITTED_ACTIONS][0, :, 0].tolist() == [3, 4, 5, 0]
    assert p.lags.tolist() == [[3, 2]]
    oracle = LatencyProtocol(LatencySpec(horizon=8, n_action_steps=3, committed_rows=4),
                             ChunkingConfig(lead_steps=1), use="eval", num_worlds=1, action_dim=1, max_delay=3,
                             estimate="oracle")  # fmt: skip
    oracle.open(ONE, true_delay=torch.tensor([2]))
    assert oracle.announced.tolist() == [3]
    # A latency-aware policy's mid point is within the inference: m = floor(0.5 x (4 - 2)) = 1 for a true delay of
    # 2 with a lead of 2 (announced 4), so its chunk still arrives at step 2, not after a mid point at 2.
    aware = LatencyProtocol(LatencySpec(horizon=8, n_action_steps=3, latency_aware=True, latency_max_delay=4),
                            ChunkingConfig(lead_steps=2), use="eval", num_worlds=1, action_dim=1, max_delay=2,
                            estimate="oracle")  # fmt: skip
    aware.open(ONE, true_delay=torch.tensor([2]))
    assert aware.announced.tolist() == [4] and aware.ask_step.tolist() == [1]
    assert aware.arrival_step(torch.tensor([2])).tolist() == [2]
    # The policy must fit the delay and the lead together.
    with pytest.raises(ValueError, match=r"max_delay_steps=4 plus chunking.lead_steps=1 control steps but the "
                                         r"policy was trained for delays up to 4"):  # fmt: skip
        protocol(committed_rows=4, max_delay=4, lead=1, use="robot")


def test_a_hold_drops_the_chunk_planned_before_it():
    p = protocol(horizon=4, steps=2, window=4)
    p.open(ONE)
    p.next_action()
    p.hold(ONE)  # step 1: the robot holds; the request in flight was planned before
    assert p.in_flight.tolist() == [True] and not p.due()[0]  # still one at a time: its answer is awaited
    assert p.receive(chunk(0, 0, 4), ONE).tolist() == [False]  # dropped, its lag not counted
    assert p.lags.tolist() == [[0, 0, 0, 0]] and p.executor.queue_length().tolist() == [0]
    p.next_action()
    assert p.due()[0]  # step 2
    p.open(ONE)
    assert p.receive(chunk(1, 2, 4), ONE).tolist() == [True]  # planned after the hold: merged
    assert p.next_action()[0].item() == 10.0


def test_a_restart_forgets_the_old_episode():
    p = protocol(horizon=4, steps=2)
    p.open(ONE)
    p.next_action(), p.next_action()
    p.restart(ONE)
    assert p.step.tolist() == [0] and p.in_flight.tolist() == [False] and p.due().tolist() == [True]
    assert p.receive(chunk(0, 0, 4), ONE).tolist() == [False]  # the old episode's chunk never runs
    assert p.next_action()[1].tolist() == [False]


def test_a_latency_aware_request_is_asked_at_its_mid_point_and_lands_after_it():
    """Announcing 4 (measured), m = floor(0.5 * 4) = 2: asked at step 2 with observation.mid.steps = 2. A
    true delay of 1 would land at 1, before the fast part ran: it lands at 2 + 1 = 3; a delay of 5, at 5."""
    p = protocol(steps=4, window=4, latency_aware=True, latency_max_delay=6, mid_fraction=0.5, mid_cameras=())
    p.lags = torch.tensor([[0, 0, 0, 4]])
    p.open(ONE)
    asked = []
    for _ in range(3):
        asked.append(p.take_asked().item())
        if not asked[-1]:
            p.next_action()
    assert asked == [False, False, True] and p.ask_step.tolist() == [2]
    mid = p.mid_observation({"observation.state": torch.zeros(1, 3)})
    assert mid[OBS_MID_STEPS].tolist() == [2]
    assert p.arrival_step(torch.tensor([1])).tolist() == [3] and p.arrival_step(torch.tensor([5])).tolist() == [5]
    p.lags = torch.tensor([[0, 0, 0, 3]])  # m = floor(1.5) = 1 for the next request
    p.receive(chunk(0, 0), ONE)
    for _ in range(2):
        p.next_action()
    p.open(ONE)
    assert p.ask_step.tolist() == [p.step.item() + 1]
    # Without a mid observation every request is asked at once, and its floor is its request step.
    plain = protocol(window=4)
    plain.lags = torch.tensor([[0, 0, 0, 4]])
    plain.open(ONE)
    assert plain.take_asked().tolist() == [True] and plain.arrival_step(torch.tensor([1])).tolist() == [1]


def test_one_table_of_merges_for_every_use():
    assert MERGES["eval"]["plain"] == ("latest", "ensemble", "rtc") and MERGES["robot"] == MERGES["eval"]
    check_merge("ensemble", "eval", "plain")
    check_merge("rtc", "robot", "plain")
    for use in ("eval", "robot"):
        with pytest.raises(ValueError, match="chunking.merge=ensemble is not how a latency-aware policy acts"):
            check_merge("ensemble", use, "latency_aware")
    for kind in ("plain", "latency_aware", None):
        with pytest.raises(ValueError, match="executes actions other than the sampled chunk"):
            check_merge("rtc", "finetune", kind)
        check_merge("latest", "finetune", kind)
    with pytest.raises(ValueError, match="latency-aware"):  # the protocol reads the table when it is built
        protocol(merge="rtc", use="robot", latency_aware=True, latency_max_delay=2)


def test_the_augmentation_is_as_wide_as_the_policy_reads_and_the_largest_delay():
    assert protocol(max_delay=3).width == 3  # a plain policy under delays up to 3
    assert protocol(max_delay=3, committed_rows=5).width == 5  # trained for up to 5
    assert protocol(use="robot").width == 0  # a plain policy on a robot with no delay bound
    assert protocol(latency_aware=True, latency_max_delay=6).width == 6
    p = protocol(max_delay=3)
    p.lags[:] = 7  # announced 7 (capped at H - 1), told the widest delay it reads
    p.open(ONE)
    assert p.announced.tolist() == [7] and p.augmentation[OBS_DELAY_STEPS].tolist() == [3]


def test_guidance_only_for_rtc_and_a_policy_that_takes_it():
    assert protocol(merge="rtc", supports_inpainting=True).sends_guidance
    assert not protocol(merge="rtc").sends_guidance and not protocol(supports_inpainting=True).sends_guidance
    p = protocol(merge="rtc", supports_inpainting=True)
    p.open(ONE)
    target, weights = p.guidance
    assert target.shape == (1, 8, 1) and weights.tolist() == [[0.0] * 8]  # nothing queued yet: nothing to guide
    p.receive(chunk(0, 0), ONE)
    for _ in range(3):
        p.next_action()
    p.open(ONE)  # step 3, announcing lag 0: the queue holds chunk 0's steps 3..7
    assert p.guidance[0][0, :5, 0].tolist() == [3, 4, 5, 6, 7] and (p.guidance[1][0, :5] > 0).all()


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="the oracle delay estimate needs the true delay"):
        LatencyProtocol(LatencySpec(horizon=4, n_action_steps=2), ChunkingConfig(), use="eval", num_worlds=1, action_dim=1,
                        estimate="oracle").open(ONE)  # fmt: skip
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"mid_fraction=.* must be in \[0, 1\)"):
            check_mid_fraction(bad)
    with pytest.raises(ValueError, match="chunking.estimate_window must be >= 1"):
        ChunkingConfig(estimate_window=0).validate()


def test_the_spec_travels_as_plain_values():
    from types import SimpleNamespace

    policy = SimpleNamespace(
        config=SimpleNamespace(horizon=16, n_action_steps=8, max_delay_steps=3, latency_aware=True,
                               latency_max_delay=5, mid_fraction=0.25, mid_cameras=["front"]),
        supports_inpainting=False,
    )  # fmt: skip
    spec = LatencySpec.of(policy)
    assert (spec.committed_rows, spec.latency_max_delay, spec.mid_cameras, spec.reads) == (3, 5, ("front",), 5)
    assert LatencySpec(**spec.as_dict()) == spec
    bare = LatencySpec.of(SimpleNamespace(config=SimpleNamespace(horizon=4)))  # e.g. a LeRobot policy's config
    assert (bare.committed_rows, bare.latency_aware, bare.mid_fraction) == (0, False, 0.5)


def test_every_delay_stream_of_a_run_is_seeded_by_one_rule():
    """Stream s of a run draws what a model seeded ``seed + s`` draws, so a data-parallel process or a
    rollout worker has its own delays and the same run draws them again."""
    cfg = DelayConfig(kind="uniform", high=9, seed=5)
    drawn = DelayModel(cfg, stream=3).sample(20)
    assert torch.equal(drawn, DelayModel(DelayConfig(kind="uniform", high=9, seed=8)).sample(20))
    assert not torch.equal(drawn, DelayModel(cfg).sample(20))


def test_the_delay_streams_are_saved_and_restored():
    """A resumed run draws on where it stopped: the state of every generator the model owns (the CPU's
    here; an accelerator's in `benchmarks/gpu_smoke.py`) restores into a fresh model."""
    model = DelayModel(DelayConfig(kind="uniform", high=9, seed=5), stream=2)
    model.sample(7)
    state = model.state_dict()
    expected = model.sample(20)
    fresh = DelayModel(DelayConfig(kind="uniform", high=9, seed=5))
    assert not torch.equal(fresh.sample(20), expected)
    fresh.load_state_dict(state)
    assert list(state) == ["cpu"] and torch.equal(fresh.sample(20), expected)


def test_saved_lags_come_back_only_under_the_lead_they_count():
    """A lag counts the lead its chunk waited (step - obs_step + L), so lags measured with L = 2 mean a delay 2 steps
    shorter under L = 0: restoring them there is refused, naming the setting; under L = 2 they come back as saved.
    A bare tensor (saved before the lead was) names none: it comes back under any lead, as before the change."""
    measured = protocol(lead=2)
    measured.lags = torch.tensor([[5, 6]])
    saved = measured.saved_lags()
    assert saved["lead_steps"] == 2
    with pytest.raises(
        ValueError, match=r"run.pt measured its delays with chunking.lead_steps=2 .*--chunking.lead_steps=2, not 0"
    ):
        protocol(lead=0).restore_lags(saved, "run.pt")
    same = protocol(lead=2)
    same.restore_lags(saved, "run.pt")
    assert same.lags.tolist() == [[5, 6]] and same.estimated_delay().tolist() == [6]
    for lead in (0, 2):
        bare = protocol(lead=lead)
        bare.restore_lags(torch.tensor([[1, 3]]), "old.pt")
        assert bare.lags.tolist() == [[1, 3]]
