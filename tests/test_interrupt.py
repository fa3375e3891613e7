"""Stop signals: SIGINT and SIGTERM end every long command cleanly, however it was started.

A signal is sent at several points of a training step and of a checkpoint write (from inside
the process, at exactly that point, so no test depends on timing). Each time the command must
exit with 128 + the signal number and leave a checkpoint from which `--resume=true` finishes the
run with the same weights and loss curve as a run that was never interrupted.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vla_core import interrupt
from vla_rl.checkpoint import load_policy, resolve_checkpoint, resolve_policy_dir
from vla_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 12, 5


def _train_args(dataset, out, steps=STEPS):
    return [
        "train", f"--dataset.root={dataset}", f"--output_dir={out}", f"--steps={steps}", f"--save_every={SAVE_EVERY}",
        "--log_every=2", "--batch_size=8", "--log_with=none", "--num_threads=1", "--warmup_steps=2",
        "--policy.hidden_dim=32", "--policy.vision_channels=8",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference_run(tiny_dataset, tmp_path_factory):
    """The uninterrupted run every interrupted-then-resumed run must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(_train_args(tiny_dataset[0], out)) == 0
    return out


def _signal_on_call(monkeypatch, owner, name, sig, when, after=True, match=lambda *args: True):
    """Wrap owner.name so that on its ``when``-th call that ``match``es (counting from 1) it sends ``sig``
    to this process, just ``after`` the call or just before it."""
    original = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += bool(match(*args))
        fire = calls["n"] == when and match(*args)
        if fire and not after:
            os.kill(os.getpid(), sig)
        result = original(*args, **kwargs)
        if fire and after:
            os.kill(os.getpid(), sig)
        return result

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def _points():
    import policies.pretrained as pretrained_module
    import vla_rl.train as train_module
    from policies.diffusion.modeling_diffusion import DiffusionPolicy

    def swaps_last(src, dst, *rest):
        return Path(dst).name == "last"

    # point name: (owner, attribute, call number, signal after the call (else before), which calls count)
    return {
        "start of a step (batch sampling)": (train_module, "random_shift", 4, False, lambda *a: True),
        "inside the forward pass": (DiffusionPolicy, "forward", 7, True, lambda *a: True),
        "inside the optimizer step": (torch.optim.AdamW, "step", 3, False, lambda *a: True),
        "checkpoint: weights written, not yet renamed": (pretrained_module, "save_model", 1, True, lambda *a: True),
        "checkpoint: training state being written": (torch, "save", 1, False, lambda *a: True),
        "checkpoint: `last` being swapped": (os, "replace", 1, False, swaps_last),
    }


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("point", list(_points()))
def test_signal_at_any_point_exits_with_its_code_and_a_checkpoint_resume_completes(
    point, sig, tiny_dataset, reference_run, tmp_path, monkeypatch
):
    owner, name, when, after, match = _points()[point]
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        calls = _signal_on_call(patch, owner, name, sig, when, after, match)
        code = main(_train_args(tiny_dataset[0], out))
    assert calls["n"] >= when, "the signal point was never reached"
    assert code == 128 + sig
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the command's handlers are gone again

    ckpt = resolve_checkpoint(out)
    step = json.loads((ckpt / "metadata.json").read_text())["step"]
    progress = torch.load(ckpt / "training_state" / "progress.pt", weights_only=False)
    assert progress["step"] == step and 0 < step < STEPS  # stopped early, at a step boundary
    load_policy(out)  # intact and loadable
    assert not list((out / "checkpoints").glob(".tmp-*"))

    assert main(_train_args(tiny_dataset[0], out) + ["--resume=true"]) == 0
    ref = json.loads((reference_run / "train_summary.json").read_text())
    got = json.loads((out / "train_summary.json").read_text())
    assert got["steps"] == STEPS
    assert [s for s, _ in got["loss_curve"]] == [s for s, _ in ref["loss_curve"]]
    assert [v for _, v in got["loss_curve"]] == pytest.approx([v for _, v in ref["loss_curve"]], rel=1e-5)
    wa = load_file(str(resolve_policy_dir(reference_run) / "model.safetensors"))
    wb = load_file(str(resolve_policy_dir(out) / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "sig, inherited",
    [(signal.SIGINT, signal.SIG_IGN), (signal.SIGTERM, signal.SIG_DFL)],
    ids=["SIGINT-inherited-as-ignored", "SIGTERM"],
)
def test_a_background_run_stops_cleanly_whatever_it_inherited(sig, inherited, tiny_dataset, tmp_path):
    """A job started with `&` from a script inherits SIGINT ignored; a scheduler sends SIGTERM."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vla_rl.cli"] + _train_args(tiny_dataset[0], out, steps=100000)
    # The child's disposition is set explicitly, so this test does not depend on how pytest was started.
    proc = subprocess.Popen(
        cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, inherited),  # noqa: PLW1509 (no threads in this child yet)
    )  # fmt: skip
    checkpoints = out / "checkpoints"
    try:
        # Waits on a checkpoint, not on a clock; any one, as only the last two are kept: the first can be
        # gone before a poll sees it.
        while not any(checkpoints.glob("step-*")):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"interrupted by {signal.Signals(sig).name}" in err and "Continue with --resume=true" in err
    ckpt = resolve_checkpoint(out)
    progress = torch.load(ckpt / "training_state" / "progress.pt", weights_only=False)
    assert progress["step"] == json.loads((ckpt / "metadata.json").read_text())["step"] >= SAVE_EVERY
    assert len(torch.load(ckpt / "training_state" / "optimizer.bin", weights_only=False)["state"]) > 0
    load_policy(out)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_record_leaves_no_dataset(sig, tmp_path, monkeypatch):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    out = tmp_path / "demos"
    calls = _signal_on_call(monkeypatch, LeRobotDataset, "save_episode", sig, 2)
    code = main(["record", "--env.num_envs=2", "--num_episodes=4", f"--output_dir={out}"])
    assert calls["n"] == 2  # stopped right after the second episode, before a third was saved
    assert code == 128 + sig
    assert not out.exists() and not list(tmp_path.iterdir())  # neither the dataset nor its temporary copy


def _eval(checkpoint, out, video_episodes: int) -> int:
    """`vla-rl eval` of 2 episodes in 2 worlds; its exit code."""
    return main(["eval", f"--checkpoint={checkpoint}", "--env.num_envs=2", "--num_episodes=2",
                 f"--video_episodes={video_episodes}", f"--output_dir={out}"])  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_eval_writes_no_results(sig, tiny_checkpoint, tmp_path, monkeypatch):
    from vla_core.runtime.delayed_env import DelayedChunkEnv

    out = tmp_path / "eval"
    calls = _signal_on_call(monkeypatch, DelayedChunkEnv, "step", sig, 3)
    code = _eval(tiny_checkpoint[0], out, video_episodes=0)
    assert calls["n"] == 3  # the rollout stopped at the step boundary after the signal
    assert code == 128 + sig
    assert not (out / "eval.json").exists()


def test_deferred_block_notes_a_signal_until_the_step_boundary():
    reached = []
    with pytest.raises(interrupt.Interrupted) as stopped, interrupt.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        reached.append("rest of the step")  # the signal did not cut the step short
        interrupt.raise_if_stopped()
        reached.append("next step")
    assert reached == ["rest of the step"]
    assert stopped.value.exit_code == 143
    # Outside a deferred block the signal stops at once, as Ctrl-C normally does; after it SIGINT's handler is the
    # one found before (Python's default, or SIG_IGN in a job a non-interactive shell started with `&`).
    found = signal.getsignal(signal.SIGINT)
    with pytest.raises(interrupt.Interrupted), interrupt.handlers():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
        reached.append("after an immediate stop")
    assert reached == ["rest of the step"]
    assert signal.getsignal(signal.SIGINT) is found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_eval_writes_its_results_leaves_them_whole(sig, tiny_checkpoint, tmp_path, monkeypatch):
    import vla_rl.eval as eval_module

    out = tmp_path / "eval"
    calls = _signal_on_call(monkeypatch, eval_module, "_write_video", sig, 1)
    code = _eval(tiny_checkpoint[0], out, video_episodes=1)
    assert calls["n"] == 1 and code == 128 + sig
    result = json.loads((out / "eval.json").read_text())  # written after the signal, whole
    assert result["episodes"] == 2 and result["video"] == str(out / "rollouts.mp4")
    assert f"({result['successes']}/2)" in (out / "summary.md").read_text()
    assert (out / "rollouts.mp4").stat().st_size > 1000
    assert sorted(p.name for p in out.iterdir()) == [
        "episodes.jsonl",
        "eval.json",
        "rollouts.mp4",
        "summary.md",
    ]  # no temporaries


def test_a_signal_while_train_writes_its_summary_leaves_it_whole(tiny_dataset, tmp_path, monkeypatch):
    import vla_rl.train as train_module

    out = tmp_path / "run"
    calls = _signal_on_call(monkeypatch, train_module, "write_text_atomic", signal.SIGTERM, 2)  # config, summary
    assert main(_train_args(tiny_dataset[0], out)) == 128 + signal.SIGTERM
    assert calls["n"] >= 2
    assert json.loads((out / "train_summary.json").read_text())["steps"] == STEPS
    assert (out / "loss.png").stat().st_size > 1000  # the plot after it was still drawn


def test_record_overwrite_swaps_the_whole_dataset_even_when_signalled(tmp_path, monkeypatch):
    from vla_core import files

    out = tmp_path / "demos"
    assert main(["record", "--env.num_envs=2", "--num_episodes=2", f"--output_dir={out}"]) == 0
    first = json.loads((out / "meta" / "info.json").read_text())["total_episodes"]
    calls = _signal_on_call(monkeypatch, files.os, "rename", signal.SIGTERM, 1, after=True,
                            match=lambda src, dst: Path(dst).name.startswith(".demos.old"))  # fmt: skip
    code = main(["record", "--env.num_envs=2", "--num_episodes=3", f"--output_dir={out}", "--overwrite=true"])
    assert calls["n"] == 1 and code == 128 + signal.SIGTERM
    # Signalled between moving the old dataset aside and moving the new one in: the swap completed.
    assert (first, json.loads((out / "meta" / "info.json").read_text())["total_episodes"]) == (2, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demos"]
