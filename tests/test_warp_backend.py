"""The warp backend (MuJoCo Warp) behind the batched-env contract, checked against the cpu backend.

Warp runs on the CPU here (slowly; its kernels compile once into ~/.cache/warp), so the same
tests cover the code that runs on a GPU.
"""

import importlib.util
import sys

import numpy as np
import pytest
import torch
from extras import extras_required

from sim import make_env
from sim.batched_success import HostWorlds, is_success, touches_gripper
from sim.config import EnvConfig
from sim.tasks import EXPERTS, TASKS, LiftExpert, get_task
from vla_core.types import OBS_STATE, TASK, BatchedEnv, image_key

# Under CI (every extra installed) nothing skips: a broken MuJoCo Warp install fails these tests.
needs_warp = pytest.mark.skipif(
    not extras_required() and importlib.util.find_spec("mujoco_warp") is None,
    reason='MuJoCo Warp is not installed (pip install -e ".[gpu]")',
)

# Same-trajectory tolerances, cpu (float64) vs warp (float32), 40 control steps (1,000 physics
# steps) of the lift expert's actions: free motion, descent, grasp and lift. Until the fingers
# touch the cube both agree to float32 rounding (measured 1e-6). Contact makes them part: the
# two backends find slightly different contact sets between a finger and a cube grasped askew
# (3 or 4 points), so the cube settles in the grasp a little differently. Measured with seed
# 11: arm joints 2.1e-4 rad, end effector 1.4e-4 m, cube 1.8e-4 m, gripper width 5.6e-4 m.
FREE_TOL = 1e-5  # rad or m, before any finger touches the cube
JOINT_TOL = 1e-3  # rad, the 7 arm joints
EE_TOL = 1e-3  # m, end effector and cube centre
WIDTH_TOL = 2e-3  # m, gripper width


@needs_warp
def test_same_trajectory_as_cpu_backend():
    """The same actions (the lift expert's, computed from the cpu backend) drive both backends."""
    n, seed, free_steps = 3, 11, 20
    config = {"task": "lift", "num_envs": n, "cameras": [], "max_episode_steps": 1000}
    with make_env(EnvConfig(backend="cpu", **config)) as cpu, make_env(EnvConfig(backend="warp", **config)) as warp:
        obs_cpu, obs_warp = cpu.reset(seed=seed), warp.reset(seed=seed)
        # the same initial states: drawn by the same task sampler from the same per-world streams
        np.testing.assert_allclose(obs_warp[OBS_STATE].numpy(), obs_cpu[OBS_STATE].numpy(), atol=1e-6)
        expert, diffs, successes = LiftExpert(n), [], 0
        for _ in range(40):
            actions = torch.from_numpy(expert.act(cpu.ee_positions(), cpu.privileged_state()))
            obs_cpu, _, term_cpu, trunc_cpu, info_cpu = cpu.step(actions)
            obs_warp, _, term_warp, _trunc_warp, info_warp = warp.step(actions)
            assert torch.equal(info_warp["success"], info_cpu["success"]) and torch.equal(term_warp, term_cpu)
            successes += int(info_cpu["success"].sum())
            expert.reset((term_cpu | trunc_cpu).numpy())
            gap = (obs_warp[OBS_STATE].double() - obs_cpu[OBS_STATE].double()).abs().amax(dim=0)  # (11,)
            cube = np.abs(warp.privileged_state()["cube"] - cpu.privileged_state()["cube"]).max()
            diffs.append([gap[:7].max().item(), gap[8:].max().item(), cube, gap[7].item()])
        diffs = np.array(diffs)  # (steps, 4): joints, end effector, cube, gripper width
        print("\nmax |difference| (joints rad, ee m, cube m, width m):", diffs.max(axis=0))
        assert diffs[:free_steps].max() < FREE_TOL
        assert diffs[:, 0].max() < JOINT_TOL and diffs[:, 1:3].max() < EE_TOL and diffs[:, 3].max() < WIDTH_TOL
        assert successes >= 1  # the run reached the part of the episode that contact decides


def test_controller_gives_the_same_targets_on_numpy_and_torch():
    """The Warp backend runs ``sim.ik`` on torch tensors, the cpu backend on numpy arrays: the
    same servo targets, number for number."""
    from sim.ik import ArmController
    from vla_core.ik import orientation_error_map

    rng = np.random.default_rng(0)
    n = 6
    site_xmat = np.linalg.qr(rng.normal(size=(n, 3, 3)))[0].reshape(n, 9)  # (N, 9) rotations, row-major
    target = np.linalg.qr(rng.normal(size=(3, 3)))[0]
    q, jac = rng.normal(size=(n, 7)), rng.normal(size=(n, 6, 7))
    site_pos = rng.normal(scale=0.05, size=(n, 3))  # targets at 0: some within the 4 cm step, some beyond
    action = np.concatenate([np.zeros((n, 3)), rng.uniform(size=(n, 1))], axis=1)
    ranges = np.stack([np.full(7, -1.0), np.full(7, 1.0)], axis=1)
    on_numpy = ArmController(rng.normal(size=7), ranges, orientation_error_map(target))
    expected, got = np.zeros((n, 9)), torch.zeros(n, 9, dtype=torch.float64)
    on_numpy.servo_targets(action, q, jac, site_pos, site_xmat, out=expected)
    t = torch.from_numpy
    on_numpy.to_torch("cpu").servo_targets(t(action), t(q), t(jac), t(site_pos), t(site_xmat), out=got)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    arm = expected[:, :7]
    assert (np.abs(arm) == 1.0).any() and (np.abs(arm) < 1.0).any()  # clipped and free entries


@needs_warp
def test_observations_are_tensors_on_the_env_device():
    with make_env(EnvConfig(backend="warp", num_envs=2, cameras=["front"], image_size=32)) as env:
        assert isinstance(env, BatchedEnv)
        obs = env.reset(seed=0)
        assert set(obs) == {OBS_STATE, TASK, image_key("front")}
        state, img = obs[OBS_STATE], obs[image_key("front")]
        assert state.shape == (2, 11) and state.dtype == torch.float32 and state.device == env.device
        np.testing.assert_allclose(state[:, 7].numpy(), 0.08, atol=1e-3)  # gripper open: 2 x 0.04 m
        assert img.shape == (2, 3, 32, 32) and img.device == env.device
        assert 0.0 <= img.min() and img.max() <= 1.0 and img.std() > 0.05  # a rendered scene, not a blank
        for world in range(2):  # each world's own frame (rendered on threads; here alone, on this thread)
            frame = torch.tensor(env.render(world, "front", size=32), dtype=torch.float32).permute(2, 0, 1) / 255.0
            assert torch.equal(img[world].cpu(), frame)
        obs, reward, terminated, truncated, info = env.step(env.hold_actions())
        assert reward.shape == (2,) and reward.dtype == torch.float32 and reward.device == env.device
        assert terminated.dtype == truncated.dtype == info["success"].dtype == torch.bool
        assert obs[TASK] == ["pick up the red cube"] * 2


@needs_warp
def test_physics_only_observations_and_autoreset():
    with make_env(EnvConfig(backend="warp", num_envs=2, cameras=[], max_episode_steps=2)) as env:
        obs = env.reset(seed=5)
        assert set(obs) == {OBS_STATE, TASK}
        cubes = env.privileged_state()["cube"]
        hold = env.hold_actions()
        hold[1] = float("nan")  # a non-finite action holds the pose instead of breaking the batch
        hold[0, 2] = -5.0  # below the table: clipped to the workspace (z >= 0) and counted
        _, _, terminated, truncated, info = env.step(hold)
        assert info["invalid_actions"].tolist() == [False, True] and not truncated.any()
        assert info["clipped_actions"].tolist() == [True, False]
        obs, _, terminated, truncated, info = env.step(hold)
        assert truncated.all() and not terminated.any()
        assert env.episode_step.tolist() == [0, 0]
        assert not np.allclose(env.privileged_state()["cube"], cubes)  # new episodes were drawn
        assert not torch.equal(obs[OBS_STATE], info["final_obs"][OBS_STATE])


def success_states(task_name: str, num_envs: int = 4, steps: int = 150, every: int = 5):
    """Host states along scripted-expert episodes on the cpu backend, and the task's rule evaluated on
    each through the host reader (`HostWorlds`): (name -> (S, ...) arrays as `WarpBatchedEnv._upload`
    takes them, (S,) bool). Compared with the device reader, this checks the two readers agree; the
    rules themselves are checked against hand-built states in test_tasks.py."""
    with make_env(EnvConfig(task=task_name, num_envs=num_envs, cameras=[], max_episode_steps=10**6)) as env:
        oracle = get_task(task_name)
        # keep going past success, into the states after it
        env.task.success = lambda model, worlds: np.zeros(len(worlds.qpos), dtype=bool)
        expert = EXPERTS[task_name](num_envs)
        env.reset(seed=1)
        states, verdicts = {name: [] for name in ("qpos", "qvel", "ctrl", "mocap_pos", "mocap_quat")}, []
        for t in range(steps):
            env.step(torch.from_numpy(expert.act(env.ee_positions(), env.privileged_state())))
            if t % every == every - 1:
                for d in env.data:
                    for name, values in states.items():
                        values.append(getattr(d, name).copy())
                    verdicts.append(is_success(oracle, env.model, d))
    return {name: np.stack(values) for name, values in states.items()}, np.array(verdicts)


@needs_warp
@pytest.mark.parametrize("task_name", sorted(TASKS))
def test_device_and_host_readers_give_the_same_verdicts_along_expert_episodes(task_name):
    states, verdicts = success_states(task_name)
    assert verdicts.any() and not verdicts.all()  # the episodes pass through both kinds of state
    config = EnvConfig(backend="warp", task=task_name, num_envs=len(verdicts), cameras=[])
    with make_env(config) as env:
        env._upload(np.arange(len(verdicts)), states)
        np.testing.assert_array_equal(env._success().numpy(), verdicts)


def _finger_touches_cube(model, data) -> bool:
    """Whether MuJoCo's contact list of ``data`` pairs a geom of the cube with one of a finger."""
    cube, fingers = model.body("cube").id, {model.body("left_finger").id, model.body("right_finger").id}
    for geom1, geom2 in data.contact.geom:
        bodies = {model.geom_bodyid[geom1], model.geom_bodyid[geom2]}
        if cube in bodies and bodies & fingers:
            return True
    return False


@needs_warp
def test_contact_check_reads_both_backends_contact_lists():
    """`touches_gripper` on Warp's contact list and on the host's agrees with MuJoCo's contacts
    read one by one (the pick_place and stack rules need it; along expert episodes it is true
    in about a third of the states, though never the deciding clause)."""
    import mujoco

    states, _ = success_states("pick_place")
    with make_env(EnvConfig(backend="warp", task="pick_place", num_envs=len(states["qpos"]), cameras=[])) as env:
        env._upload(np.arange(len(states["qpos"])), states)
        on_device = touches_gripper(env.model, env._world, "cube").numpy()
        datas, expected = [], []
        for k in range(len(on_device)):
            data = mujoco.MjData(env.model)
            for name, values in states.items():
                getattr(data, name)[:] = values[k]
            mujoco.mj_forward(env.model, data)
            datas.append(data)
            expected.append(_finger_touches_cube(env.model, data))
        on_host = touches_gripper(env.model, HostWorlds(env.model, datas), "cube")
    assert 0 < sum(expected) < len(expected)
    np.testing.assert_array_equal(on_device, expected)
    np.testing.assert_array_equal(on_host, expected)


@needs_warp
@pytest.mark.parametrize("task_name", sorted(TASKS))
def test_both_backends_judge_hand_built_states_alike(task_name):
    """A state built to be solved and one built to miss (`test_tasks.POSE_BUILDERS`: each 1 cm or
    more from the task's threshold), judged by the rule each backend runs on its own copy of
    them: the cpu backend on its MjData, the warp backend on its device arrays."""
    import mujoco
    from test_tasks import POSE_BUILDERS

    config = {"task": task_name, "num_envs": 2, "cameras": []}
    with make_env(EnvConfig(backend="cpu", **config)) as cpu, make_env(EnvConfig(backend="warp", **config)) as warp:
        cpu.reset(seed=0)
        for data, solved in zip(cpu.data, (True, False)):
            POSE_BUILDERS[task_name](cpu.task, cpu.model, data, solved)
            mujoco.mj_forward(cpu.model, data)
        names = ("qpos", "qvel", "ctrl", "mocap_pos", "mocap_quat")
        warp._upload(np.arange(2), {name: np.stack([getattr(d, name) for d in cpu.data]) for name in names})
        on_cpu = cpu.task.success(cpu.model, HostWorlds(cpu.model, cpu.data))
        on_warp = warp._success()
    assert on_cpu.tolist() == [True, False]
    assert on_warp.tolist() == [True, False]


def test_unknown_backend_and_device_errors():
    with pytest.raises(ValueError, match="valid backends: cpu, warp"):
        make_env(EnvConfig(backend="jax"))
    with pytest.raises(ValueError, match="backend='warp'"):
        make_env(EnvConfig(backend="cpu", device="cuda"))


def test_missing_warp_names_the_gpu_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mujoco_warp", None)  # makes `import mujoco_warp` fail
    monkeypatch.delitem(sys.modules, "sim.warp_env", raising=False)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[gpu\]"'):
        make_env(EnvConfig(backend="warp"))
