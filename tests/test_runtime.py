"""ActionChunkExecutor: merge rules, env masks, delay augmentation and input checks, with hand-computed numbers;
ChunkingConfig: steps per chunk and its checks."""

import math

import pytest
import torch

from vla_core.runtime import ActionChunkExecutor, ChunkingConfig, rtc_blend_weights, rtc_weights
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_DELAY_STEPS, ActionChunk


def chunk(values, obs_step):
    """One-env, one-dim chunk: values (H,) -> actions (1, H, 1)."""
    return ActionChunk(torch.tensor(values, dtype=torch.float32).view(1, -1, 1), torch.tensor([obs_step]))


def drain(ex, n):
    """Emit n steps of a one-env, one-dim executor: ([action, ...], [valid, ...])."""
    actions, valids = [], []
    for _ in range(n):
        a, v = ex.next_action()
        actions.append(a.item())
        valids.append(v.item())
    return actions, valids


# ---- latest-only ---------------------------------------------------------------------------


def test_latest_emits_chunk_in_order_then_holds_last_action():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4)
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))
    assert ex.queue_length().tolist() == [4]
    actions, valids = drain(ex, 6)
    assert actions == [1, 2, 3, 4, 4, 4]
    assert valids == [True, True, True, True, False, False]
    assert ex.step.tolist() == [6]
    assert ex.queue_length().tolist() == [0]


def test_latest_new_chunk_replaces_future():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4)
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))
    assert drain(ex, 2)[0] == [1, 2]
    ex.add_chunk(chunk([10, 20, 30, 40], obs_step=2))  # covers steps 2..5, replaces 3, 4
    assert drain(ex, 5) == ([10, 20, 30, 40, 40], [True, True, True, True, False])


def test_latest_discards_queue_past_new_chunk():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4)
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))
    drain(ex, 1)
    ex.add_chunk(chunk([10, 20], obs_step=1))  # covers steps 1, 2; old action 4 for step 3 is dropped
    assert ex.queue_length().tolist() == [2]
    assert drain(ex, 3) == ([10, 20, 20], [True, True, False])


def test_latest_late_chunk_drops_past_actions():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4)
    # Nothing queued yet: invalid, holding zeros.
    assert drain(ex, 2) == ([0, 0], [False, False])
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))  # arrives at step 2: actions 1, 2 are in the past
    assert ex.queue_length().tolist() == [2]
    assert drain(ex, 3) == ([3, 4, 4], [True, True, False])


def test_held_action_is_not_aliased_by_caller_edits():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=2)
    ex.add_chunk(chunk([5], obs_step=0))
    a, _ = ex.next_action()
    a.zero_()
    a, v = ex.next_action()
    assert (a.item(), v.item()) == (5.0, False)


# ---- temporal ensembling -------------------------------------------------------------------


def test_ensemble_zero_coeff_is_plain_mean():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, merge="ensemble", ensemble_coeff=0.0)
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))  # steps 0..3
    assert drain(ex, 1)[0] == [1]
    ex.add_chunk(chunk([10, 20, 30, 40], obs_step=1))  # steps 1..4
    # step 1: (2 + 10) / 2 = 6; step 2: (3 + 20) / 2 = 11.5; step 3: (4 + 30) / 2 = 17; step 4: only 40
    actions, valids = drain(ex, 5)
    assert actions == pytest.approx([6.0, 11.5, 17.0, 40.0, 40.0])
    assert valids == [True, True, True, True, False]


def test_ensemble_older_predictions_weigh_more():
    # c = ln 2: weights 1, 1/2, 1/4 for the oldest, second and third prediction of a step.
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, merge="ensemble", ensemble_coeff=math.log(2))
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))  # A: steps 0..3
    ex.add_chunk(chunk([10, 20, 30, 40], obs_step=0))  # B: steps 0..3, second prediction
    # step 0: (1*1 + 10*0.5) / 1.5 = 6 / 1.5 = 4
    assert drain(ex, 1)[0] == pytest.approx([4.0])


def test_ensemble_three_overlapping_chunks():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, merge="ensemble", ensemble_coeff=math.log(2))
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))  # A: steps 0..3
    a0, _ = drain(ex, 1)
    ex.add_chunk(chunk([10, 20, 30, 40], obs_step=1))  # B: steps 1..4
    a1, _ = drain(ex, 1)
    ex.add_chunk(chunk([100, 200, 300, 400], obs_step=2))  # C: steps 2..5
    assert ex.queue_length().tolist() == [4]
    rest, valids = drain(ex, 5)
    expected = [
        1.0,  # step 0: A only
        7.0 / 1.5,  # step 1: (2*1 + 10*0.5) / 1.5 = 4.667
        38.0 / 1.75,  # step 2: (3*1 + 20*0.5 + 100*0.25) / 1.75 = (3 + 10 + 25) / 1.75 = 21.714
        69.0 / 1.75,  # step 3: (4*1 + 30*0.5 + 200*0.25) / 1.75 = (4 + 15 + 50) / 1.75 = 39.429
        190.0 / 1.5,  # step 4: (40*1 + 300*0.5) / 1.5 = 126.667
        400.0,  # step 5: C only
        400.0,  # step 6: nothing queued, hold
    ]
    assert a0 + a1 + rest == pytest.approx(expected)
    assert valids == [True, True, True, True, False]


def test_ensemble_late_chunk_only_adds_future_steps():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, merge="ensemble", ensemble_coeff=0.0)
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))
    drain(ex, 2)
    ex.add_chunk(chunk([10, 20, 30, 40], obs_step=0))  # arrives at step 2: 10, 20 are in the past
    # step 2: (3 + 30) / 2 = 16.5; step 3: (4 + 40) / 2 = 22
    assert drain(ex, 3) == ([16.5, 22.0, 22.0], [True, True, False])


# ---- real-time chunking --------------------------------------------------------------------


def soft(c):
    """The RTC decay c (e^c - 1) / (e - 1) at one value of c."""
    return c * (math.exp(c) - 1) / (math.e - 1)


def test_rtc_weights_hand_computed():
    # H = 8, s = 2, d = 2: overlap indices 2..5, c_i = (6 - i) / 5 = 0.8, 0.6, 0.4, 0.2.
    # H = 6, s = 3, d = 1: overlap indices 1..2, c_i = (3 - i) / 3 = 2/3, 1/3.
    # H = 4, s = 1, d = 0: overlap indices 0..2, c_i = (3 - i) / 4 = 3/4, 1/2, 1/4.
    # H = 4, s = 2, d = 3: the frozen prefix covers the whole overlap (H - s = 2 <= d).
    cases = [
        (8, 2, 2, [1, 1, 0.570589, 0.287072, 0.114492, 0.025770, 0, 0]),
        (6, 3, 1, [1, 0.367706, 0.076746, 0, 0, 0]),
        (4, 1, 0, [0.487551, 0.188770, 0.041324, 0]),
        (4, 2, 3, [1, 1, 1, 0]),
    ]
    for H, s, d, expected in cases:
        w = rtc_weights(H, torch.tensor([d]), torch.tensor([s]))
        assert w.shape == (1, H)
        assert w[0].tolist() == pytest.approx(expected, abs=1e-6), (H, s, d)
    assert soft(0.8) == pytest.approx(0.570589, abs=1e-6)  # the decay formula itself, checked once


def test_rtc_weights_batched_rows_are_independent():
    w = rtc_weights(6, torch.tensor([1, 0]), torch.tensor([3, 1]))
    assert w[0].tolist() == pytest.approx([1, soft(2 / 3), soft(1 / 3), 0, 0, 0])
    assert w[1].tolist() == pytest.approx([soft(5 / 6), soft(4 / 6), soft(3 / 6), soft(2 / 6), soft(1 / 6), 0])


HI, LO = (1 + math.cos(math.pi / 4)) / 2, (1 + math.cos(3 * math.pi / 4)) / 2  # 0.853553, 0.146447


def test_rtc_blend_weights_ease_out_of_the_frozen_prefix():
    # d = 1, end = 4: W_i = (1 + cos(pi * i / 4)) / 2 for i = 1..3.
    w = rtc_blend_weights(6, torch.tensor([1]), torch.tensor([4]))
    assert w[0].tolist() == pytest.approx([1, 0.853553, 0.5, 0.146447, 0, 0], abs=1e-6)
    # No overlap left (end <= d): only the frozen prefix.
    assert rtc_blend_weights(4, torch.tensor([3]), torch.tensor([2]))[0].tolist() == [1, 1, 1, 0]


def test_rtc_blends_overlap_toward_previous_chunk():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=6, merge="rtc")
    ex.add_chunk(chunk([1, 2, 3, 4, 5, 6], obs_step=0))  # old plan: steps 0..5
    assert drain(ex, 3)[0] == [1, 2, 3]
    # Requested at step 2, arrives at step 3 (d = 1). The old plan still holds steps 3..5 = chunk
    # indices 1..3, so it ends at index 4 and W_i = (1 + cos(pi * i / 4)) / 2.
    ex.add_chunk(chunk([10, 20, 30, 40, 50, 60], obs_step=2))  # new plan: steps 2..7, 10 is past
    actions, valids = drain(ex, 6)
    assert actions == pytest.approx(
        [
            HI * 4 + LO * 20,  # step 3, i = 1: 0.853553 * 4 + 0.146447 * 20 = 6.343146
            0.5 * 5 + 0.5 * 30,  # step 4, i = 2: 17.5
            LO * 6 + HI * 40,  # step 5, i = 3: 0.146447 * 6 + 0.853553 * 40 = 35.020815
            50.0,  # step 6: no old action, the new chunk alone
            60.0,  # step 7
            60.0,  # step 8: nothing queued, hold
        ],
    )
    assert valids == [True] * 5 + [False]


def test_rtc_with_empty_queue_and_short_chunk_behaves_like_latest():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, merge="rtc")
    ex.add_chunk(chunk([1, 2], obs_step=0))  # nothing queued: taken as is
    assert drain(ex, 1)[0] == [1]
    # H = 1, d = 0, the old plan reaches index 1: W_0 = (1 + cos(pi / 2)) / 2 = 1/2.
    ex.add_chunk(chunk([7], obs_step=1))
    blended = 0.5 * 2 + 0.5 * 7
    assert drain(ex, 2) == ([pytest.approx(blended), pytest.approx(blended)], [True, False])
    # A longer chunk than the old plan: the old tail does not survive past the new chunk either.
    ex.add_chunk(chunk([5, 6, 7, 8], obs_step=3))
    ex.add_chunk(chunk([9], obs_step=3))
    assert ex.queue_length().tolist() == [1]


def test_rtc_guidance_aligns_queue_to_a_request_made_now():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=6, merge="rtc")
    ex.add_chunk(chunk([1, 2, 3, 4, 5, 6], obs_step=0))
    drain(ex, 2)  # steps 2..5 are queued: [3, 4, 5, 6]
    target, weights = ex.rtc_guidance(torch.tensor([1]), execute_steps=2)
    assert target.shape == (1, 6, 1)
    assert target.flatten().tolist() == [3, 4, 5, 6, 0, 0]
    # d = 1, H - s = 4: [1, soft(3/4), soft(2/4), soft(1/4), 0, 0]; slots 4, 5 are empty anyway.
    assert weights[0].tolist() == pytest.approx([1, soft(3 / 4), soft(2 / 4), soft(1 / 4), 0, 0])
    # Nothing queued: all weights zero, whatever the delay.
    ex.discard_queue()
    assert ex.rtc_guidance(torch.tensor([3]), execute_steps=2)[1].abs().sum() == 0
    with pytest.raises(ValueError, match="execute_steps"):
        ex.rtc_guidance(torch.tensor([1]), execute_steps=7)


def test_discard_queue_keeps_step_and_held_action():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4)
    ex.add_chunk(chunk([1, 2, 3], obs_step=0))
    drain(ex, 1)
    ex.discard_queue()
    assert ex.queue_length().tolist() == [0]
    assert drain(ex, 1) == ([1.0], [False])
    assert ex.step.tolist() == [2]
    # From slot 1 on only: step 2 keeps 3, step 3 loses 4.
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))
    ex.discard_queue(from_slot=1)
    assert drain(ex, 2) == ([3.0, 3.0], [True, False])


# ---- a lead before a chunk takes over ------------------------------------------------------


def test_latest_with_a_lead_keeps_the_steps_before_it_and_plans_from_it():
    """lead_steps 2, horizon 6. Chunk A (obs 0) arrives at step 0: slots 0, 1 keep the empty queue, steps 2-5 run
    A's rows 2-5 = 3, 4, 5, 6. Chunk B (obs 1, rows 10..15) arrives at step 2 (lag 1): steps 2, 3 keep 3, 4; steps
    4, 5, 6 run B's rows 3, 4, 5 = 13, 14, 15 (A's 6 for step 5 is replaced); B has no row for step 7."""
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=6, lead_steps=2)
    ex.add_chunk(chunk([1, 2, 3, 4, 5, 6], obs_step=0))
    assert drain(ex, 2) == ([0, 0], [False, False])
    ex.add_chunk(chunk([10, 11, 12, 13, 14, 15], obs_step=1))
    actions, queued = ex.plan()  # from step 2 + 2 = 4 on
    assert queued.tolist() == [3] and actions[0, :, 0].tolist() == [13, 14, 15, 0]
    assert drain(ex, 6) == ([3, 4, 13, 14, 15, 15], [True] * 5 + [False])


def test_ensemble_with_a_lead_averages_only_from_the_lead_on():
    """lead 1, coefficient 0 (plain mean). A = 1..4 (obs 0) at step 0 queues steps 1-3 as 2, 3, 4; step 0 runs
    nothing. B = 10, 20, 30, 40 (obs 1) at step 1 (lag 0): step 1 keeps 2; step 2 = (3 + 20) / 2 = 11.5, step 3 =
    (4 + 30) / 2 = 17, step 4 = 40 (B alone)."""
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, merge="ensemble", ensemble_coeff=0.0, lead_steps=1)
    ex.add_chunk(chunk([1, 2, 3, 4], obs_step=0))
    assert drain(ex, 1) == ([0], [False])
    ex.add_chunk(chunk([10, 20, 30, 40], obs_step=1))
    assert drain(ex, 5) == ([2, 11.5, 17, 40, 40], [True] * 4 + [False])


def test_rtc_with_a_lead_freezes_lag_plus_lead_and_eases_in_after():
    """lead 1, horizon 6. A = 1..6 (obs 0) at step 0 queues steps 1-5 as 2..6; steps 0-2 emit nothing, 2, 3. B =
    10..60 (obs 2) at step 3: lag 1, frozen prefix d = lag + lead = 2, the old plan (steps 3-5, 3 queued) ends at
    chunk index lag + 3 = 4; W_i = (1 + cos(pi (i - d + 1) / (4 - d + 1))) / 2 for d <= i < 4: 0.75 at i = 2, 0.25
    at i = 3. Step 3 keeps 4 (the lead); step 4 (i = 2) = 0.75 * 5 + 0.25 * 30 = 11.25; step 5 (i = 3) = 0.25 * 6 +
    0.75 * 40 = 31.5; steps 6, 7 = 50, 60 (nothing old)."""
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=6, merge="rtc", lead_steps=1)
    ex.add_chunk(chunk([1, 2, 3, 4, 5, 6], obs_step=0))
    assert drain(ex, 3) == ([0, 2, 3], [False, True, True])
    ex.add_chunk(chunk([10, 20, 30, 40, 50, 60], obs_step=2))
    actions, valids = drain(ex, 6)
    assert actions == pytest.approx([4, 11.25, 31.5, 50, 60, 60]) and valids == [True] * 5 + [False]


def test_rtc_after_empty_lead_slots_blends_with_the_plan_queued_past_them():
    """lead 2, horizon 6. A = 1..6 (obs 0) at step 0 leaves steps 0, 1 empty and queues steps 2-5 as 3..6; after
    step 0 the queue holds steps 2-5 in slots 1-4 (queue_length 0: slot 0 is empty; queue_end 5). B = 10..60 (obs 1)
    at step 1: lag 0, frozen prefix d = 0 + 2, the old plan ends at chunk index 0 + 5; W_i = (1 + cos(pi (i - 1) /
    4)) / 2 for 2 <= i < 5: 0.853553, 0.5, 0.146447. Step 2 keeps 3; step 3 = 0.853553 * 4 + 0.146447 * 30 =
    7.807612; step 4 = 0.5 * 5 + 0.5 * 40 = 22.5; step 5 = 0.146447 * 6 + 0.853553 * 50 = 43.556349; step 6 = 60."""
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=6, merge="rtc", lead_steps=2)
    ex.add_chunk(chunk([1, 2, 3, 4, 5, 6], obs_step=0))
    drain(ex, 1)
    assert (ex.queue_length().item(), ex.queue_end().item()) == (0, 5)
    ex.add_chunk(chunk([10, 20, 30, 40, 50, 60], obs_step=1))
    actions, valids = drain(ex, 7)
    assert actions == pytest.approx([0, 3, 7.807612, 22.5, 43.556349, 60, 60], abs=1e-5)
    assert valids == [False] + [True] * 5 + [False]


def test_a_lead_must_leave_a_chunk_something_to_run():
    with pytest.raises(ValueError, match=r"lead_steps must be in \[0, horizon=4\), got 4"):
        ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, lead_steps=4)
    with pytest.raises(ValueError, match="chunking.lead_steps must be >= 0"):
        ChunkingConfig(lead_steps=-1).validate()


# ---- env masks and reset -------------------------------------------------------------------


def test_env_mask_and_reset_touch_only_selected_envs():
    ex = ActionChunkExecutor(num_envs=3, action_dim=2, horizon=4)
    actions = torch.tensor(
        [
            [[1.0, -1.0], [2.0, -2.0], [3.0, -3.0]],
            [[4.0, -4.0], [5.0, -5.0], [6.0, -6.0]],
            [[7.0, -7.0], [8.0, -8.0], [9.0, -9.0]],
        ]
    )  # (3, 3, 2)
    ex.add_chunk(ActionChunk(actions, torch.zeros(3, dtype=torch.long)), env_mask=torch.tensor([True, False, True]))
    assert ex.queue_length().tolist() == [3, 0, 3]

    a, v = ex.next_action()
    assert v.tolist() == [True, False, True]
    assert a.tolist() == [[1.0, -1.0], [0.0, 0.0], [7.0, -7.0]]

    ex.reset(env_mask=torch.tensor([True, False, False]))
    assert ex.step.tolist() == [0, 1, 1]
    assert ex.queue_length().tolist() == [0, 0, 2]
    a, v = ex.next_action()
    assert v.tolist() == [False, False, True]
    # env 0 was reset, so it holds zeros rather than its old action [1, -1].
    assert a.tolist() == [[0.0, 0.0], [0.0, 0.0], [8.0, -8.0]]

    ex.reset()
    assert ex.step.tolist() == [0, 0, 0]
    assert ex.queue_length().tolist() == [0, 0, 0]
    a, v = ex.next_action()
    assert v.tolist() == [False, False, False]
    assert a.tolist() == [[0.0, 0.0]] * 3


# ---- delay augmentation --------------------------------------------------------------------


def test_delay_augmentation_rows_and_mask():
    ex = ActionChunkExecutor(num_envs=3, action_dim=1, horizon=4, max_delay=3)
    actions = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).unsqueeze(-1)  # (3, 3, 1)
    ex.add_chunk(ActionChunk(actions, torch.zeros(3, dtype=torch.long)))
    ex.next_action()  # step 1: queues are [2, 3], [5, 6], [8, 9]

    # env 0: d = 0, nothing committed; env 1: d = 1 < queue 2; env 2: d = 3 > queue 2.
    aug = ex.delay_augmentation(torch.tensor([0, 1, 3]))
    assert aug[OBS_COMMITTED_ACTIONS].shape == (3, 3, 1)
    assert aug[OBS_COMMITTED_ACTIONS].squeeze(-1).tolist() == [[0, 0, 0], [5, 0, 0], [8, 9, 0]]
    assert aug[OBS_COMMITTED_MASK].tolist() == [[False] * 3, [True, False, False], [True, True, False]]
    assert aug[OBS_DELAY_STEPS].dtype == torch.long
    assert aug[OBS_DELAY_STEPS].tolist() == [0, 1, 3]


def test_delay_augmentation_uses_ensembled_actions():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, merge="ensemble", ensemble_coeff=0.0, max_delay=2)
    ex.add_chunk(chunk([1, 2], obs_step=0))
    ex.add_chunk(chunk([3, 4], obs_step=0))
    aug = ex.delay_augmentation(torch.tensor([2]))
    # step 0: (1 + 3) / 2 = 2; step 1: (2 + 4) / 2 = 3
    assert aug[OBS_COMMITTED_ACTIONS].flatten().tolist() == [2.0, 3.0]
    assert aug[OBS_COMMITTED_MASK].tolist() == [[True, True]]


def test_delay_augmentation_max_delay_beyond_horizon_is_padded():
    ex = ActionChunkExecutor(num_envs=1, action_dim=1, horizon=2, max_delay=4)
    ex.add_chunk(chunk([1, 2], obs_step=0))
    aug = ex.delay_augmentation(torch.tensor([4]))
    assert aug[OBS_COMMITTED_ACTIONS].flatten().tolist() == [1, 2, 0, 0]
    assert aug[OBS_COMMITTED_MASK].tolist() == [[True, True, False, False]]


# ---- input checks --------------------------------------------------------------------------


def test_rejects_bad_chunks_and_leaves_queue_unchanged():
    ex = ActionChunkExecutor(num_envs=2, action_dim=3, horizon=4)
    steps = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"action_dim=3.*got \(2, 4, 2\)"):
        ex.add_chunk(ActionChunk(torch.zeros(2, 4, 2), steps))
    with pytest.raises(ValueError, match=r"num_envs=2.*got \(3, 4, 3\)"):
        ex.add_chunk(ActionChunk(torch.zeros(3, 4, 3), torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"\[1, 4\], got 5"):
        ex.add_chunk(ActionChunk(torch.zeros(2, 5, 3), steps))
    nan = torch.zeros(2, 4, 3)
    nan[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ex.add_chunk(ActionChunk(nan, steps))
    with pytest.raises(ValueError, match="ahead of executor step"):
        ex.add_chunk(ActionChunk(torch.zeros(2, 4, 3), torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="env_mask"):
        ex.add_chunk(ActionChunk(torch.zeros(2, 4, 3), steps), env_mask=torch.tensor([1, 0]))
    assert ex.queue_length().tolist() == [0, 0]


def test_rejects_bad_delay_steps():
    ex = ActionChunkExecutor(num_envs=2, action_dim=1, horizon=4, max_delay=2)
    with pytest.raises(ValueError, match=r"\[0, max_delay=2\], got \[0, 3\]"):
        ex.delay_augmentation(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="max_delay"):
        ex.delay_augmentation(torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        ex.delay_augmentation(torch.tensor([1]))


def test_rejects_unknown_merge_mode():
    with pytest.raises(ValueError, match="merge must be one of"):
        ActionChunkExecutor(num_envs=1, action_dim=1, horizon=4, merge="average")


def test_rows_outside_the_mask_may_hold_any_obs_step():
    # Row 1 is not selected and its obs_step (99) is ahead of its step: it must be ignored, not rejected.
    ex = ActionChunkExecutor(num_envs=2, action_dim=1, horizon=3)
    actions = torch.tensor([[[1.0], [2.0], [3.0]], [[7.0], [8.0], [9.0]]])
    ex.add_chunk(ActionChunk(actions, torch.tensor([0, 99])), env_mask=torch.tensor([True, False]))
    emitted, valid = ex.next_action()
    assert emitted[:, 0].tolist() == [1.0, 0.0]
    assert valid.tolist() == [True, False]


def test_the_chunking_settings_follow_the_policy_and_the_chunk_length():
    assert ChunkingConfig().steps_per_chunk(policy_steps=8, horizon=16) == 8  # 0: the policy's n_action_steps
    assert ChunkingConfig(execute_steps=3).steps_per_chunk(policy_steps=8, horizon=16) == 3
    assert ChunkingConfig(execute_steps=16).steps_per_chunk(policy_steps=8, horizon=16) == 16
    with pytest.raises(ValueError, match="chunking.execute_steps=17 exceeds the chunk length 16"):
        ChunkingConfig(execute_steps=17).steps_per_chunk(policy_steps=8, horizon=16)
    with pytest.raises(ValueError, match="the policy's n_action_steps=20 exceeds the chunk length 16"):
        ChunkingConfig().steps_per_chunk(policy_steps=20, horizon=16)
    with pytest.raises(ValueError, match="does not tell its n_action_steps; set --chunking.execute_steps"):
        ChunkingConfig().steps_per_chunk(policy_steps=None, horizon=16)
    with pytest.raises(ValueError, match="chunking.execute_steps must be >= 0"):
        ChunkingConfig(execute_steps=-1).steps_per_chunk(policy_steps=8, horizon=16)
    with pytest.raises(ValueError, match="chunking.ensemble_coeff must be finite"):
        ChunkingConfig(ensemble_coeff=float("nan")).validate()
