"""`vla-rl probe-localization`: the held-out split, the error figures, the labels (the task's object minus the end
effector, in cm, checked against the sim itself), and a rerun that reuses finished encoders."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from vla_rl.probe_localization import errors_cm, final_line, held_out


def test_the_last_episodes_are_held_out_as_few_as_hold_the_frames_never_all():
    episode = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    assert held_out(episode, 2).tolist() == [False] * 5 + [True] * 2
    assert held_out(episode, 3).tolist() == [False] * 2 + [True] * 5
    assert held_out(episode, 100).tolist() == [False] * 2 + [True] * 5  # episode 0 always trains


def test_the_errors_are_distances_and_per_axis_rmse_in_cm():
    label = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    errors = errors_cm(torch.zeros(3, 3), label)
    assert errors["median_cm"] == 2.0 and errors["mean_cm"] == pytest.approx(8 / 3, abs=1e-3)
    assert errors["rmse_cm"] == pytest.approx([math.sqrt(3), math.sqrt(16 / 3), math.sqrt(5 / 3)], abs=1e-3)
    report = {"encoders": {"diffusion": {"median_cm": 1.104}, "autoregressive_vla:vision=keypoints": {"median_cm": 2.5}},
              "mean_baseline": {"median_cm": 7.0}}  # fmt: skip
    assert final_line(report) == (
        "localization_cm diffusion=1.10 autoregressive_vla:vision-keypoints=2.50 mean_baseline=7.00"
    )


def test_an_encoder_is_a_policy_type_with_its_fields_set_and_a_bad_one_names_the_choices():
    from vla_rl.probe_localization import encoder_config

    config = encoder_config("autoregressive_vla:vision=keypoints,layers=4,temperature=0.5")
    assert (config.type, config.vision, config.layers, config.temperature) == (
        "autoregressive_vla",
        "keypoints",
        4,
        0.5,
    )
    assert encoder_config("diffusion").type == "diffusion"
    with pytest.raises(ValueError, match="unknown policy type 'nope'.*'diffusion'"):
        encoder_config("nope")
    with pytest.raises(ValueError, match="diffusion has no field 'foo'"):
        encoder_config("diffusion:foo=1")
    with pytest.raises(ValueError, match="policy.vision must be one of"):
        encoder_config("autoregressive_vla:vision=eyes")
    with pytest.raises(ValueError, match="diffusion.cameras is not a number, a string or a flag"):
        encoder_config("diffusion:cameras=front")


def test_the_readout_of_condition_tokens_is_their_mean_over_the_unmasked_ones():
    """The diffusion VLA's encoding is tokens (B, L, F) with a mask: tokens [1, 2], [3, 4] kept and [100, 100]
    masked give [2, 3]; a plain (B, F) encoding is read as it is."""
    from types import SimpleNamespace

    from vla_rl.probe_localization import readout

    tokens = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    pooled = readout(SimpleNamespace(encode_observation=lambda obs: (tokens, torch.tensor([[1, 1, 0]]))))({})
    assert pooled.tolist() == [[2.0, 3.0]]
    assert readout(SimpleNamespace(encode_observation=lambda obs: tokens[:, 0]))({}).tolist() == [[1.0, 2.0]]
    with pytest.raises(ValueError, match="has no observation readout"):
        readout(SimpleNamespace())


def test_the_labels_are_the_object_minus_the_end_effector_and_a_rerun_reuses_finished_encoders(tmp_path):
    """track, 2 worlds, 4 episodes: world 0's first frame is its reset from the seed, so its label is the ball's
    privileged position minus the end effector there (read from a fresh env), times 100. A second run adds the
    second encoder and keeps the first's figures; another seed in the same folder is refused."""
    from sim.config import EnvConfig
    from sim.factory import make_env
    from vla_rl.probe_localization import ProbeLocalizationConfig, collect_frames, probe_localization

    env = EnvConfig(task="track", num_envs=2, image_size=32, num_threads=1, render_threads=1)
    cfg = ProbeLocalizationConfig(env=env, encoders=["diffusion"], episodes=4, held_out_frames=10, steps=3,
                                  batch_size=4, output_dir=str(tmp_path))  # fmt: skip
    frames, features, instruction = collect_frames(cfg)
    with make_env(env) as sim:
        sim.reset(seed=cfg.seed)
        ball, ee = sim.privileged_state()["target"][0], sim.ee_positions()[0]
    # World 0's first episode is among the first 4 of 2 worlds to end: one frame holds its reset's label.
    assert np.isclose(frames["label"].numpy(), (ball - ee) * 100, atol=1e-4).all(axis=1).sum() == 1
    assert frames["observation.images.front"].dtype == torch.uint8 and "observation.images.front" in features
    assert torch.unique(frames["episode"]).tolist() == [0, 1, 2, 3] and instruction
    report = probe_localization(cfg)
    assert list(report["encoders"]) == ["diffusion"] and report["frames"]["held_out"] >= 10
    assert report["frames"]["train"] + report["frames"]["held_out"] == len(frames["label"])
    again = probe_localization(
        ProbeLocalizationConfig(**{**cfg.__dict__, "encoders": ["diffusion", "autoregressive_vla"]})
    )
    assert again["encoders"]["diffusion"] == report["encoders"]["diffusion"]
    assert set(again["encoders"]) == {"diffusion", "autoregressive_vla"}
    assert json.loads((tmp_path / "localization.json").read_text()) == again
    with pytest.raises(ValueError, match="written with another config"):
        probe_localization(ProbeLocalizationConfig(**{**cfg.__dict__, "seed": 1}))


def test_a_frozen_checkpoint_is_read_as_it_is_and_only_the_head_learns(tmp_path, monkeypatch):
    """``frozen:<checkpoint>``: the policy loaded from the folder keeps every weight through the probe (compared with
    a second load of the same folder); its figures are reported under the spec."""
    from tiny_policies import save_lift_flow_policy

    import vla_rl.checkpoint
    from sim.config import EnvConfig
    from vla_rl.probe_localization import ProbeLocalizationConfig, probe_localization

    save_lift_flow_policy(tmp_path / "policy", image_size=32)
    loaded = []
    load = vla_rl.checkpoint.load_policy
    monkeypatch.setattr(vla_rl.checkpoint, "load_policy", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    env = EnvConfig(task="track", num_envs=2, image_size=32, num_threads=1, render_threads=1)
    spec = f"frozen:{tmp_path / 'policy'}"
    report = probe_localization(ProbeLocalizationConfig(env=env, encoders=[spec], episodes=4, held_out_frames=10,
                                                        steps=30, batch_size=8, lr=1e-2, output_dir=str(tmp_path / "p")))  # fmt: skip
    after = loaded[0][0].state_dict()
    before = load(str(tmp_path / "policy"))[0].state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert math.isfinite(report["encoders"][spec]["median_cm"]) and report["frames"]["held_out"] >= 10
