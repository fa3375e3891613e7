import os

# Tests run offline and headless.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """Six scripted lift episodes recorded through `vla-rl record`'s code path."""
    from sim.config import EnvConfig
    from vla_rl.record import RecordConfig, record

    root = tmp_path_factory.mktemp("data") / "lift"
    summary = record(RecordConfig(env=EnvConfig(num_envs=6), num_episodes=6, output_dir=str(root), seed=7))
    return root, summary


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_dataset, tmp_path_factory):
    """A diffusion policy trained for a few steps on the tiny dataset (for plumbing, not skill)."""
    from vla_rl.train import DatasetConfig, TrainConfig, train

    out = tmp_path_factory.mktemp("train") / "run"
    cfg = TrainConfig(
        dataset=DatasetConfig(root=str(tiny_dataset[0])), output_dir=str(out), steps=60, batch_size=16,
        save_every=20, log_every=10, log_with="none", num_threads=2, warmup_steps=5,
    )  # fmt: skip
    return out, train(cfg)
