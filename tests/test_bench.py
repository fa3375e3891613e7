"""`vla-rl bench sim` and what it measures: the gymnasium baseline is the same simulation as the
batched env, the physics-only observation mode, the batched IK, and the benchmark's outputs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mujoco
import numpy as np
import torch

from sim.config import EnvConfig
from sim.ik import MAX_EE_STEP, ik_targets, orientation_error
from sim.mujoco_env import MujocoBatchedEnv
from vla_rl.bench import GymTaskEnv
from vla_rl.types import OBS_STATE, TASK

ROOT = Path(__file__).resolve().parents[1]
FINAL_LINE = re.compile(r"^sim_overhead_vs_rollout=(\d+\.\d\d) speedup_vs_gym_async=(\d+\.\d\d)$")


def _actions(start: np.ndarray, t: int) -> np.ndarray:
    """(N, 4) a fixed schedule: slide forward and down for 20 steps, then close the gripper."""
    frac = min(t, 20) / 20
    target = start + np.array([0.06, -0.05, -0.08]) * frac
    return np.concatenate([target, np.full((len(start), 1), float(t >= 20))], axis=1)


def test_gym_baseline_follows_the_batched_env():
    """Same initial state and actions -> the same end-effector path, to 1e-6 m, over 40 steps."""
    n = 2
    with MujocoBatchedEnv(EnvConfig(num_envs=n, cameras=[])) as env:
        env.reset(seed=5)
        spec = mujoco.mjtState.mjSTATE_INTEGRATION  # everything that determines the next step
        gyms = []
        for d in env.data:
            g = GymTaskEnv("lift", substeps=env.config.substeps)
            g.reset(seed=0)
            state = np.empty(mujoco.mj_stateSize(env.model, spec))
            mujoco.mj_getState(env.model, d, state, spec)
            mujoco.mj_setState(g.model, g.data, state, spec)
            mujoco.mj_forward(g.model, g.data)
            gyms.append(g)
        start = env.ee_positions().copy()
        worst = 0.0
        for t in range(40):
            actions = _actions(start, t)
            env.step(torch.from_numpy(actions))
            gym_obs = [g.step(actions[i])[0] for i, g in enumerate(gyms)]
            gym_ee = np.stack([g.ee_position() for g in gyms])
            worst = max(worst, float(np.abs(gym_ee - env.ee_positions()).max()))
            np.testing.assert_allclose(np.stack(gym_obs)[:, 8:], gym_ee, atol=1e-6)  # obs = state vector
        moved = np.linalg.norm(env.ee_positions() - start, axis=1)
    assert worst < 1e-6, f"gym env drifted {worst:.2e} m from the batched env"
    assert (moved > 0.08).all()  # the arms really went somewhere
    fingers = np.array([g.data.qpos[7] + g.data.qpos[8] for g in gyms])
    assert (fingers < 0.02).all()  # and the grippers closed


def test_physics_only_observation_has_no_images_and_the_same_state():
    n = 3
    with MujocoBatchedEnv(EnvConfig(num_envs=n, cameras=[])) as bare, MujocoBatchedEnv(EnvConfig(num_envs=n)) as seen:
        obs_bare, obs_seen = bare.reset(seed=2), seen.reset(seed=2)
        assert set(obs_bare) == {OBS_STATE, TASK} and "observation.images.front" in obs_seen
        start = bare.ee_positions().copy()
        for t in range(10):
            actions = torch.from_numpy(_actions(start, t))
            obs_bare, *_ = bare.step(actions)
            obs_seen, *_ = seen.step(actions)
            assert set(obs_bare) == {OBS_STATE, TASK}
            torch.testing.assert_close(obs_bare[OBS_STATE], obs_seen[OBS_STATE], rtol=0, atol=0)
        assert not bare._renderers._by_size  # no renderer was ever made: nothing was rendered
        np.testing.assert_allclose(obs_bare[OBS_STATE][:, 8:].numpy(), bare.ee_positions(), atol=1e-6)
        assert (np.linalg.norm(bare.ee_positions() - start, axis=1) > 0.03).all()  # the arms moved
        assert bare.render(0, size=32).shape == (32, 32, 3)  # video frames still work


def test_pipelined_blocks_and_kinematic_pass_change_nothing(monkeypatch):
    """Stepping 8 worlds in 4 pipelined blocks gives the same results as one block, and each
    world's MjData then holds what a full mj_forward of its state would give."""
    results = {}
    for min_block in (8, 2):  # one block of 8, then four blocks of 2
        monkeypatch.setattr(MujocoBatchedEnv, "MIN_BLOCK_WORLDS", min_block)
        with MujocoBatchedEnv(EnvConfig(task="stack", num_envs=8, cameras=[])) as env:
            assert len(env._blocks) == 8 // min_block if min_block == 2 else len(env._blocks) == 1
            env.reset(seed=1)
            start = env.ee_positions().copy()
            for t in range(12):
                obs, *_ = env.step(torch.from_numpy(_actions(start, t)))
            results[min_block] = obs[OBS_STATE].clone()
            fields = ("xpos", "xmat", "site_xpos", "site_xmat", "cdof", "cam_xpos", "geom_xpos")
            for d in env.data:
                full = mujoco.MjData(env.model)
                spec = mujoco.mjtState.mjSTATE_INTEGRATION
                state = np.empty(mujoco.mj_stateSize(env.model, spec))
                mujoco.mj_getState(env.model, d, state, spec)
                mujoco.mj_setState(env.model, full, state, spec)
                mujoco.mj_forward(env.model, full)
                for name in fields:
                    np.testing.assert_array_equal(getattr(d, name), getattr(full, name), err_msg=name)
                assert d.ncon == full.ncon and d.ncon > 0  # the cubes rest on the table
                np.testing.assert_array_equal(d.contact.geom[: d.ncon], full.contact.geom[: full.ncon])
    torch.testing.assert_close(results[2], results[8], rtol=0, atol=0)


def _ik_one_world(q, jac, pos_err, rot_err, home, ranges):
    """The per-world controller the batched one replaced, written out as it was."""
    pos_err = pos_err.copy()
    norm = np.linalg.norm(pos_err)
    if norm > MAX_EE_STEP:
        pos_err *= MAX_EE_STEP / norm
    err = np.concatenate([pos_err, rot_err])
    jjt = jac @ jac.T + 1e-4 * np.eye(6)
    dq = jac.T @ np.linalg.solve(jjt, err)
    null = np.eye(7) - jac.T @ np.linalg.solve(jjt, jac)
    dq += null @ (0.1 * (home - q))
    return np.clip(q + dq, ranges[:, 0], ranges[:, 1])


def test_batched_ik_equals_the_per_world_formula():
    rng = np.random.default_rng(0)
    n = 32
    q, home = rng.uniform(-2, 2, (n, 7)), rng.uniform(-1, 1, 7)
    jac = rng.normal(0, 0.5, (n, 6, 7))
    pos_err = rng.normal(0, 0.05, (n, 3))  # about half of them beyond MAX_EE_STEP
    rots = np.linalg.qr(rng.normal(size=(n, 3, 3)))[0]
    rot_err = orientation_error(rots, np.eye(3))
    ranges = np.tile([[-2.5, 2.5]], (7, 1))
    out = ik_targets(q, jac, pos_err, rot_err, home, ranges)
    ref = np.stack([_ik_one_world(q[i], jac[i], pos_err[i], rot_err[i], home, ranges) for i in range(n)])
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)
    assert (np.abs(out - q) > 1e-3).any() and (out == 2.5).any()  # it moved, and the clip bit
    ref_rot = 0.5 * sum(np.cross(rots[0][:, k], np.eye(3)[:, k]) for k in range(3))
    np.testing.assert_allclose(rot_err[0], ref_rot, atol=1e-15)


def _vla_rl(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "vla_rl.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def test_bench_sim_tiny_run_writes_json_and_final_line(tmp_path):
    out = tmp_path / "sim.json"
    res = _vla_rl(
        "bench", "sim", "--num_envs=[1,2]", "--steps=3", "--repeats=2", "--warmup_steps=1", f"--output_json={out}"
    )
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result) == {"config", "machine", "results", "summary"}
    measured = {(r["method"], r["num_envs"], r["render"]) for r in result["results"]}
    for n in (1, 2):
        for method, render in [
            ("raw_rollout", False), ("gym_async", False), ("gym_async", True), ("cpu", False), ("cpu", True)
        ]:  # fmt: skip
            assert (method, n, render) in measured
    for row in result["results"]:
        assert row["env_steps_per_s"] > 0 and row["seconds"] > 0 and row["steps"] == 3 and row["repeats"] == 2
        assert abs(row["env_steps_per_s"] - row["num_envs"] * 3 / row["seconds"]) < 0.02 * row["env_steps_per_s"] + 0.1

    rate = {(r["method"], r["num_envs"], r["render"]): r["env_steps_per_s"] for r in result["results"]}
    summary = result["summary"]["cpu"]
    assert summary["overhead_num_envs"] == 2 and summary["speedup_num_envs"] == 2  # N=16 was not measured
    assert summary["sim_overhead_vs_rollout"] == round(rate["raw_rollout", 2, False] / rate["cpu", 2, False], 3)
    assert summary["speedup_vs_gym_async"] == round(rate["cpu", 2, False] / rate["gym_async", 2, False], 3)

    last = res.stdout.strip().splitlines()[-1]
    match = FINAL_LINE.match(last)
    assert match, f"final line {last!r}"
    assert float(match[1]) == round(summary["sim_overhead_vs_rollout"], 2)
    assert float(match[2]) == round(summary["speedup_vs_gym_async"], 2)


def test_bench_unknown_subcommand_is_one_line_error():
    res = _vla_rl("bench", "physics")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "unknown subcommand 'physics'" in res.stderr and "choose one of: sim" in res.stderr
    res = _vla_rl("bench", "sim", "--backends=[tpu]", "--steps=1")
    assert res.returncode == 2 and "unknown backend 'tpu'" in res.stderr and "cpu, warp" in res.stderr


def test_bench_yaml_config_parses():
    from vla_rl.cli import parse_config

    cfg = parse_config("bench sim", [f"--config_path={ROOT / 'configs' / 'bench_sim.yaml'}", "--steps=7"])
    assert cfg.num_envs == [1, 16, 256] and cfg.steps == 7 and cfg.backends == ["cpu"]
