"""`sim.tasks.variety`: an expert varied per episode within the workspace, and `vla-rl record --variety`."""

import json

import numpy as np
import pytest

from sim.tasks.lift import LiftExpert
from sim.tasks.variety import ExpertVariety, VariedExpert

# Two worlds, the hand 30 cm from where the lift expert aims first (10 cm above the cube): far enough that every
# step below is the expert's full 2.5 cm toward that point, straight along -y.
EE = np.array([[0.5, 0.3, 0.15], [0.5, 0.3, 0.15]])
CUBE = {"cube": np.array([[0.5, 0.0, 0.05], [0.5, 0.0, 0.05]])}


def test_pace_scales_each_episodes_steps_by_one_draw_and_a_reset_draws_again():
    varied = VariedExpert(LiftExpert(2), ExpertVariety(pace_low=0.5), num_envs=2, seed=0)
    steps = [varied.act(EE, CUBE)[:, :3] - EE for _ in range(3)]
    lengths = np.array([np.linalg.norm(s, axis=1) for s in steps])  # (step, world)
    assert np.all((lengths >= 0.5 * 0.025 - 1e-12) & (lengths <= 0.025 + 1e-12))
    assert np.allclose(lengths, lengths[0])  # one pace per episode
    assert lengths[0, 0] != pytest.approx(lengths[0, 1])  # each world its own
    for s in steps:  # still straight toward the expert's aim
        assert np.allclose(s[:, [0, 2]], 0.0) and np.all(s[:, 1] < 0)
    varied.reset(np.array([True, False]))
    again = np.linalg.norm(varied.act(EE, CUBE)[:, :3] - EE, axis=1)
    assert again[1] == pytest.approx(lengths[0, 1]) and again[0] != pytest.approx(lengths[0, 0])


def test_the_detour_fades_to_the_expert_over_its_steps_and_never_points_down():
    variety = ExpertVariety(detour=0.03, detour_steps=4)
    varied, plain = VariedExpert(LiftExpert(2), variety, 2, seed=1), LiftExpert(2)
    offsets = []
    for _ in range(6):
        offsets.append(varied.act(EE, CUBE)[:, :3] - plain.act(EE, CUBE)[:, :3])
    first = offsets[0]
    assert np.all(np.abs(first) <= 0.03) and np.all(first[:, 2] >= 0) and np.abs(first).max() > 0.005
    for k, offset in enumerate(offsets):  # the offset times 1, 3/4, 1/2, 1/4, then nothing
        assert np.allclose(offset, first * max(0.0, 1 - k / 4), atol=1e-12)
    # the same seed gives the same draws; the grip is the expert's
    same = VariedExpert(LiftExpert(2), variety, 2, seed=1).act(EE, CUBE)
    assert np.allclose(same[:, :3] - plain.act(EE, CUBE)[:, :3], first)
    assert np.array_equal(same[:, 3], plain.act(EE, CUBE)[:, 3])


def test_a_varied_target_stays_inside_the_workspace():
    from sim.arm import ACTION_HIGH, ACTION_LOW

    edge = np.array([ACTION_HIGH[:3] - 0.001, ACTION_LOW[:3] + 0.001])  # one hand at each corner of the workspace
    varied = VariedExpert(LiftExpert(2), ExpertVariety(detour=0.05, noise=0.01), num_envs=2, seed=4)
    for _ in range(5):
        targets = varied.act(edge, CUBE)[:, :3]
        assert np.all(targets >= ACTION_LOW[:3]) and np.all(targets <= ACTION_HIGH[:3])


def test_bad_variety_is_refused_in_one_line():
    for bad in ({"detour": -0.01}, {"noise": -1.0}, {"pace_low": 0.0}, {"pace_low": 1.5}, {"detour_steps": 0}):
        with pytest.raises(ValueError, match="--variety"):
            ExpertVariety(**bad)
    assert not ExpertVariety().active and ExpertVariety(noise=0.002).active


def test_record_with_variety_varies_the_demonstrations_and_keeps_its_settings(tmp_path):
    from sim.config import EnvConfig
    from vla_core.data import open_dataset
    from vla_rl.record import RecordConfig, record

    def actions(root, variety):
        record(RecordConfig(env=EnvConfig(num_envs=2, cameras=[]), num_episodes=2, output_dir=str(root), seed=3,
                            variety=variety))  # fmt: skip
        ds = open_dataset(root)
        return np.stack([np.asarray(ds[i]["action"]) for i in range(len(ds))])

    plain = actions(tmp_path / "plain", ExpertVariety())
    variety = ExpertVariety(detour=0.03, pace_low=0.7, noise=0.002)
    varied = actions(tmp_path / "varied", variety)
    assert plain.shape[1] == varied.shape[1] == 4
    # the same initial states (seed 3), other paths: the first targets differ by more than the noise
    assert np.abs(varied[0, :3] - plain[0, :3]).max() > 0.004
    saved = json.loads((tmp_path / "varied" / "meta" / "vla_rl_record.json").read_text())
    assert saved["config"]["variety"] == {"detour": 0.03, "detour_steps": 15, "pace_low": 0.7, "noise": 0.002}
    assert saved["episodes"] == 2  # only successful episodes are kept, as always
