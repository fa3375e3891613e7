import numpy as np
import pytest
import torch
from lerobot.datasets.lerobot_dataset import LeRobotDataset

from sim.config import EnvConfig
from vla_rl.record import RecordConfig, record


def test_lerobot_reads_the_recorded_dataset(tiny_dataset):
    root, summary = tiny_dataset
    ds = LeRobotDataset("local/lift", root=root, video_backend="pyav")
    assert ds.meta.info["codebase_version"] == "v3.0"
    assert ds.num_episodes == 6 == summary["episodes"]
    assert len(ds) == summary["frames"]
    assert ds.fps == 20
    assert ds.meta.features["observation.images.front"]["shape"] == (64, 64, 3) or ds.meta.features[
        "observation.images.front"
    ]["shape"] == [64, 64, 3]
    frame = ds[0]
    assert frame["observation.images.front"].shape == (3, 64, 64)
    assert frame["observation.state"].shape == (11,)
    assert frame["action"].shape == (4,)
    assert frame["task"] == "pick up the red cube"
    # Episode boundaries: frame_index restarts at 0 at each episode start, and every episode
    # ends with the success flag raised (only successful expert episodes are kept).
    episodes = ds.hf_dataset["episode_index"]
    frame_index = ds.hf_dataset["frame_index"]
    success = ds.hf_dataset["next.success"]
    starts = [i for i in range(len(ds)) if i == 0 or episodes[i] != episodes[i - 1]]
    assert len(starts) == 6
    assert all(int(frame_index[s]) == 0 for s in starts)
    ends = [s - 1 for s in starts[1:]] + [len(ds) - 1]
    flags = [bool(torch.as_tensor(s).reshape(-1)[0]) for s in success]
    assert all(flags[e] for e in ends)
    assert sum(flags) == 6
    # The action is an end-effector target close to the current end-effector position (state[8:11]).
    state = torch.stack([torch.as_tensor(s) for s in ds.hf_dataset["observation.state"]])
    action = torch.stack([torch.as_tensor(a) for a in ds.hf_dataset["action"]])
    assert (action[:, :3] - state[:, 8:11]).norm(dim=1).max() <= 0.0251
    assert set(np.unique(action[:, 3].numpy())) <= {0.0, 1.0}


def test_dataset_features_are_the_envs_named_features(tiny_dataset):
    ds = LeRobotDataset("local/lift", root=tiny_dataset[0], video_backend="pyav")
    features = ds.meta.features
    assert features["observation.state"]["names"] == [f"joint{i}" for i in range(1, 8)] + [
        "gripper_width", "ee_x", "ee_y", "ee_z",
    ]  # fmt: skip
    assert features["action"]["names"] == ["ee_x", "ee_y", "ee_z", "grip"]
    assert features["observation.images.front"]["dtype"] == "image"
    assert features["observation.images.front"]["names"] == ["height", "width", "channels"]
    assert {"next.reward", "next.success"} <= set(features)


def test_record_refuses_to_overwrite_and_leaves_no_temp(tiny_dataset):
    root, _ = tiny_dataset
    with pytest.raises(FileExistsError, match="--overwrite=true"):
        record(RecordConfig(env=EnvConfig(num_envs=2), num_episodes=1, output_dir=str(root)))
    assert not any(p.name.endswith(".tmp") for p in root.parent.iterdir())


def test_interrupted_recording_leaves_no_dataset(tmp_path, monkeypatch):
    import sim.mujoco_env as env_mod

    calls = {"n": 0}
    real_step = env_mod.MujocoBatchedEnv.step

    def step_then_interrupt(self, actions):
        calls["n"] += 1
        if calls["n"] == 30:
            raise KeyboardInterrupt
        return real_step(self, actions)

    monkeypatch.setattr(env_mod.MujocoBatchedEnv, "step", step_then_interrupt)
    out = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt):
        record(RecordConfig(env=EnvConfig(num_envs=2), num_episodes=5, output_dir=str(out)))
    assert not list(tmp_path.iterdir())  # neither the dataset nor its hidden temporary copy


def test_record_shows_one_progress_bar(tmp_path, capfd):
    """The `datasets` library's `Map:` bar for every saved episode used to bury the command's own bar."""
    record(RecordConfig(env=EnvConfig(num_envs=2), num_episodes=3, output_dir=str(tmp_path / "ds")))
    err = capfd.readouterr().err
    bars = {line.split(":")[0].strip() for line in err.replace("\r", "\n").splitlines() if "%|" in line}
    assert bars == {"record lift"}, err[-2000:]


def test_in_memory_demos_match_lerobot_frames(tiny_dataset):
    from vla_core.data import ChunkedDemos, open_dataset

    ds = open_dataset(tiny_dataset[0])
    demos = ChunkedDemos(ds)
    for i in (0, 17, len(ds) - 1):
        frame = ds[i]
        torch.testing.assert_close(
            demos.images["front"][i].float() / 255, frame["observation.images.front"], atol=1e-6, rtol=0
        )
        torch.testing.assert_close(demos.state[i], frame["observation.state"])
        torch.testing.assert_close(demos.action[i], frame["action"])
    # A chunk starting 3 frames before an episode's end: 3 real actions, then the last one repeated as padding.
    end = int(demos.episode_end[0])
    batch = demos.batch(torch.tensor([end - 3]), horizon=6)
    assert batch["action_is_pad"][0].tolist() == [False, False, False, True, True, True]
    torch.testing.assert_close(batch["action"][0, 3:], demos.action[end - 1].expand(3, -1))
    torch.testing.assert_close(batch["action"][0, :3], demos.action[end - 3 : end])


def test_the_true_state_is_recorded_as_environment_state_at_each_observations_moment(tmp_path):
    """``environment_state=true`` on ``track``: LeRobot's observation.environment_state holds the ball's position
    and velocity, named per axis. Checked against the task's physics, not the recorder: the ball (undamped,
    colliding with nothing) keeps one velocity along y, at a speed in the task's range, and moves by velocity x
    the 50 ms control period from each frame to the next. Two tasks of other entries are refused in one line."""
    summary = record(RecordConfig(env=EnvConfig(task="track", num_envs=2, cameras=[]), num_episodes=2,
                                  output_dir=str(tmp_path / "ds"), environment_state=True))  # fmt: skip
    ds = LeRobotDataset("local/x", root=summary["dataset"])
    feature = ds.meta.features["observation.environment_state"]
    assert feature["names"] == ["target_x", "target_y", "target_z", "target_vel_x", "target_vel_y", "target_vel_z"]
    frames = ds.hf_dataset.with_format("numpy")[:]
    state, episode = np.stack(frames["observation.environment_state"]), np.asarray(frames["episode_index"])
    for e in np.unique(episode):
        ball = state[episode == e]
        assert np.allclose(ball[:, 3:], ball[0, 3:], atol=1e-6) and ball[0, 3] == ball[0, 5] == 0.0
        assert 0.08 <= abs(ball[0, 4]) <= 0.12
        assert np.allclose(np.diff(ball[:, :3], axis=0), ball[:-1, 3:] * 0.05, atol=1e-5)
    from vla_core.data import ChunkedDemos, open_dataset

    demos = ChunkedDemos(open_dataset(summary["dataset"], None), None)  # the labels reach a training batch
    batch = demos.batch(torch.tensor([0, 3]), 4)
    assert torch.equal(batch["observation.environment_state"], torch.as_tensor(state[[0, 3]]))
    with pytest.raises(ValueError, match="other privileged entries"):
        record(RecordConfig(env=EnvConfig(num_envs=2, cameras=[]), tasks=["track", "lift"], num_episodes=1,
                            output_dir=str(tmp_path / "two"), environment_state=True))  # fmt: skip
    assert not (tmp_path / "two").exists()
