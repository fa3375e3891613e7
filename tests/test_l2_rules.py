"""The time-to-quality rules of benchmarks/l2_minibatching.py and `vla-rl train --stop_consecutive`, on hand-made
validation curves, and a validation loss that repeats for fixed weights (the rule compares losses across runs)."""

import importlib.util
from pathlib import Path

import pytest

from vla_rl.train import reached_target

ROOT = Path(__file__).resolve().parents[1]


def l2_script():
    spec = importlib.util.spec_from_file_location("l2_minibatching", ROOT / "benchmarks" / "l2_minibatching.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_arm_reaches_the_target_at_the_first_of_two_consecutive_validations_at_or_below_it():
    # [step, seconds, loss]: 0.30 at step 200 is alone (0.35 follows); 0.29 and 0.30 at steps 400 and 500 are two
    # in a row: reached at step 400, 40 s.
    curve = [[100, 10.0, 0.50], [200, 20.0, 0.30], [300, 30.0, 0.35], [400, 40.0, 0.29], [500, 50.0, 0.30]]
    assert reached_target(curve, 0.30, 2) == 3 and reached_target(curve, 0.30, 1) == 1
    assert reached_target(curve, 0.20, 2) is None and reached_target(curve[:4], 0.30, 2) is None
    assert l2_script()._seconds_to(curve, 0.30) == 40.0


def test_the_target_is_the_mean_of_the_conventional_arms_last_three_validations():
    curve = [[100, 1.0, 0.9], [200, 2.0, 0.33], [300, 3.0, 0.30], [400, 4.0, 0.27]]
    assert l2_script().target_loss(curve) == pytest.approx(0.30)


def test_the_validation_loss_repeats_for_fixed_weights(tiny_checkpoint, tiny_dataset):
    """Two calls on the same weights and frames give the same loss exactly: its noise and timesteps are fixed."""
    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from vla_core.data import ChunkedDemos
    from vla_rl.checkpoint import load_policy
    from vla_rl.train import validation_loss

    policy = load_policy(str(tiny_checkpoint[0]))[0]
    root = tiny_dataset[0]
    demos = ChunkedDemos(LeRobotDataset(repo_id=f"local/{root.name}", root=str(root)), None)
    frames = torch.arange(0, 32, 4)
    first = validation_loss(policy, demos, frames, policy.config.horizon)
    assert validation_loss(policy, demos, frames, policy.config.horizon) == first and first > 0


def test_seeds_pool_to_the_median_of_each_ratio_and_a_seed_below_the_floor_makes_success_nan():
    import math

    pool = l2_script().pool_seeds
    seeds = [{"seed": s, "time_ratio": t, "memory_ratio": 0.2, "total_memory_ratio": 0.9, "success_ratio": r,
              "per_step_time_ratio": 0.1} for s, t, r in ((0, 0.18, 0.9), (1, 0.25, 1.0), (2, 0.16, 0.95))]  # fmt: skip
    # Training seconds of the checkpoints evaluated: 60/150, 90/100 and, in a result written before the conventional
    # arm's seconds_trained existed, 30 over its last validation's 120 s.
    for seed, (level2, conventional) in zip(seeds, ((60.0, {"seconds_trained": 150.0}), (90.0, {"seconds_trained": 100.0}),
                                                    (30.0, {"val_curve": [[400, 61.0, 0.3], [800, 120.0, 0.1]]}))):  # fmt: skip
        seed["time_to_quality"] = {"level2": {"seconds_trained": level2}, "conventional": conventional}
    pooled = pool(seeds)
    assert (pooled["time_ratio"], pooled["success_ratio"], pooled["seeds"]) == (0.18, 0.95, [0, 1, 2])
    assert pooled["trained_time_ratio"] == pytest.approx(0.4)  # the median of 0.4, 0.9 and 0.25
    seeds[1]["success_ratio"] = float("nan")
    assert math.isnan(pool(seeds)["success_ratio"]) and pool(seeds)["time_ratio"] == 0.18


def test_the_real_scale_grid_builds_so400m_shaped_towers_under_an_expert_of_pi0s_width():
    """The vision tower's parameters counted from SigLIP-So400m's shape by hand (width 1152, 27 layers, patch 14 at
    224 px, MLP 4 x width as the script states), on the meta device: nothing is allocated."""
    import argparse

    import torch

    from policies.diffusion_vla.condition_encoder import ConditionEncoder

    script = l2_script()
    config = script.policy_config(argparse.Namespace(pretrained_encoder="", towers="frozen"), "so400m")
    config.validate()
    with torch.device("meta"):
        encoder = ConditionEncoder(config)
    width, mlp, patches = 1152, 4 * 1152, (224 // 14) ** 2
    embeddings = 3 * 14 * 14 * width + width + patches * width  # patch convolution, its bias, positions
    layer = 4 * (width * width + width) + 2 * 2 * width + (width * mlp + mlp) + (mlp * width + width)
    assert sum(p.numel() for p in encoder.vision.parameters()) == embeddings + 27 * layer + 2 * width == 431_361_792
    assert not any(p.requires_grad for p in encoder.vision.parameters())  # frozen, as the grid measures them
    assert (config.dim, config.heads, config.image_size) == (1024, 16, 224)
    # Flags the grid would not apply are refused in one line, not ignored.
    with pytest.raises(SystemExit, match="drop --towers trained, --seeds"):
        script.main(["--scale-grid", "--towers", "trained", "--seeds", "0,1"])


@pytest.mark.slow
def test_quick_run_end_to_end_over_two_seeds_and_a_second_run_reads_them_back(tmp_path):
    """`--quick --seeds 0,1`: each seed's result in its own folder, the target the mean of the conventional arm's
    last 3 validations (read from its curve in the JSON), the final line the medians over the seeds, and a second
    run trains nothing (both seeds read back)."""
    import json
    import math
    import os
    import statistics
    import subprocess
    import sys

    def run() -> list[str]:
        out = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "l2_minibatching.py"), "--quick", "--seeds", "0,1",
             "--threads", "1", "--out", str(tmp_path / "l2")],
            capture_output=True, text=True, check=True, env=os.environ | {"MUJOCO_GL": "egl"}, cwd=ROOT,
        )  # fmt: skip
        return out.stdout.strip().splitlines()

    first = run()
    pooled = json.loads((tmp_path / "l2" / "l2_minibatching.json").read_text())
    assert pooled["seeds"] == [0, 1] and [r["seed"] for r in pooled["per_seed"]] == [0, 1]
    for result in pooled["per_seed"]:
        assert {(r["encoder"], r["copies"]) for r in result["per_step"]} == {("small", 1), ("small", 4)}
        curve = result["time_to_quality"]["conventional"]["val_curve"]
        assert result["time_to_quality"]["target_val_loss"] == pytest.approx(statistics.mean(c[2] for c in curve[-3:]))
        conventional = result["success"]["conventional"]
        assert math.isnan(result["success_ratio"]) == (conventional["success_rate"] < 0.5)
    time_ratio = statistics.median(r["time_ratio"] for r in pooled["per_seed"])
    assert first[-1].startswith(f"time_ratio={time_ratio:.3f} memory_ratio=")
    second = run()
    assert [line for line in second if "finished earlier" in line] == [
        f"seed {s}: finished earlier, read from {tmp_path / 'l2' / f'seed{s}' / 'result.json'}" for s in (0, 1)
    ]
    assert second[-1] == first[-1]


def test_the_sim_renders_at_a_pretrained_encoders_own_input_size(tmp_path):
    # A 128 px encoder fed 64 px renders would see them upsampled: the detail it was pretrained on would be gone.
    import argparse
    import json

    script = l2_script()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "siglip", "vision_config": {"image_size": 128}}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # the folder check looks for the files, reads neither
    (tmp_path / "tokenizer.json").write_text("{}")
    assert script.camera_size(argparse.Namespace(pretrained_encoder=str(tmp_path))) == 128
    assert script.camera_size(argparse.Namespace(pretrained_encoder="")) == 64


def test_pooled_success_counts_every_seeds_episodes_and_keeps_the_floor():
    # Conventional 120/200 + 110/200 = 230/400 (57.5%), Level-2 115/200 + 107/200 = 222/400: ratio 222/230 = 0.96522.
    # Katz: sqrt(1/222 - 1/400 + 1/230 - 1/400) = 0.062067 -> 0.96522 * exp(-+1.96 * 0.062067) = (0.85466, 1.09008).
    import math

    def seed(s, conv, l2):
        arms = {"conventional": {"successes": conv, "episodes": 200}, "level2": {"successes": l2, "episodes": 200}}
        return {"seed": s, "time_ratio": 0.2, "memory_ratio": 0.2, "total_memory_ratio": 0.9, "success_ratio": 1.0,
                "per_step_time_ratio": 0.1, "success": arms,
                "time_to_quality": {"level2": {"seconds_trained": 1.0}, "conventional": {"seconds_trained": 2.0}}}  # fmt: skip

    pooled = l2_script().pool_seeds([seed(0, 120, 115), seed(1, 110, 107)])["success_pooled"]
    assert (pooled["conventional"]["successes"], pooled["level2"]["successes"]) == (230, 222)
    assert pooled["ratio"] == pytest.approx(0.96522, abs=1e-5)
    assert pooled["ratio_ci95"] == pytest.approx([0.85466, 1.09008], abs=1e-5)
    below = l2_script().pool_seeds([seed(0, 90, 80), seed(1, 100, 95)])["success_pooled"]  # 190/400 < 50%
    assert math.isnan(below["ratio"]) and all(math.isnan(v) for v in below["ratio_ci95"])


def test_a_bad_encoder_folder_or_a_pilot_over_seeds_is_refused_in_one_line_before_any_work(tmp_path):
    script = l2_script()
    (tmp_path / "config.json").write_text('{"model_type": "clip", "vision_config": {"image_size": 64}}')
    with pytest.raises(SystemExit, match="holds a 'clip' model, not SigLIP") as refused:
        script.main(["--pretrained-encoder", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit, match="--conventional-only trains one seed: drop --seeds"):
        script.main(["--conventional-only", "--seeds", "0,1", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_demonstrations_of_another_task_or_count_are_recorded_again_and_the_same_ones_reused(tmp_path, monkeypatch):
    # The dataset is cached in --out: a lift run pointed at a folder holding reach's demonstrations must not
    # train on them. `record` itself is replaced: only the rule deciding whether to call it is under test.
    import argparse
    import json

    import vla_rl.stages

    script = l2_script()
    calls = []
    monkeypatch.setattr(vla_rl.stages, "record", lambda cfg: calls.append((cfg.env.task, cfg.env.image_size)))
    meta = tmp_path / "dataset" / "meta"
    meta.mkdir(parents=True)
    (meta / "vla_rl_record.json").write_text(
        json.dumps({"episodes": 150, "config": {"env": {"task": "reach", "image_size": 64}}})
    )

    def args(task, episodes=150):
        return argparse.Namespace(out=str(tmp_path), task=task, episodes=episodes, pretrained_encoder="")

    script.record_dataset(args("reach"))
    assert calls == []
    script.record_dataset(args("lift"))
    script.record_dataset(args("reach", episodes=200))
    assert calls == [("lift", 64), ("reach", 64)]
