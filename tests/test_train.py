import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vla_rl.checkpoint import load_policy, resolve_checkpoint, resolve_policy_dir

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_contents(tiny_checkpoint, tiny_dataset):
    out, summary = tiny_checkpoint
    ckpt = resolve_checkpoint(out)
    assert ckpt.name == "step-00000060" and summary["steps"] == 60
    # LeRobot's checkpoint layout: the policy as save_pretrained writes it, beside the training state.
    assert {p.name for p in ckpt.iterdir()} == {"pretrained_model", "metadata.json", "training_state"}
    assert {p.name for p in (ckpt / "pretrained_model").iterdir()} == {
        "model.safetensors", "config.json", "stats.json", "policy_preprocessor.json", "policy_postprocessor.json"
    }  # fmt: skip
    # accelerate's save_state: raw weights, optimizer, the LR schedule and the EMA, the RNG; plus our progress.
    assert {p.name for p in (ckpt / "training_state").iterdir()} == {
        "model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl",
        "random_states_0.pkl", "progress.pt",
    }  # fmt: skip
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["step"] == 60 and meta["dataset"] == str(tiny_dataset[0])
    config = json.loads((ckpt / "pretrained_model" / "config.json").read_text())
    assert config["type"] == "vla_rl_diffusion"  # LeRobot's config.json: the type (as LeRobot names it) and fields
    assert config["state_dim"] == 11 and config["action_dim"] == 4
    assert config["max_delay_steps"] == 0  # the default delay (fixed, 0 steps): no delay augmentation
    assert "cube" in config["vocabulary"]
    # Normalization statistics come from the dataset's own stats.json.
    ds_stats = json.loads((tiny_dataset[0] / "meta" / "stats.json").read_text())
    weights = load_file(str(ckpt / "pretrained_model" / "model.safetensors"))
    torch.testing.assert_close(
        weights["action_min"], torch.tensor(ds_stats["action"]["min"]).float()[:4], atol=1e-3, rtol=0
    )
    torch.testing.assert_close(weights["state_mean"], torch.tensor(ds_stats["observation.state"]["mean"]).float())
    # The policy is saved with the EMA's weights (diffusers' EMAModel, accelerate's second registered
    # object, after the LR schedule), not with the raw ones training continues from.
    ema = torch.load(ckpt / "training_state" / "custom_checkpoint_1.pkl", weights_only=False)
    raw = load_file(str(ckpt / "training_state" / "model.safetensors"))
    names = [name for name, _ in load_policy(out)[0].named_parameters()]  # all trainable, in EMA order
    assert len(names) == len(ema["shadow_params"]) and ema["decay"] == 0.995
    for name, shadow in zip(names, ema["shadow_params"], strict=True):
        torch.testing.assert_close(weights[name], shadow, rtol=0, atol=0)
    assert sum(not torch.equal(weights[n], raw[n]) for n in names) > len(names) // 2
    # Only the last two checkpoints are kept; no temporary directories remain.
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["last", "step-00000040", "step-00000060"]
    assert (out / "loss.png").stat().st_size > 1000


def test_loss_decreases(tiny_checkpoint):
    curve = tiny_checkpoint[1]["loss_curve"]
    assert [s for s, _ in curve] == [10, 20, 30, 40, 50, 60]
    assert curve[-1][1] < 0.6 * curve[0][1]


def _train_cmd(dataset, out, steps, save_every):
    return [
        sys.executable, "-m", "vla_rl.cli", "train", f"--dataset.root={dataset}", f"--output_dir={out}",
        f"--steps={steps}", f"--save_every={save_every}", "--log_every=5", "--batch_size=16",
        "--log_with=none", "--num_threads=1", "--warmup_steps=5", "--policy.hidden_dim=64", "--policy.vision_channels=16",
    ]  # fmt: skip


# Run `vla-rl train` in a child that SIGKILLs itself in the middle of writing the checkpoint of
# step ``argv[1]``: its weights are on disk in the temporary directory, not yet renamed into place.
# The kill happens at that point of the run whatever the machine's load, so no timing is involved.
KILL_WHILE_SAVING = """
import os, signal, sys
import policies.pretrained as pretrained
from vla_rl.cli import main

kill_at, original = int(sys.argv[1]), pretrained.save_model

def save_model(model, path, *args, **kwargs):
    original(model, path, *args, **kwargs)
    if f"step-{kill_at:08d}" in path:
        os.kill(os.getpid(), signal.SIGKILL)

pretrained.save_model = save_model
sys.exit(main(sys.argv[2:]))
"""


def test_killed_run_resumes_to_the_same_result(tiny_dataset, tmp_path):
    """SIGKILL mid-checkpoint, then --resume: same steps, same loss curve and same weights as an uninterrupted run."""
    from vla_rl.cli import main

    dataset = tiny_dataset[0]
    ref = tmp_path / "ref"
    assert main(_train_cmd(dataset, ref, 40, 10)[3:]) == 0

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILL_WHILE_SAVING, "30"] + _train_cmd(dataset, run, 40, 10)[3:],
                            env=env, capture_output=True, text=True, check=False)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert list((run / "checkpoints").glob(".tmp-step-00000030"))  # the half-written checkpoint, never renamed
    assert json.loads((resolve_checkpoint(run) / "metadata.json").read_text())["step"] == 20

    (run / "checkpoints" / ".last-12345").symlink_to("step-00000020")  # as a writer killed before its swap leaves
    assert main(_train_cmd(dataset, run, 40, 10)[3:] + ["--resume=true"]) == 0
    assert not list((run / "checkpoints").glob(".*"))  # the dead writers' leftovers are gone

    a = json.loads((ref / "train_summary.json").read_text())
    b = json.loads((run / "train_summary.json").read_text())
    assert b["steps"] == 40
    assert [s for s, _ in b["loss_curve"]] == [5 * i for i in range(1, 9)]
    assert [loss for _, loss in b["loss_curve"]] == pytest.approx([loss for _, loss in a["loss_curve"]], rel=1e-5)
    wa = load_file(str(resolve_policy_dir(ref) / "model.safetensors"))
    wb = load_file(str(resolve_policy_dir(run) / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


def test_existing_run_needs_resume(tiny_checkpoint, tiny_dataset):
    from vla_rl.train import DatasetConfig, TrainConfig, train

    out, _ = tiny_checkpoint
    with pytest.raises(FileExistsError, match="--resume=true"):
        train(TrainConfig(dataset=DatasetConfig(root=str(tiny_dataset[0])), output_dir=str(out), log_with="none"))


def test_resume_with_a_lower_lr_continues_the_schedule_from_the_new_peak(tiny_dataset, tmp_path):
    """The non-finite-loss stop says "lower --lr and --resume=true": the lower LR must take effect."""
    import math

    from vla_rl.cli import main

    run = tmp_path / "run"
    args = _train_cmd(tiny_dataset[0], run, 20, 5)[3:] + ["--lr=1e-3", "--warmup_steps=4"]
    assert main([a if a != "--steps=20" else "--steps=10" for a in args]) == 0
    assert main(args + ["--resume=true", "--lr=1e-4"]) == 0

    def cosine_with_warmup(step, peak, warmup=4, total=20):  # diffusers' "cosine", written out
        if step < warmup:
            return peak * step / warmup
        return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    state = run / "checkpoints" / "step-00000015" / "training_state"
    assert torch.load(state / "progress.pt", weights_only=False)["step"] == 15
    # The LR after 15 scheduler steps is the new peak's (3.1e-5), not the old one's (3.1e-4).
    optimizer = torch.load(state / "optimizer.bin", weights_only=False)
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(cosine_with_warmup(15, 1e-4), rel=1e-9)
