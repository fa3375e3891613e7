"""VLA-RL's process reward: `vla-rl train-prm` on recorded demonstrations (its progress rises along held-out
episodes), the potential-based shaping against hand-worked numbers, and `vla-rl finetune
--reward.process_model` end to end (the learner's rewards are the sparse ones plus exactly the shaping)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import spearmanr

from policies.denoising_chain import DenoisingChain
from policies.tokenizer import word_vocabulary
from sim.config import EnvConfig
from vla_rl.finetune import FinetuneConfig, finetune
from vla_rl.rl.ppo import PPOConfig
from vla_rl.rl.process_reward import (
    ProcessReward,
    ProgressModel,
    ProgressModelConfig,
    RewardConfig,
    load_process_reward,
    potential_shaping,
)
from vla_rl.rl.rollout import Rollout

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prm(tiny_dataset, tmp_path_factory):
    """`vla-rl train-prm` on the six recorded lift demonstrations, two of them held out (state and
    instruction only: the fast model)."""
    out = tmp_path_factory.mktemp("prm") / "model"
    command = [
        sys.executable, "-m", "vla_rl.cli", "train-prm", f"--dataset.root={tiny_dataset[0]}", f"--output_dir={out}",
        "--held_out=0.34", "--steps=300", "--batch_size=128", "--num_threads=2", "--seed=0",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held out 2 episodes" in proc.stdout and f"--reward.process_model={out}" in proc.stdout
    return out


def _episodes(root: Path) -> dict[int, dict]:
    """Each episode of the dataset read with the datasets library alone: its states and instructions in order."""
    from vla_core.data import open_dataset

    dataset = open_dataset(root)
    table = dataset.hf_dataset.select_columns(["observation.state", "episode_index", "task_index", "frame_index"])
    table = table.with_format("torch")[:]
    tasks = {int(dataset.meta.tasks.loc[t, "task_index"]): str(t) for t in dataset.meta.tasks.index}
    out = {}
    for e in table["episode_index"].unique().tolist():
        rows = torch.nonzero(table["episode_index"] == e).flatten()
        rows = rows[torch.argsort(table["frame_index"][rows])]
        out[e] = {"observation.state": table["observation.state"][rows].float(),
                  "task": [tasks[int(i)] for i in table["task_index"][rows]]}  # fmt: skip
    return out


def test_the_progress_model_rises_along_each_held_out_demonstration(prm, tiny_dataset):
    """On the two episodes it never trained on, the predicted progress follows time: Spearman's rank
    correlation above 0.9 (scipy's, on frames read here) and the last frame well above the first. The
    seeded split holds out two of six episodes and trains on the rest, and the summary's figures are the
    ones measured here."""
    summary = json.loads((prm / "prm_summary.json").read_text())
    episodes = _episodes(tiny_dataset[0])
    held, trained = summary["held_out"]["episodes"], summary["train"]["episodes"]
    assert len(held) == 2 and sorted(held + trained) == sorted(episodes) and not set(held) & set(trained)
    assert summary["train"]["failed_episodes"] == 0  # `vla-rl record` keeps successful episodes only
    model = ProgressModel.load(prm)
    assert {p.name for p in prm.iterdir()} == {"config.json", "model.safetensors", "prm_summary.json"}
    reported = {p["episode"]: p for p in summary["held_out"]["per_episode"]}
    for e in held:
        with torch.no_grad():
            progress = torch.sigmoid(model(episodes[e])).numpy()
        rho = spearmanr(progress, range(len(progress))).statistic
        assert rho > 0.9, (e, rho, progress)
        assert progress[-1] > progress[0] + 0.5, (e, progress)
        assert reported[e]["spearman"] == pytest.approx(rho, abs=1e-3)
        assert reported[e]["first"] == pytest.approx(progress[0], abs=1e-3)
    assert summary["held_out"]["last_above_first"] == 2


def test_train_prm_refuses_bad_input_with_one_line_naming_the_fix(prm, tiny_dataset, tmp_path):
    from vla_rl.train_prm import PRMDatasetConfig, TrainPRMConfig, train_prm

    cases = [
        ({"dataset": PRMDatasetConfig(root=str(tmp_path / "nope"))}, FileNotFoundError, "no LeRobotDataset at"),
        ({"output_dir": str(prm)}, FileExistsError, "already exists; pass --overwrite=true"),
        ({"camera": "wrist"}, ValueError, "has no camera 'wrist'; choose --camera from ['front'] or ''"),
        ({"held_out": 1.0}, ValueError, "--held_out=1.0 must be in [0, 1)"),
        ({"held_out": 0.95}, ValueError, "--held_out=0.95 leaves no training episode (the dataset has 6)"),
    ]
    for overrides, error, message in cases:
        fields = {"dataset": PRMDatasetConfig(root=str(tiny_dataset[0])), "output_dir": str(tmp_path / "out"),
                  "steps": 1, "num_threads": 1, **overrides}  # fmt: skip
        with pytest.raises(error, match=re.escape(message)):
            train_prm(TrainPRMConfig(**fields))
        assert not (tmp_path / "out").exists()


def test_the_split_is_a_seeded_draw_of_whole_episodes():
    from vla_rl.train_prm import split_episodes

    episodes = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 4, 5])  # frames' episode indices
    draw = torch.randperm(6, generator=torch.Generator().manual_seed(3)).tolist()
    assert split_episodes(episodes, 0.34, seed=3) == (sorted(set(range(6)) - set(draw[:2])), sorted(draw[:2]))
    assert split_episodes(episodes, 0.34, seed=3) == split_episodes(episodes, 0.34, seed=3)
    assert split_episodes(episodes, 0.0, seed=3) == ([0, 1, 2, 3, 4, 5], [])
    with pytest.raises(ValueError, match=re.escape("--held_out=0.95 leaves no training episode")):
        split_episodes(episodes, 0.95, seed=3)


def _dataset(with_success: bool):
    """Three episodes as LeRobot stores them: 3 frames that end in success, 2 that never succeed, 1 that
    succeeds at once (``next.success`` per frame, or no such column: a dataset of demonstrations only)."""
    from types import SimpleNamespace

    import pandas as pd
    from datasets import Dataset

    columns = {"observation.state": [[float(i)] for i in range(6)], "episode_index": [0, 0, 0, 1, 1, 2],
               "task_index": [0, 0, 0, 1, 1, 0]}  # fmt: skip
    features = {"observation.state": {}, "episode_index": {}, "task_index": {}}
    if with_success:
        columns["next.success"] = [[False], [False], [True], [False], [False], [True]]
        features["next.success"] = {}
    tasks = pd.DataFrame({"task_index": [0, 1]}, index=["lift it", "push it"])
    return SimpleNamespace(
        root="d", hf_dataset=Dataset.from_dict(columns), meta=SimpleNamespace(features=features, tasks=tasks)
    )


def test_frames_are_labelled_by_their_place_in_a_successful_episode_and_zero_in_a_failed_one():
    from vla_rl.train_prm import read_frames

    frames = read_frames(_dataset(with_success=True), camera="")
    assert frames.step.tolist() == [0, 1, 2, 0, 1, 0] and frames.length.tolist() == [3, 3, 3, 2, 2, 1]
    assert frames.task == ["lift it"] * 3 + ["push it"] * 2 + ["lift it"]
    torch.testing.assert_close(frames.label, torch.tensor([0.0, 0.5, 1.0, 0.0, 0.0, 1.0]))
    without = read_frames(_dataset(with_success=False), camera="")  # every episode a demonstration
    torch.testing.assert_close(without.label, torch.tensor([0.0, 0.5, 1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=re.escape("has no camera 'front'; choose --camera from [] or ''")):
        read_frames(_dataset(with_success=True), camera="front")


def _rollout(world, episode, done, discount, reward) -> Rollout:
    m = len(world)
    return Rollout(
        obs={"observation.state": torch.zeros(m, 1), "task": ["t"] * m}, obs_step=torch.zeros(m, dtype=torch.long),
        decision=DenoisingChain(latents=torch.zeros(m, 2, 1, 1), std=torch.ones(1), known=None),
        executed=torch.ones(m, 1, dtype=torch.bool), world=torch.tensor(world), episode=torch.tensor(episode), task=torch.zeros(m, dtype=torch.long),
        reward=torch.tensor(reward), discount=torch.tensor(discount), steps=torch.ones(m, dtype=torch.long),
        done=torch.tensor(done), truncated=torch.zeros(m, dtype=torch.bool), success=torch.zeros(m, dtype=torch.bool),
        diverged=torch.zeros(m, dtype=torch.bool),
    )  # fmt: skip


class _Potentials:
    """A stand-in model whose progress is given."""

    def __init__(self, phi):
        self.phi = torch.tensor(phi)

    def progress(self, obs):
        return self.phi


def test_shaping_by_hand():
    """World 0 runs a 3-decision episode that succeeds, then a 1-decision one; world 1 a 2-decision episode
    that hits its time limit. F_i = g_i Phi(o_{i+1}) - Phi(o_i), with Phi = 0 after each episode's last
    decision:

        F = [0.9*0.4 - 0.1, 0.81*0.8 - 0.4, 0 - 0.8, 0 - 0.3, 0.9*0.6 - 0.2, 0 - 0.6]
          = [0.26, 0.248, -0.8, -0.3, 0.34, -0.6]

    and with w = 0.5 the rewards [0, 0, 1, 0, 0, 0] become [0.13, 0.124, 0.6, -0.15, 0.17, -0.3]."""
    world, episode = [0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 0, 0]
    done, discount = [False, False, True, True, False, True], [0.9, 0.81, 0.9, 0.5, 0.9, 0.9]
    phi = [0.1, 0.4, 0.8, 0.3, 0.2, 0.6]
    going_on = torch.tensor([True, True, False, False, True, False])
    terms = potential_shaping(torch.tensor(phi), torch.tensor(discount), going_on)
    torch.testing.assert_close(terms, torch.tensor([0.26, 0.248, -0.8, -0.3, 0.34, -0.6]))
    rollout = _rollout(world, episode, done, discount, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    stats = ProcessReward(_Potentials(phi), 0.5, "prm").shape(rollout)
    torch.testing.assert_close(rollout.reward, torch.tensor([0.13, 0.124, 0.6, -0.15, 0.17, -0.3]))
    assert stats["process_reward_mean"] == pytest.approx(0.5 * (0.26 + 0.248 - 0.8 - 0.3 + 0.34 - 0.6) / 6)
    assert stats["progress_mean"] == pytest.approx(2.4 / 6)
    # Telescoping: the first episode's discounted shaping sums to -w Phi(o_0): 0.13 + 0.9 (0.124 + 0.81 (0.6 - 1)).
    assert 0.13 + 0.9 * 0.124 + 0.9 * 0.81 * (0.6 - 1.0) == pytest.approx(-0.5 * 0.1)
    # A world's next episode is never read as the next observation, even if a done flag were missing.
    rollout = _rollout([0, 0], [0, 1], [False, False], [0.9, 0.9], [0.0, 0.0])
    ProcessReward(_Potentials([0.5, 0.7]), 1.0, "prm").shape(rollout)
    torch.testing.assert_close(rollout.reward, torch.tensor([-0.5, 0.9 * 0.0 - 0.7]))


def _small_run(checkpoint, out, **overrides) -> FinetuneConfig:
    fields = {
        "checkpoint": str(checkpoint), "env": EnvConfig(num_envs=4, max_episode_steps=12), "iterations": 1,
        "update_epochs": 1, "minibatch_size": 16, "eval_every": 0, "output_dir": str(out), "num_threads": 2,
        "log_with": "none", "ppo": PPOConfig(critic_warmup_iterations=0, episodes_per_world=1),
    }  # fmt: skip
    return FinetuneConfig(**{**fields, **overrides})


def test_finetune_adds_exactly_the_shaping_term_to_the_sparse_rewards(prm, tiny_checkpoint, tmp_path, monkeypatch):
    """The rollout's sparse rewards as collected, and the rewards PPO's update receives: they differ by
    w (g_i Phi(o_{i+1}) - Phi(o_i)), Phi computed here from the saved model on the recorded observations,
    0 after each episode's end; each episode's discounted shaping sums to -w Phi(o_0). The history and
    the summary report the term's mean; a resumed run must keep the same process reward."""
    from vla_rl.rl import ppo, sources

    collected, updated = [], []
    collect, update = sources.collect, ppo.PPO.update

    def spy_collect(*args, **kwargs):
        rollout, stats = collect(*args, **kwargs)
        collected.append(rollout.reward.clone())
        return rollout, stats

    def spy_update(self, rollout, iteration):
        updated.append(rollout)
        return update(self, rollout, iteration)

    monkeypatch.setattr(sources, "collect", spy_collect)
    monkeypatch.setattr(ppo.PPO, "update", spy_update)
    w = 0.5
    summary = finetune(_small_run(tiny_checkpoint[0], tmp_path / "ft",
                                  reward=RewardConfig(process_model=str(prm), process_weight=w)))  # fmt: skip
    (sparse,), (rollout,) = collected, updated
    model = ProgressModel.load(prm)
    with torch.no_grad():
        phi = torch.sigmoid(model({k: rollout.obs[k] for k in ("observation.state", "task")})).tolist()
    expected = []
    key = list(zip(rollout.world.tolist(), rollout.episode.tolist(), strict=True))
    for i in range(len(rollout)):
        same = i + 1 < len(rollout) and key[i + 1] == key[i]
        following = phi[i + 1] if same and not rollout.done[i] else 0.0
        expected.append(float(sparse[i]) + w * (float(rollout.discount[i]) * following - phi[i]))
    torch.testing.assert_close(rollout.reward, torch.tensor(expected), atol=1e-5, rtol=0)
    assert not torch.allclose(rollout.reward, sparse)
    for e in set(key):
        rows = [i for i in range(len(rollout)) if key[i] == e]
        weight, total = 1.0, 0.0
        for i in rows:
            total += weight * float(rollout.reward[i] - sparse[i])
            weight *= float(rollout.discount[i])
        assert total == pytest.approx(-w * phi[rows[0]], abs=1e-5)
    mean = float((rollout.reward - sparse).mean())
    assert summary["history"][0]["process_reward_mean"] == pytest.approx(mean, abs=1e-5)
    assert summary["process_reward"] == {
        "model": str(prm),
        "weight": w,
        "mean_per_decision": pytest.approx(mean, abs=1e-5),
    }
    saved = json.loads((tmp_path / "ft" / "finetune_config.json").read_text())
    assert saved["reward"] == {"process_model": str(prm), "process_weight": w}
    # Resumed: the same process reward, or one line naming it; with it, the weights of a run never stopped.
    with pytest.raises(
        ValueError, match=re.escape(f"resume it with --reward.process_model={prm} --reward.process_weight=0.5")
    ):
        finetune(_small_run(tiny_checkpoint[0], tmp_path / "ft", iterations=2, resume=True))
    resumed = finetune(_small_run(tiny_checkpoint[0], tmp_path / "ft", iterations=2, resume=True,
                                  reward=RewardConfig(process_model=str(prm), process_weight=w)))  # fmt: skip
    straight = finetune(_small_run(tiny_checkpoint[0], tmp_path / "straight", iterations=2,
                                   reward=RewardConfig(process_model=str(prm), process_weight=w)))  # fmt: skip
    pick = lambda run: [(h["iteration"], h["process_reward_mean"]) for h in run["history"]]
    assert pick(resumed) == pick(straight) and len(pick(straight)) == 2
    a, b = (load_file(str(tmp_path / run / "checkpoints/last/pretrained_model/model.safetensors"))
            for run in ("ft", "straight"))  # fmt: skip
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Env:
    """What `load_process_reward` reads of an env: its state feature and its instructions."""

    def __init__(self, state_dim: int, instruction: str):
        self.features = {"observation.state": {"shape": (state_dim,)}}
        self.instruction = instruction

    def reset(self, seed):
        return {"task": [self.instruction]}


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"state_dim": 5}, "reads a 5-dim state but env 'lift' has 11; train one on this task's demonstrations"),
        ({"tasks": ["open the drawer"]}, "was not trained on 'lift': its instruction has words it never read (cube, pick, red, up)"),
        ({"camera": "wrist", "image_size": 64}, "reads camera 'wrist' at 64px but the env renders ['front'] at 64px"),
        ({"camera": "front", "image_size": 32}, "reads camera 'front' at 32px but the env renders ['front'] at 64px"),
    ],
)  # fmt: skip
def test_a_process_model_that_does_not_fit_the_env_is_refused(tmp_path, model, message):
    tasks = model.pop("tasks", ["pick up the red cube"])
    config = ProgressModelConfig(**{"state_dim": 11, "vocabulary": word_vocabulary(tasks), "tasks": tasks, **model})
    ProgressModel(config).save(tmp_path / "prm")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_process_reward(RewardConfig(process_model=str(tmp_path / "prm")), [_Env(11, "pick up the red cube")],
                            [EnvConfig(task="lift")], "cpu")  # fmt: skip


@pytest.mark.parametrize(
    ("reward", "algo", "message"),
    [
        ({"process_model": "nowhere"}, "ppo", "no process reward model at nowhere (missing config.json"),
        ({"process_model": "CHECKPOINT"}, "ppo", "holds a 'vla_rl_diffusion' model, not a process reward model; train one with"),
        ({"process_model": "PRM"}, "grpo", "GRPO compares whole episodes from one initial state by success"),
        ({"process_weight": 2.0}, "ppo", "--reward.process_weight does nothing without --reward.process_model"),
        ({"process_model": "PRM", "process_weight": 0.0}, "ppo", "--reward.process_weight=0.0 must be a finite number > 0"),
    ],
)  # fmt: skip
def test_bad_reward_flags_get_one_line_naming_the_fix(tiny_checkpoint, prm, tmp_path, reward, algo, message):
    paths = {"PRM": str(prm), "CHECKPOINT": str(tiny_checkpoint[0] / "checkpoints" / "last" / "pretrained_model")}
    reward = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in reward.items()}
    extra = {"algo": "grpo", "ppo": PPOConfig()} if algo == "grpo" else {}
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        finetune(_small_run(tiny_checkpoint[0], tmp_path / "bad", reward=RewardConfig(**reward), **extra))
    assert not (tmp_path / "bad").exists()  # refused before any output
