"""Runs written by vla-rl 0.2 load, act and resume under this release.

``tests/fixtures/v0_2`` was written by vla-rl 0.2's own code: a 2-episode lift dataset, a 4-step
`vla-rl train` run of a tiny diffusion policy and a 1-iteration `vla-rl finetune` (PPO) run from it;
``expected_actions.json`` holds the chunks 0.2 sampled from each checkpoint for a fixed observation
and noise. Paths inside the fixture are relative to ``tests/fixtures`` (``v0_2/...``).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from sim.config import EnvConfig
from vla_rl.checkpoint import load_policy

FIXTURE = Path(__file__).parent / "fixtures" / "v0_2"


@pytest.fixture
def runs(tmp_path) -> Path:
    """A writable copy of the fixture whose recorded paths point at the copy."""
    root = tmp_path / "v0_2"
    shutil.copytree(FIXTURE, root, symlinks=True)
    initial = root / "finetune" / "initial_checkpoint.txt"
    initial.write_text(initial.read_text().replace("v0_2", str(root)))
    return root


@pytest.mark.parametrize("run", ["train", "finetune"])
def test_a_0_2_checkpoint_samples_the_chunk_it_sampled_under_0_2(run):
    expected = json.loads((FIXTURE / "expected_actions.json").read_text())[run]
    policy, _ = load_policy(FIXTURE / run)
    c = policy.config
    g = torch.Generator().manual_seed(0)  # the observation and noise 0.2 sampled from, drawn in its order
    obs = {f"observation.images.{cam}": torch.rand(2, 3, c.image_size, c.image_size, generator=g) for cam in c.cameras}
    obs["observation.state"] = torch.randn(2, c.state_dim, generator=g)
    obs["task"] = [expected["task"]] * 2
    noise = torch.randn(2, c.horizon, c.action_dim, generator=g)
    # Equal to float32 rounding, not bit for bit: the same torch on another CPU (or a changed math library)
    # reorders sums and moves the last bits (7.7e-7 seen on actions in [-1, 1]). A checkpoint read wrongly
    # (a lost normalization, EMA or scheduler setting) moves actions by far more than 1e-5.
    torch.testing.assert_close(
        policy.predict_chunk(obs, noise=noise).actions, torch.tensor(expected["actions"]), atol=1e-5, rtol=0
    )


def test_a_0_2_training_run_resumes(runs):
    from policies.diffusion.configuration_diffusion import DiffusionConfig
    from vla_rl.train import DatasetConfig, TrainConfig, train

    saved = json.loads((runs / "train" / "train_config.json").read_text())["policy"]
    policy = DiffusionConfig(**{k: saved[k] for k in ("horizon", "n_action_steps", "vision_channels", "num_keypoints",
                                                      "text_dim", "hidden_dim", "num_blocks", "image_size")})  # fmt: skip
    summary = train(TrainConfig(
        dataset=DatasetConfig(root=str(runs / "dataset")), output_dir=str(runs / "train"), steps=6, batch_size=4,
        save_every=2, log_every=2, log_with="none", num_threads=1, warmup_steps=1, policy=policy, resume=True,
    ))  # fmt: skip
    assert summary["steps"] == 6
    assert [step for step, _ in summary["loss_curve"]][:2] == [2, 4]  # 0.2's losses kept, the new ones after


def test_a_0_2_finetune_run_resumes(runs):
    from vla_rl.finetune import FinetuneConfig, finetune
    from vla_rl.rl.ppo import PPOConfig

    saved = json.loads((runs / "finetune" / "finetune_config.json").read_text())
    summary = finetune(FinetuneConfig(
        checkpoint=str(runs / "train"), env=EnvConfig(**saved["env"]), iterations=2, update_epochs=1,
        minibatch_size=8, eval_every=0, output_dir=str(runs / "finetune"), num_threads=1, log_with="none",
        ppo=PPOConfig(**saved["ppo"]), resume=True,
    ))  # fmt: skip
    assert summary["iterations"] == 2 and [h["iteration"] for h in summary["history"]] == [1, 2]
    assert summary["executed_rows_credit_from"] == 1  # 0.2 scored every row and credited request to request
    assert (runs / "finetune" / "checkpoints" / "step-00000002" / "training_state" / "finetune_state.pt").is_file()
