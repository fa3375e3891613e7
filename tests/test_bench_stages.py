"""The learning benchmarks' shared stages reuse a finished or part-done stage only if it is this run's:
a second seed (or another size) pointed at the first one's folder is refused, naming the setting, before
anything is recorded or trained."""

import json
from dataclasses import asdict

import pytest

from vla_rl import stages
from vla_rl.bench_rl import BenchRLConfig
from vla_rl.bench_stages import record_demos, train_imitation
from vla_rl.stages import DelayConfig


@pytest.fixture
def ran(monkeypatch):
    """The record and train stages replaced by recorders of the configs they were given."""
    calls = []
    monkeypatch.setattr(stages, "record", lambda cfg: calls.append(("record", cfg.seed)))
    monkeypatch.setattr(stages, "train", lambda cfg: calls.append(("train", cfg.seed, cfg.resume)))
    return calls


def recorded_dataset(folder, seed=0, episodes=200, task="track", num_envs=16):
    (folder / "meta").mkdir(parents=True)
    (folder / "meta" / "info.json").write_text("{}")
    config = {"seed": seed, "num_episodes": episodes, "env": {"task": task, "num_envs": num_envs}}
    (folder / "meta" / "vla_rl_record.json").write_text(json.dumps({"config": config}))


def test_a_dataset_of_another_seed_or_size_is_refused_and_this_runs_is_reused(tmp_path, ran):
    recorded_dataset(tmp_path / "dataset")
    record_demos(BenchRLConfig(), tmp_path / "dataset")  # seed 0, 200 demos of track over 16 worlds: reused
    assert ran == []
    with pytest.raises(ValueError, match="made with seed=0, but this run asks for seed=1"):
        record_demos(BenchRLConfig(seed=1), tmp_path / "dataset")
    with pytest.raises(ValueError, match="num_episodes=200, but this run asks for num_episodes=100"):
        record_demos(BenchRLConfig(demos=100), tmp_path / "dataset")
    record_demos(BenchRLConfig(), tmp_path / "fresh")  # nothing there: recorded
    assert ran == [("record", 0)]


def test_an_imitation_run_of_another_seed_or_delay_is_refused_before_training(tmp_path, ran):
    run = tmp_path / "imitation"
    (run / "checkpoints").mkdir(parents=True)
    saved = {
        "seed": 0,
        "steps": 4000,
        "batch_size": 64,
        "delay": asdict(DelayConfig()),
        "policy": {"type": "diffusion", "horizon": 16, "n_action_steps": 4},
    }
    (run / "train_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="seed=0, but this run asks for seed=1"):
        train_imitation(BenchRLConfig(seed=1), tmp_path / "dataset", run)
    with pytest.raises(ValueError, match="made with delay="):
        train_imitation(BenchRLConfig(), tmp_path / "dataset", run, DelayConfig(kind="uniform", low=0, high=8))
    with pytest.raises(ValueError, match="policy_type=diffusion, but this run asks for policy_type=autoregressive_vla"):
        train_imitation(BenchRLConfig(policy_type="autoregressive_vla", train_steps=4000), tmp_path / "dataset", run)
    with pytest.raises(ValueError, match="horizon=16, but this run asks for horizon=8"):
        train_imitation(BenchRLConfig(horizon=8), tmp_path / "dataset", run)
    ar = {**saved, "policy": {**saved["policy"], "type": "autoregressive_vla", "action_tokenizer": "fast"}}
    (tmp_path / "ar" / "checkpoints").mkdir(parents=True)
    (tmp_path / "ar" / "train_config.json").write_text(json.dumps(ar))
    with pytest.raises(ValueError, match="action_tokenizer=fast, but this run asks for action_tokenizer=uniform_bins"):
        train_imitation(BenchRLConfig(policy_type="autoregressive_vla", action_tokenizer="uniform_bins",
                                      train_steps=4000), tmp_path / "dataset", tmp_path / "ar")  # fmt: skip
    assert ran == []
    train_imitation(BenchRLConfig(), tmp_path / "dataset", run)  # the same run: resumed
    assert ran == [("train", 0, True)]


def test_the_token_vlas_localization_setting_records_the_true_state_and_reaches_its_imitation(tmp_path, monkeypatch):
    """`bench rl --policy_type=autoregressive_vla --action_frame=delta --environment_state_weight=1.0`: the
    demonstrations are recorded with the true state (a dataset without it is refused, naming the field), and the
    imitation policy gets the frame and the objective; a run from before the fields (neither in its config)
    resumes under the defaults, and a localized run is not resumed as a plain one."""
    seen = []
    monkeypatch.setattr(stages, "record", lambda cfg: seen.append(("record", cfg.environment_state)))
    monkeypatch.setattr(stages, "train", lambda cfg: seen.append(("train", cfg.policy.action_frame,
                                                                   cfg.policy.environment_state_weight)))  # fmt: skip
    localized = BenchRLConfig(policy_type="autoregressive_vla", action_frame="delta", environment_state_weight=1.0)
    record_demos(localized, tmp_path / "fresh")
    recorded_dataset(tmp_path / "plain")
    with pytest.raises(ValueError, match="environment_state=None, but this run asks for environment_state=True"):
        record_demos(localized, tmp_path / "plain")
    train_imitation(localized, tmp_path / "fresh", tmp_path / "imitation")
    old = tmp_path / "old_ar"
    (old / "checkpoints").mkdir(parents=True)
    (old / "train_config.json").write_text(json.dumps({"seed": 0, "steps": 12000, "batch_size": 64,
        "delay": asdict(DelayConfig()), "policy": {"type": "autoregressive_vla", "horizon": 16, "n_action_steps": 4,
                                                   "action_tokenizer": "uniform_bins"}}))  # fmt: skip
    train_imitation(BenchRLConfig(policy_type="autoregressive_vla"), tmp_path / "fresh", old)
    assert seen == [("record", True), ("train", "delta", 1.0), ("train", "absolute", 0.0)]
    localized_run = tmp_path / "localized"
    (localized_run / "checkpoints").mkdir(parents=True)
    config = json.loads((old / "train_config.json").read_text())
    config["policy"].update(action_frame="delta", environment_state_weight=1.0)
    (localized_run / "train_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="action_frame=delta, but this run asks for action_frame=absolute"):
        train_imitation(BenchRLConfig(policy_type="autoregressive_vla"), tmp_path / "fresh", localized_run)
    with pytest.raises(ValueError, match="set the token VLA's imitation; pass --policy_type=autoregressive_vla"):
        from vla_rl.bench_rl import bench_rl

        bench_rl(BenchRLConfig(environment_state_weight=1.0, output_dir=str(tmp_path / "bench")))
