"""Training the diffusion VLA: Level-2 minibatching in `vla-rl train`, multi-task data, bad input."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vla_core.data import FrameSampler
from vla_rl.checkpoint import load_policy

ROOT = Path(__file__).resolve().parents[1]
LIBERO_TASKS = [
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "open the middle drawer of the cabinet",
    "put the wine bottle on top of the cabinet",
]


def vla_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "vla_rl.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


TINY_VLA = [
    "--policy.type=diffusion_vla", "--policy.dim=32", "--policy.depth=1", "--policy.heads=2",
    "--policy.vision_width=32", "--policy.vision_layers=1", "--policy.text_width=32", "--policy.horizon=8",
    "--policy.n_action_steps=4", "--log_with=none", "--num_threads=1", "--warmup_steps=2", "--log_every=2",
]  # fmt: skip


@pytest.fixture(scope="module")
def libero_format_dataset(tmp_path_factory):
    """A LeRobotDataset with the features of the public lerobot/libero datasets (two cameras `image`
    and `image2`, 8-D state, 7-D action), three tasks with 4, 1 and 1 episodes, 32 px images."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = tmp_path_factory.mktemp("libero") / "libero_format"
    features = {
        "observation.images.image": {"dtype": "image", "shape": (32, 32, 3), "names": ["height", "width", "channels"]},
        "observation.images.image2": {"dtype": "image", "shape": (32, 32, 3), "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (8,), "names": None},
        "action": {"dtype": "float32", "shape": (7,), "names": None},
    }
    ds = LeRobotDataset.create("local/libero_format", fps=10, features=features, root=root, use_videos=False)
    rng = np.random.default_rng(0)
    for task in [0, 0, 0, 0, 1, 2]:
        for t in range(12):
            ds.add_frame({
                "observation.images.image": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                "observation.images.image2": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                "observation.state": rng.normal(size=8).astype(np.float32),
                "action": np.full(7, task - 1 + 0.05 * t, dtype=np.float32),
                "task": LIBERO_TASKS[task],
            })  # fmt: skip
        ds.save_episode()
    ds.finalize()
    return root


def test_l2_training_on_a_libero_format_multitask_dataset(libero_format_dataset, tmp_path):
    out = tmp_path / "run"
    res = vla_cli("train", f"--dataset.root={libero_format_dataset}", f"--output_dir={out}", "--steps=6",
                  "--batch_size=8", "--l2_copies=4", "--policy.image_size=16", "--val_episodes=1", "--val_every=3",
                  "--save_every=100", *TINY_VLA)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 6 and [row[0] for row in summary["val_curve"]] == [3, 6]
    assert all(np.isfinite(row[2]) for row in summary["val_curve"])
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["policy"]["type"] == "diffusion_vla" and saved["l2_copies"] == 4
    policy, _ = load_policy(out)
    cfg = policy.config
    assert policy.config.type == "diffusion_vla"
    assert cfg.cameras == ["image", "image2"] and cfg.state_dim == 8 and cfg.action_dim == 7
    assert {"bowl", "drawer", "wine"} <= set(cfg.vocabulary)
    obs = {
        "observation.images.image": torch.rand(2, 3, 32, 32),  # the dataset's size; the encoder resizes to 16
        "observation.images.image2": torch.rand(2, 3, 32, 32),
        "observation.state": torch.zeros(2, 8),
        "task": LIBERO_TASKS[:2],
    }
    assert policy.predict_chunk(obs).actions.shape == (2, 8, 7)


def tiny_vla_config(dataset_root, output_dir, **kw):
    """A TrainConfig for the tiny VLA of TINY_VLA, built in-process (for hooks into `train`)."""
    from policies.diffusion_vla import DiffusionVLAConfig
    from vla_rl.train import DatasetConfig, TrainConfig

    policy = DiffusionVLAConfig(dim=32, depth=1, heads=2, vision_width=32, vision_layers=1, text_width=32,
                                horizon=8, n_action_steps=4, image_size=16)  # fmt: skip
    return TrainConfig(dataset=DatasetConfig(root=str(dataset_root)), output_dir=str(output_dir), policy=policy,
                       log_with="none", num_threads=1, warmup_steps=2, log_every=2, **kw)  # fmt: skip


def test_l2_copies_run_the_encoder_on_batch_over_k_frames_per_step(libero_format_dataset, tmp_path, monkeypatch):
    """In a real `train()` with l2_copies=4 and batch_size=8, every step encodes 2 frames and the DiT
    denoises 2 x 4 = 8 samples, each copy with its own timestep."""
    from policies.diffusion_vla.condition_encoder import ConditionEncoder
    from policies.diffusion_vla.dit import DiT
    from vla_rl.train import train

    encoded, denoised = [], []
    encode, denoise = ConditionEncoder.forward, DiT.forward

    def encoder_hook(self, images, state, instructions):
        encoded.append([state.shape[0], len(instructions), *(img.shape[0] for img in images)])
        return encode(self, images, state, instructions)

    def dit_hook(self, noisy, t, cond, cond_mask, known=None):
        denoised.append((tuple(noisy.shape), t.detach().clone(), cond.shape[0]))
        return denoise(self, noisy, t, cond, cond_mask, known)

    monkeypatch.setattr(ConditionEncoder, "forward", encoder_hook)
    monkeypatch.setattr(DiT, "forward", dit_hook)
    summary = train(tiny_vla_config(libero_format_dataset, tmp_path / "run", steps=3, batch_size=8, l2_copies=4))
    assert summary["steps"] == 3
    # One encoder call per step, on 8 / 4 = 2 frames: state, instructions and both cameras.
    assert encoded == [[2, 2, 2, 2]] * 3
    assert [(shape, b) for shape, _, b in denoised] == [((2, 4, 8, 7), 2)] * 3  # (frames, copies, H, A)
    for _, t, _ in denoised:
        assert t.shape == (2, 4) and len(set(t.flatten().tolist())) == 8  # an own timestep per copy


def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(
    libero_format_dataset, tmp_path, monkeypatch
):
    from policies.diffusion_vla.modeling_diffusion_vla import DiffusionVLAPolicy
    from vla_rl.checkpoint import resolve_checkpoint
    from vla_rl.train import train

    losses = DiffusionVLAPolicy.forward
    calls = []

    def nan_at_the_sixth_step(self, batch, generator=None, copies=1):
        loss = losses(self, batch, generator, copies)
        calls.append(len(calls))
        return loss * float("nan") if len(calls) == 6 else loss  # the 6th step, after 5 completed steps

    monkeypatch.setattr(DiffusionVLAPolicy, "forward", nan_at_the_sixth_step)
    out = tmp_path / "run"
    cfg = tiny_vla_config(libero_format_dataset, out, steps=10, batch_size=4, save_every=2)
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 5; lower --lr and --resume=true"):
        train(cfg)
    assert len(calls) == 6  # it stopped at once, not after more steps
    # Checkpoints at steps 2 and 4 were written; nothing of the failed step, so `last` is step 4.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last", "step-00000002", "step-00000004"]
    last = resolve_checkpoint(out)
    assert last.name == "step-00000004"
    progress = torch.load(last / "training_state" / "progress.pt", weights_only=False)
    weights = load_file(str(last / "training_state" / "model.safetensors"))
    assert progress["step"] == 4 and all(torch.isfinite(v).all() for v in weights.values())
    # --resume=true, as the message says, continues from that checkpoint to the end.
    resumed = []
    monkeypatch.setattr(DiffusionVLAPolicy, "forward", lambda *a, **kw: resumed.append(1) or losses(*a, **kw))
    cfg.resume = True
    summary = train(cfg)
    assert len(resumed) == 6 and summary["steps"] == 10 and np.isfinite(summary["final_loss"])  # steps 5 to 10


def test_task_balanced_sampling_evens_out_a_skewed_dataset():
    task_index = torch.tensor([0] * 90 + [1] * 10)
    frames = torch.arange(100)
    gen = torch.Generator().manual_seed(0)
    balanced = FrameSampler(frames, task_index, balanced=True).sample(4000, gen)
    uniform = FrameSampler(frames, task_index, balanced=False).sample(4000, gen)
    share = lambda idx: (task_index[idx] == 1).float().mean().item()
    assert 0.46 < share(balanced) < 0.54 and 0.08 < share(uniform) < 0.12
    # Within a task every frame can be drawn.
    assert set(balanced[task_index[balanced] == 1].tolist()) == set(range(90, 100))
    held_out = FrameSampler(frames[:95], task_index, balanced=True).sample(2000, gen)
    assert held_out.max().item() < 95  # frames outside the given set are never drawn


def test_bad_batching_is_rejected_before_any_data_is_read(tmp_path):
    res = vla_cli("train", f"--dataset.root={tmp_path / 'nowhere'}", f"--output_dir={tmp_path / 'run'}",
                  "--batch_size=10", "--l2_copies=4", "--policy.type=diffusion_vla")  # fmt: skip
    assert res.returncode == 2
    assert "l2_copies=4 does not divide batch_size=10" in res.stderr and "Traceback" not in res.stderr
    res = vla_cli("train", f"--dataset.root={tmp_path / 'nowhere'}", "--batch_size=8", "--l2_copies=4")
    assert (
        res.returncode == 2
        and "needs a policy with Level-2 minibatching, such as --policy.type=diffusion_vla" in res.stderr
    )


def test_dataset_and_config_mismatches_name_the_fix(libero_format_dataset, tmp_path):
    res = vla_cli("train", f"--dataset.root={libero_format_dataset}", f"--output_dir={tmp_path / 'a'}",
                  "--policy.action_dim=4", "--steps=1", *TINY_VLA)  # fmt: skip
    assert res.returncode == 2
    assert "policy.action_dim=4 but the dataset's action has 7 dimensions" in res.stderr
    res = vla_cli("train", f"--dataset.root={libero_format_dataset}", f"--output_dir={tmp_path / 'b'}",
                  "--dataset.cameras=[front]", "--steps=1", *TINY_VLA)  # fmt: skip
    assert res.returncode == 2
    assert "lacks features ['observation.images.front']" in res.stderr and "image2" in res.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b" / "checkpoints").exists()


def test_multitask_record_writes_every_task_into_one_dataset(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from sim.config import EnvConfig
    from sim.tasks import TASKS
    from vla_rl.record import RecordConfig, record

    out = tmp_path / "suite"
    summary = record(RecordConfig(env=EnvConfig(num_envs=4, image_size=32), tasks=["reach", "push"],
                                  num_episodes=2, output_dir=str(out), seed=3))  # fmt: skip
    assert summary["episodes"] == 4 and summary["tasks"] == ["reach", "push"]
    ds = LeRobotDataset("local/suite", root=out)
    assert ds.num_episodes == 4
    tasks = set(ds.meta.tasks.index)
    assert tasks == {TASKS["reach"]().instruction, TASKS["push"]().instruction}
    with pytest.raises(ValueError, match="valid tasks"):
        record(RecordConfig(tasks=["reach", "fly"], output_dir=str(tmp_path / "x")))
