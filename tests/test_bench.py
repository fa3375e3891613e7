"""`vla-rl bench sim` and what it measures: the gymnasium baseline is the same simulation as the
batched env, every side does the same MuJoCo work per step, the physics-only observation mode, the
batched IK, how the headline ratios are read from the results, and the benchmark's outputs."""

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import ClassVar

import mujoco
import numpy as np
import pytest
import torch
from mujoco import rollout

from sim.config import EnvConfig
from sim.mujoco_env import MujocoBatchedEnv
from vla_core.ik import MAX_EE_STEP, ik_targets, orientation_error_map
from vla_core.types import OBS_STATE, TASK
from vla_rl import bench
from vla_rl.bench import BenchSimConfig, GymTaskEnv

ROOT = Path(__file__).resolve().parents[1]
FINAL_LINE = re.compile(
    r"^sim_overhead_vs_rollout=(\d+\.\d\d) speedup_vs_gym_async=(\d+\.\d\d) render_speedup_vs_gym_async=(\d+\.\d\d)"
    r" libero_speedup_vs_lerobot_async=(nan|\d+\.\d\d)$"
)


def _actions(start: np.ndarray, t: int) -> np.ndarray:
    """(N, 4) a fixed schedule: slide forward and down for 20 steps, then close the gripper."""
    frac = min(t, 20) / 20
    target = start + np.array([0.06, -0.05, -0.08]) * frac
    return np.concatenate([target, np.full((len(start), 1), float(t >= 20))], axis=1)


def _gym_copies(env) -> list:
    """One GymTaskEnv per world of ``env``, each set to that world's exact physics state."""
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
    return gyms


def test_gym_baseline_follows_the_batched_env():
    """Same initial state and actions -> the same end-effector path, to 1e-6 m, over 40 steps."""
    n = 2
    with MujocoBatchedEnv(EnvConfig(num_envs=n, cameras=[])) as env:
        env.reset(seed=5)
        gyms = _gym_copies(env)
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


def _record_mujoco_calls(monkeypatch) -> list[tuple[str, dict]]:
    """Wrap every ``mujoco.mj_*`` function so that each call made through the module is logged."""
    calls: list[tuple[str, dict]] = []
    for name in dir(mujoco):
        fn = getattr(mujoco, name)
        if name.startswith("mj_") and callable(fn):

            def logged(*args, _fn=fn, _name=name, **kwargs):
                calls.append((_name, kwargs))
                return _fn(*args, **kwargs)

            monkeypatch.setattr(mujoco, name, logged)
    return calls


class _RolloutSpy(rollout.Rollout):
    """`mujoco.rollout.Rollout` that logs how each rollout call is made."""

    made: ClassVar[list["_RolloutSpy"]] = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[dict] = []
        _RolloutSpy.made.append(self)

    def rollout(self, model, data, initial_state, control=None, **kwargs):
        state = kwargs.get("state")
        self.calls.append({
            "nstep": kwargs.get("nstep"),
            "skip_checks": kwargs.get("skip_checks", False),
            "out": None if state is None else state.ctypes.data,  # the output buffer's address
            "start_time": np.array(initial_state)[:, 0].copy(),
        })  # fmt: skip
        return super().rollout(model, data, initial_state, control, **kwargs)


def test_gym_baseline_makes_the_batched_envs_mujoco_calls_per_step(monkeypatch):
    """One control step of 2 worlds: the gym env makes the same MuJoCo calls per world as the
    batched env (the controller's Jacobian, the position pass after the physics, the task's check),
    no mj_forward on either side, 25 substeps on both; only the physics call differs (mj_step here,
    mujoco.rollout with the state read out and written back there). The pass leaves every
    position-dependent field as the batched env leaves it."""
    n, substeps = 2, 25
    calls = _record_mujoco_calls(monkeypatch)
    with MujocoBatchedEnv(EnvConfig(num_envs=n, cameras=[], substeps=substeps)) as env:
        env.reset(seed=3)
        gyms = _gym_copies(env)
        t0 = env.data[0].time
        actions = _actions(env.ee_positions(), 10)

        calls.clear()
        env.step(torch.from_numpy(actions))
        ours = Counter(name for name, _ in calls)
        calls.clear()
        for i, g in enumerate(gyms):
            g.step(actions[i])
        gym = Counter(name for name, _ in calls)
        gym_steps = [kw for name, kw in calls if name == "mj_step"]

        position_pass = {"mj_kinematics": n, "mj_comPos": n, "mj_camlight": n, "mj_collision": n}
        for side in (ours, gym):
            assert {name: side[name] for name in position_pass} == position_pass
            assert side["mj_forward"] == 0 and side["mj_jacSite"] == n
        assert ours - Counter({"mj_getState": n, "mj_setState": n}) == gym - Counter({"mj_step": n})
        assert gym_steps == [{"nstep": substeps}] * n
        for d, g in zip(env.data, gyms):
            assert d.time == pytest.approx(t0 + 0.05) and g.data.time == pytest.approx(t0 + 0.05)  # 25 x 2 ms
            for name in ("xpos", "xmat", "site_xpos", "site_xmat", "cdof", "cam_xpos", "geom_xpos"):
                np.testing.assert_allclose(getattr(g.data, name), getattr(d, name), rtol=0, atol=1e-9, err_msg=name)
            assert g.data.ncon == d.ncon > 0


def test_raw_rollout_calls_mujoco_rollout_as_the_batched_env_does(monkeypatch):
    """Both sides: one Rollout for the run, one call of 25 substeps per control step into the same
    preallocated output, checks skipped. The raw side's calls continue each from the last: call k
    starts k x 25 x 2 ms after the first."""
    monkeypatch.setattr(rollout, "Rollout", _RolloutSpy)
    monkeypatch.setattr(_RolloutSpy, "made", [])
    cfg = BenchSimConfig(num_envs=[3], steps=3, repeats=2, warmup_steps=1)
    rate, seconds = bench.raw_rollout_rate(cfg, 3)
    assert rate > 0 and seconds > 0
    (raw,) = _RolloutSpy.made
    assert len(raw.calls) == 1 + 3 * 2  # warm-up, then 2 timed runs of 3 control steps

    with MujocoBatchedEnv(EnvConfig(num_envs=3, cameras=[], substeps=cfg.substeps)) as env:
        env.reset(seed=0)
        for _ in range(3):
            env.step(env.hold_actions())
    ours = _RolloutSpy.made[1]
    assert len(_RolloutSpy.made) == 2 and len(ours.calls) == 3

    for side in (raw.calls, ours.calls):
        assert all(c["nstep"] == 25 and c["skip_checks"] is True for c in side)
        assert side[0]["out"] is not None and {c["out"] for c in side} == {side[0]["out"]}
    starts = np.stack([c["start_time"] for c in raw.calls])  # (calls, N)
    expected = starts[0] + 0.05 * np.arange(len(raw.calls))[:, None]
    np.testing.assert_allclose(starts, expected, rtol=0, atol=1e-9)


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
    rot_err = rots.reshape(n, 9) @ orientation_error_map(np.eye(3))
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
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)


def test_bench_sim_tiny_run_writes_json_and_final_line(tmp_path):
    out = tmp_path / "sim.json"
    res = _vla_rl(
        "bench", "sim", "--num_envs=[1,2]", "--steps=3", "--repeats=2", "--warmup_steps=1", "--render_threads=2",
        "--libero_task=", f"--output_json={out}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result) == {"config", "machine", "results", "skipped", "summary"} and result["skipped"] == []
    measured = {(r["method"], r["num_envs"], r["render"]) for r in result["results"]}
    expected = {
        (method, n, render)
        for n in (1, 2)
        for method, render in [
            ("raw_rollout", False),
            ("gym_async", False),
            ("gym_async", True),
            ("cpu", False),
            ("cpu", True),
        ]
    } | {("cpu_serial_render", 2, True)}  # fmt: skip  (one world has nothing to split over threads)
    assert measured == expected
    assert all(r["env_steps_per_s"] > 0 for r in result["results"])
    last = res.stdout.strip().splitlines()[-1]
    assert FINAL_LINE.match(last), f"final line {last!r}"
    assert last.endswith("libero_speedup_vs_lerobot_async=nan")  # LIBERO not measured: --libero_task=''


def test_libero_ratios_are_ours_over_lerobots_at_the_largest_n_both_measured():
    from vla_rl.bench import libero_ratios as ratios

    rows = [_row("libero", 1, 5.0, True), _row("libero_lerobot_async", 1, 4.0, True),
            _row("libero", 4, 12.0, True), _row("libero_lerobot_async", 4, 10.0, True),
            _row("libero", 16, 30.0, True),  # LeRobot's N = 16 missing: not compared there
            _row("libero", 4, 60.0), _row("libero_lerobot_async", 4, 15.0)]  # fmt: skip
    assert ratios(rows) == {
        "libero_speedup_vs_lerobot_async": 1.2, "libero_speedup_num_envs": 4,
        "libero_state_speedup_vs_lerobot_async": 4.0, "libero_state_speedup_num_envs": 4,
    }  # fmt: skip
    assert ratios([])["libero_speedup_vs_lerobot_async"] is None


def _row(method, n, rate, render=False):
    return {"method": method, "num_envs": n, "render": render, "env_steps_per_s": rate}


def test_headline_ratios_are_read_at_the_right_sizes():
    """Hand-made results: overhead at the largest N both raw_rollout and the backend ran, speedup at
    N = 16 (else the largest N gym_async ran), physics and render rows each against their own kind,
    None/"nan" when unmeasured."""
    rows = [
        _row("raw_rollout", 1, 100.0), _row("raw_rollout", 16, 500.0), _row("raw_rollout", 256, 1000.0),
        _row("cpu", 1, 50.0), _row("cpu", 16, 400.0), _row("cpu", 256, 800.0), _row("cpu", 256, 10.0, True),
        _row("gym_async", 1, 40.0), _row("gym_async", 16, 200.0), _row("gym_async", 16, 8.0, True),
        _row("cpu", 16, 12.0, True), _row("cpu_serial_render", 16, 6.0, True),
        _row("warp", 16, 2000.0), _row("warp", 4096, 50000.0),  # no raw_rollout at 4096
    ]  # fmt: skip
    cpu = bench._ratios(rows, "cpu", on_gpu=False)
    assert (cpu["sim_overhead_vs_rollout"], cpu["overhead_num_envs"]) == (1.25, 256)  # 1000 / 800
    assert (cpu["speedup_vs_gym_async"], cpu["speedup_num_envs"]) == (2.0, 16)  # 400 / 200
    assert (cpu["render_speedup_vs_gym_async"], cpu["render_speedup_num_envs"]) == (1.5, 16)  # 12 / 8
    warp = bench._ratios(rows, "warp", on_gpu=True)
    assert (warp["sim_overhead_vs_rollout"], warp["overhead_num_envs"]) == (0.25, 16)  # 500 / 2000
    assert (warp["speedup_vs_gym_async"], warp["speedup_num_envs"]) == (10.0, 16)  # 2000 / 200
    assert warp["render_speedup_vs_gym_async"] is None  # warp never rendered
    libero = {"libero_speedup_vs_lerobot_async": 1.234}
    result = {"config": {"backends": ["cpu", "warp"]}, "summary": {"cpu": cpu, "warp": warp, "libero": libero}}
    assert bench.final_line(result) == (
        "sim_overhead_vs_rollout=1.25 speedup_vs_gym_async=2.00 render_speedup_vs_gym_async=1.50 "
        "libero_speedup_vs_lerobot_async=1.23"
    )

    small = [
        _row("raw_rollout", 1, 100.0), _row("raw_rollout", 4, 400.0), _row("raw_rollout", 8, 600.0),
        _row("cpu", 1, 50.0), _row("cpu", 4, 300.0), _row("cpu", 8, 500.0),
        _row("gym_async", 1, 40.0), _row("gym_async", 4, 120.0),
    ]  # fmt: skip
    cpu = bench._ratios(small, "cpu", on_gpu=False)
    assert (cpu["sim_overhead_vs_rollout"], cpu["overhead_num_envs"]) == (1.2, 8)  # 600 / 500
    assert (cpu["speedup_vs_gym_async"], cpu["speedup_num_envs"]) == (2.5, 4)  # 300 / 120
    no_gym = bench._ratios([r for r in small if r["method"] != "gym_async"], "cpu", on_gpu=False)
    assert no_gym["speedup_vs_gym_async"] is None and no_gym["speedup_num_envs"] is None
    result = {"config": {"backends": ["cpu"]}, "summary": {"cpu": no_gym}}
    assert bench.final_line(result) == (
        "sim_overhead_vs_rollout=1.20 speedup_vs_gym_async=nan render_speedup_vs_gym_async=nan "
        "libero_speedup_vs_lerobot_async=nan"
    )


def test_timed_reports_the_fastest_repeat(monkeypatch):
    """A fake clock: 4 steps per run cost 0.3, 0.1, then 0.2 s each -> the 0.1 s run counts, so
    5 worlds x 4 steps / 0.4 s = 50 env-steps/s."""
    clock, done = [0.0], []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def step():
        clock[0] += (0.3, 0.1, 0.2)[len(done) // 4]
        done.append(1)

    rate, seconds = bench._timed("fake", BenchSimConfig(steps=4, repeats=3), 5, step)
    assert len(done) == 12
    assert seconds == pytest.approx(0.4) and rate == pytest.approx(50.0)


def test_bench_unknown_subcommand_is_one_line_error():
    res = _vla_rl("bench", "physics")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "unknown subcommand 'physics'" in res.stderr and "choose one of: sim" in res.stderr
    res = _vla_rl("bench", "sim", "--backends=[tpu]", "--steps=1")  # rejected by the parser: backends are Literal
    assert res.returncode == 2 and "Cannot convert 'tpu'" in res.stderr and "cpu, warp" in res.stderr


def test_bench_yaml_config_parses():
    from vla_rl.cli import parse_config

    cfg = parse_config("bench sim", [f"--config_path={ROOT / 'configs' / 'bench_sim.yaml'}", "--steps=7"])
    assert cfg.num_envs == [1, 16, 256] and cfg.steps == 7 and cfg.backends == ["cpu"]
