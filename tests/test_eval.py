import json

import imageio.v2 as imageio
import pytest
import torch

from sim.config import EnvConfig
from vla_core.runtime import ChunkingConfig
from vla_rl.eval import EvalConfig, evaluate
from vla_rl.statistics import wilson_interval


def test_wilson_interval_hand_values():
    # p = 0.5, n = 50, z = 1.96: centre = (0.5 + 0.0384) / 1.0768 = 0.5; half = 1.96*sqrt(0.005 + 0.00038416)/1.0768
    lo, hi = wilson_interval(25, 50)
    assert lo == pytest.approx(0.3664, abs=1e-4) and hi == pytest.approx(0.6336, abs=1e-4)
    lo, hi = wilson_interval(50, 50)  # all successes: upper bound 1, lower bound n / (n + z^2)
    assert hi == 1.0 and lo == pytest.approx(50 / (50 + 1.96**2), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_eval_writes_results_and_is_reproducible(tiny_checkpoint, tmp_path):
    out, _ = tiny_checkpoint
    cfg = EvalConfig(
        checkpoint=str(out), env=EnvConfig(num_envs=3, max_episode_steps=12), num_episodes=5, seed=5,
        video_episodes=2, video_size=64, output_dir=str(tmp_path / "a"),
    )  # fmt: skip
    result = evaluate(cfg)
    assert result["episodes"] == 5
    assert [(e["round"], e["world"], e["seed"]) for e in result["per_episode"]] == [
        (0, 0, 5), (0, 1, 5), (0, 2, 5), (1, 0, 6), (1, 1, 6)
    ]  # fmt: skip
    assert all(1 <= e["length"] <= 12 for e in result["per_episode"])
    assert result["success_rate"] == result["successes"] / 5
    saved = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert saved["success_ci95"] == list(wilson_interval(result["successes"], 5))
    assert "95% CI" in (tmp_path / "a" / "summary.md").read_text()
    frames = imageio.mimread(tmp_path / "a" / "rollouts.mp4", memtest=False)
    # One frame after the reset, then one per step until every counted world of round 0 has finished.
    assert len(frames) == 1 + max(e["length"] for e in result["per_episode"] if e["round"] == 0)
    assert frames[0].shape == (64, 128, 3)

    cfg.output_dir = str(tmp_path / "b")
    again = evaluate(cfg)
    assert again["per_episode"] == result["per_episode"]


def test_eval_ensemble_mode_replans_every_step(tiny_checkpoint, tmp_path, monkeypatch):
    from policies.diffusion.modeling_diffusion import DiffusionPolicy

    calls = []
    real = DiffusionPolicy.predict_chunk
    monkeypatch.setattr(
        DiffusionPolicy,
        "predict_chunk",
        lambda self, obs, step=None: calls.append(step.tolist()) or real(self, obs, step),
    )
    out, _ = tiny_checkpoint
    result = evaluate(EvalConfig(
        checkpoint=str(out), env=EnvConfig(num_envs=2, max_episode_steps=5), num_episodes=2,
        chunking=ChunkingConfig(execute_steps=1, merge="ensemble"), video_episodes=0, output_dir=str(tmp_path),
    ))  # fmt: skip
    assert result["merge"] == "ensemble" and result["execute_steps"] == 1
    assert calls == [[t, t] for t in range(5)]  # a new chunk at every one of the 5 steps
    assert not (tmp_path / "rollouts.mp4").exists()
    with pytest.raises(ValueError, match="chunking.merge='average' is not one of"):
        evaluate(EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=1), chunking=ChunkingConfig(merge="average"),
                            output_dir=str(tmp_path)))  # fmt: skip
    # The tiny policy's chunks are 16 steps long (policy.horizon): 17 cannot be executed from one.
    with pytest.raises(ValueError, match="chunking.execute_steps=17 exceeds the chunk length 16"):
        evaluate(EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=1), chunking=ChunkingConfig(execute_steps=17),
                            output_dir=str(tmp_path)))  # fmt: skip


def test_eval_rejects_mismatched_image_size(tiny_checkpoint, tmp_path):
    out, _ = tiny_checkpoint
    with pytest.raises(ValueError, match="--env.image_size=64"):
        evaluate(EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=1, image_size=96), output_dir=str(tmp_path)))


def test_eval_under_inference_delay(tiny_checkpoint, tmp_path, monkeypatch):
    """Requests happen every max(execute_steps, d) steps: 10 steps with s=2 ask 5 times at d=0, 4 at d=3."""
    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from vla_core.runtime import DelayConfig

    calls = []
    real = DiffusionPolicy.predict_chunk
    monkeypatch.setattr(
        DiffusionPolicy,
        "predict_chunk",
        lambda self, obs, step=None: calls.append(step.tolist()) or real(self, obs, step),
    )
    out, _ = tiny_checkpoint
    for d, expected in [(0, [0, 2, 4, 6, 8]), (3, [0, 3, 6, 9])]:
        calls.clear()
        result = evaluate(EvalConfig(
            checkpoint=str(out), env=EnvConfig(num_envs=2, max_episode_steps=10), num_episodes=2, video_episodes=0,
            chunking=ChunkingConfig(execute_steps=2), delay=DelayConfig(kind="fixed", steps=d),
            output_dir=str(tmp_path / str(d)),
        ))  # fmt: skip
        assert result["delay"]["steps"] == d
        # No lift fits in 10 steps (the expert needs about 40), so both worlds run all 10 in lockstep.
        assert [e["length"] for e in result["per_episode"]] == [10, 10]
        assert calls == [[t, t] for t in expected]


def test_eval_rtc_merge_guides_an_inpainting_policy_toward_the_queued_actions(tiny_checkpoint, tmp_path, monkeypatch):
    """d = 1, two steps per chunk, H = 16. The first request has nothing queued (all weights 0). Chunk 0
    arrives at step 1 and runs its index 1; at step 2 the second request's target row j is chunk 0's
    index 2 + j (j < 14, what is queued), with weight 1 on the committed row j = 0 and 0 past row 13."""
    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from vla_core.runtime import DelayConfig

    calls = []
    real = DiffusionPolicy.predict_chunk

    def spy(self, obs, obs_step=None, *, inpaint=None):
        chunk = real(self, obs, obs_step)
        calls.append((inpaint, chunk.actions.clone()))
        return chunk

    monkeypatch.setattr(DiffusionPolicy, "predict_chunk", spy)
    monkeypatch.setattr(DiffusionPolicy, "supports_inpainting", True)
    out, _ = tiny_checkpoint
    result = evaluate(EvalConfig(
        checkpoint=str(out), env=EnvConfig(num_envs=2, max_episode_steps=6), num_episodes=2, video_episodes=0,
        chunking=ChunkingConfig(execute_steps=2, merge="rtc"), delay=DelayConfig(kind="fixed", steps=1),
        output_dir=str(tmp_path),
    ))  # fmt: skip
    assert result["rtc_guidance"] is True
    (first, _), (second, _) = calls[0], calls[1]
    chunk0 = calls[0][1]
    assert first[1].shape == (2, 16) and (first[1] == 0).all()
    target, weights = second
    assert torch.allclose(target[:, :14], chunk0[:, 2:16]) and (target[:, 14:] == 0).all()
    assert (weights[:, 0] == 1).all() and (weights[:, 14:] == 0).all()
    assert ((weights[:, 1:14] > 0) & (weights[:, 1:14] < 1)).all()


def test_eval_refuses_delays_before_any_rollout(tiny_checkpoint, tmp_path, monkeypatch):
    from vla_core.runtime import DelayConfig

    out, _ = tiny_checkpoint
    cfg = EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=1), output_dir=str(tmp_path / "whole"))
    cfg.delay = DelayConfig(kind="fixed", steps=16)  # the chunk holds 16 steps
    with pytest.raises(ValueError, match="chunk holds 16"):
        evaluate(cfg)
    # A policy trained with the augmentation for delays up to 3 refuses 4.
    from vla_rl.checkpoint import load_policy

    policy, _ = load_policy(str(out))
    policy.config.max_delay_steps = 3
    monkeypatch.setattr("vla_rl.eval.load_policy", lambda *a, **k: (policy, out))
    cfg.delay = DelayConfig(kind="uniform", low=0, high=4)
    with pytest.raises(ValueError, match="trained for delays up to 3; .*--delay.kind=uniform --delay.high=4"):
        evaluate(cfg)
    assert not (tmp_path / "whole").exists()  # nothing written
