"""Task variations outside the demonstrations (`--env.variation`, `sim.variations`) on the MuJoCo suite: each one
changes what it says by the amounts its docstring gives, is drawn from the world's seed (equal seeds, equal
variations), is recorded with the episode, and leaves the in-distribution default untouched."""

import mujoco
import numpy as np
import pytest

from sim.config import EnvConfig
from sim.factory import make_env
from sim.variations import VARIATIONS

SIZE = 32


def env_of(variation: str, task: str = "lift", num_envs: int = 2):
    return make_env(EnvConfig(task=task, num_envs=num_envs, image_size=SIZE, variation=variation, num_threads=1,
                              render_threads=1))  # fmt: skip


def cube_qpos(env, world: int) -> np.ndarray:
    adr = env.model.joint("cube").qposadr[0]
    return env.data[world].qpos[adr : adr + 3].copy()


def test_the_default_is_in_distribution_and_a_variation_is_drawn_after_the_initial_state():
    """Without a variation every world runs the one model and records nothing; a variation of the model only
    (colour) draws after the initial state, so the first initial states are those of the plain env."""
    with env_of("") as plain, env_of("colour") as varied:
        obs = plain.reset(seed=3)
        assert plain.variation_record(0) == {} and plain._models[0] is plain.model
        np.testing.assert_array_equal(varied.reset(seed=3)["observation.state"], obs["observation.state"])
        assert varied._models[0] is not varied.model


@pytest.mark.parametrize("variation", VARIATIONS)
def test_a_variation_is_drawn_from_the_worlds_seed_and_recorded(variation):
    with env_of(variation) as a, env_of(variation) as b:
        a.reset(seed=11)
        b.reset(seed=11)
        assert a.variation_record(0) == b.variation_record(0) and a.variation_record(0)["variation"] == variation
        assert a.variation_record(0) != a.variation_record(1)  # two worlds, two streams
        np.testing.assert_array_equal(a.render(0, size=SIZE), b.render(0, size=SIZE))


def test_position_puts_the_object_beyond_the_recorded_range_with_the_layout():
    """lift records the cube at |y| <= 0.12: shifted, it is 2-10 cm beyond, on either side, at the same x."""
    with env_of("position", num_envs=8) as env:
        env.reset(seed=0)
        ys = []
        for i in range(8):
            record, y = env.variation_record(i), cube_qpos(env, i)[1]
            assert 0.14 - 1e-9 <= abs(y) <= 0.22 + 1e-9 and y == pytest.approx(record["object_y_m"], abs=1e-6)
            assert 0.45 <= cube_qpos(env, i)[0] <= 0.60
            ys.append(y)
        assert min(ys) < 0 < max(ys)  # both sides drawn among 8 worlds (seed 0)


def test_the_far_shifts_go_further_than_their_shifts():
    """position_far: the cube 10-16 cm beyond |y| <= 0.12, so at 0.22-0.28; camera_far: moved up to 8 cm per axis,
    turned 5-8 degrees (camera: 5 cm, 2-5 degrees)."""
    with env_of("position_far", num_envs=8) as env:
        env.reset(seed=0)
        ys = [cube_qpos(env, i)[1] for i in range(8)]
        assert all(0.22 - 1e-9 <= abs(y) <= 0.28 + 1e-9 for y in ys) and min(ys) < 0 < max(ys)
        assert env.variation_record(0)["variation"] == "position_far"
    with env_of("camera_far", num_envs=8) as env:
        env.reset(seed=0)
        for i in range(8):
            record = env.variation_record(i)
            assert 5.0 - 1e-6 <= abs(record["yaw_deg"]) <= 8.0 + 1e-6 and max(map(abs, record["shift_m"])) <= 0.08
            np.testing.assert_allclose(env._models[i].cam_pos, env.model.cam_pos + record["shift_m"], atol=1e-6)
        assert max(max(map(abs, env.variation_record(i)["shift_m"])) for i in range(8)) > 0.05  # beyond camera's


def test_size_scales_the_object_and_it_still_rests_on_the_table():
    """The cube's half side 0.02 m times the drawn scale; after 10 steps of holding still its centre is at that
    half side (it rests, neither sunk nor dropped)."""
    with env_of("size") as env:
        env.reset(seed=5)
        geom = np.flatnonzero(env.model.geom_bodyid == env.model.body("cube").id)[0]
        for i in range(2):
            scale = env.variation_record(i)["scale"]
            assert 0.70 <= scale <= 0.85 or 1.20 <= scale <= 1.35
            np.testing.assert_allclose(env._models[i].geom_size[geom], env.model.geom_size[geom] * scale, rtol=1e-6)
        for _ in range(10):
            env.step(env.hold_actions())
        for i in range(2):
            half = env._models[i].geom_size[geom][2]
            assert cube_qpos(env, i)[2] == pytest.approx(half, abs=0.002)


def test_colour_and_lighting_change_the_pixels_the_policy_sees_as_drawn():
    """Colour: the cube's rgb is the recorded one, not the demonstrations' red. Lighting: darker scenes (factor
    below 1) render darker than the same world in distribution, brighter ones brighter."""
    with env_of("colour", num_envs=1) as env:
        env.reset(seed=2)
        geom = np.flatnonzero(env.model.geom_bodyid == env.model.body("cube").id)[0]
        rgb = env._models[0].geom_rgba[geom, :3]
        np.testing.assert_allclose(rgb, env.variation_record(0)["rgb"], atol=1e-4)
        assert not np.allclose(rgb, env.model.geom_rgba[geom, :3])
    for seed in range(4):
        with env_of("lighting", num_envs=1) as lit, env_of("", num_envs=1) as plain:
            lit.reset(seed=seed)
            plain.reset(seed=seed)
            factor = lit.variation_record(0)["brightness"]
            ratio = lit.render(0, size=SIZE).mean() / plain.render(0, size=SIZE).mean()
            assert (ratio < 1) == (factor < 1), (factor, ratio)


def test_distractors_stand_on_the_table_apart_from_the_object_and_each_other():
    with env_of("distractors", num_envs=4) as env:
        env.reset(seed=1)
        for i in range(4):
            cube = cube_qpos(env, i)[:2]
            boxes = np.array(env.variation_record(i)["xy_m"])
            assert boxes.shape == (3, 2)
            assert np.linalg.norm(boxes - cube, axis=1).min() >= 0.08
            gaps = [np.linalg.norm(boxes[a] - boxes[b]) for a in range(3) for b in range(a + 1, 3)]
            assert min(gaps) >= 0.08
            for k, xy in enumerate(boxes):
                adr = env.model.joint(f"distractor{k}").qposadr[0]
                np.testing.assert_allclose(env.data[i].qpos[adr : adr + 2], xy, atol=1e-6)


def test_camera_moves_the_view_within_its_bounds():
    with env_of("camera", num_envs=1) as env, env_of("", num_envs=1) as plain:
        env.reset(seed=4)
        plain.reset(seed=4)
        record = env.variation_record(0)
        assert max(abs(v) for v in record["shift_m"]) <= 0.05 and 2.0 <= abs(record["yaw_deg"]) <= 5.0
        cam = env.model.camera("front").id
        np.testing.assert_allclose(env._models[0].cam_pos[cam] - env.model.cam_pos[cam], record["shift_m"], atol=1e-6)
        assert np.abs(env.render(0, size=SIZE).astype(int) - plain.render(0, size=SIZE).astype(int)).mean() > 1


def test_a_saved_world_keeps_its_variation_and_a_task_without_an_object_is_refused():
    with env_of("size") as env:
        env.reset(seed=8)
        state = env.get_state([0])
        env.reset(seed=9)
        env.set_state(state, [1])
        assert env.variation_record(1) == state[0]["variation"]["record"]
        geom = np.flatnonzero(env.model.geom_bodyid == env.model.body("cube").id)[0]
        np.testing.assert_array_equal(
            env._models[1].geom_size[geom], state[0]["variation"]["fields"]["geom_size"][geom]
        )
    with env_of("") as plain, pytest.raises(ValueError, match="saved with variation 'size' cannot be loaded"):
        plain.set_state(state, [0])  # it would scale the cube of the one model every world shares
    with pytest.raises(ValueError, match="task 'stack' judges success with its cube's fixed size"):
        env_of("size", task="stack")
    with pytest.raises(ValueError, match="task 'pick_place' has a fixture"):
        env_of("distractors", task="pick_place")
    with pytest.raises(ValueError, match="task 'reach' has none that moves freely"):
        env_of("size", task="reach")
    with pytest.raises(ValueError, match="unknown variation 'fog'"):
        env_of("fog")
    with pytest.raises(ValueError, match="cpu backend"):
        make_env(EnvConfig(task="libero_spatial", variation="camera"))
    assert mujoco.mj_name2id(env.model, mujoco.mjtObj.mjOBJ_JOINT, "distractor0") < 0  # only that variation adds them
