"""SafetyFilter, input and chunk checks, the log limiter and the state bounds, with hand-computed numbers (no ROS)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest

from robot_bridge.codec import InputRejected, decode_image, joint_state_vector
from robot_bridge.config import SIM_ACTION_NAMES, SIM_STATE_BOUNDS, SIM_STATE_NAMES, CameraTopic, ServeConfig
from robot_bridge.inference import chunk_problem
from robot_bridge.inputs import check_bounds, fit_image
from robot_bridge.log_limit import LogLimiter
from robot_bridge.safety import SafetyFilter

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_bridge_core_needs_no_ros():
    import subprocess  # a fresh process: other tests in this session import rclpy

    code = (
        "import sys, robot_bridge.safety, robot_bridge.config, robot_bridge.codec, robot_bridge.topics, "
        "robot_bridge.inputs, robot_bridge.hold, robot_bridge.chunk_scheduler, robot_bridge.diagnostics, "
        "robot_bridge.inference, robot_bridge.log_limit, vla_rl.sim_robot, robot_bridge.record, "
        "robot_bridge.convert, robot_bridge.description, robot_bridge.trajectory, robot_bridge.trajectory_follower; "
        "print('rclpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.strip() == "False", out.stderr


def test_position_clamp():
    f = SafetyFilter(dt=0.1, action_dim=2, position_min=[-1, 0], position_max=[1, 2])
    f.start_from(np.array([0.0, 1.0]))
    assert f.step(np.array([5.0, -3.0])).tolist() == [1.0, 0.0]


def test_velocity_limit():
    # 0.5 units/s at dt = 0.1 s: at most 0.05 per step.
    f = SafetyFilter(dt=0.1, action_dim=2, max_velocity=[0.5, 10.0])
    f.start_from(np.zeros(2))
    assert f.step(np.array([1.0, 0.3])) == pytest.approx([0.05, 0.3])
    assert f.step(np.array([1.0, 0.3])) == pytest.approx([0.10, 0.3])
    assert f.step(np.array([-1.0, 0.3])) == pytest.approx([0.05, 0.3])


def test_acceleration_limit():
    # 2 units/s^2 at dt = 0.1 s: the velocity changes by at most 0.2 units/s per step.
    # v = 0.2 -> 0.02; v = 0.4 -> 0.06; v = 0.6 -> 0.12; then reaching 0.15 needs v = 0.3, a change of
    # -0.3, so v = 0.4 -> 0.16: braking is rate-limited too, and the command overshoots the target.
    f = SafetyFilter(dt=0.1, action_dim=1, max_acceleration=[2.0])
    f.start_from(np.zeros(1))
    out = [f.step(np.array([0.15]))[0] for _ in range(4)]
    assert out == pytest.approx([0.02, 0.06, 0.12, 0.16])


def test_hold_estop_latch_and_stop_ignores_acceleration():
    f = SafetyFilter(dt=0.1, action_dim=1, max_acceleration=[2.0])
    f.start_from(np.array([1.0]))
    f.step(np.array([2.0]))  # v = 0.2 -> 1.02
    assert f.hold().tolist() == [1.02]  # stop at once
    f.engage_estop()
    assert f.step(np.array([5.0])).tolist() == [1.02]
    assert f.step(np.array([5.0])).tolist() == [1.02]  # latched
    f.release_estop()
    assert f.step(np.array([5.0])) == pytest.approx([1.04])  # from rest: v = 0.2 again


def test_rejects_bad_targets_and_limits():
    f = SafetyFilter(dt=0.1, action_dim=2)
    with pytest.raises(RuntimeError, match="start_from"):
        f.step(np.zeros(2))
    f.start_from(np.zeros(2))
    with pytest.raises(ValueError, match="finite"):
        f.step(np.array([np.nan, 0.0]))
    with pytest.raises(ValueError, match="one per action dim"):
        SafetyFilter(dt=0.1, action_dim=2, max_velocity=[1.0])
    with pytest.raises(ValueError, match="position_min <= position_max"):
        SafetyFilter(dt=0.1, action_dim=1, position_min=[1.0], position_max=[0.0])


def _joints(names, positions):
    return SimpleNamespace(name=names, position=positions)


def test_joint_state_by_name():
    v = joint_state_vector(_joints(["b", "a", "c"], [2.0, 1.0, 3.0]), ["a", "c"])
    assert v.tolist() == [1.0, 3.0]
    with pytest.raises(InputRejected, match=r"lacks \['d'\]"):
        joint_state_vector(_joints(["a"], [1.0]), ["a", "d"])
    with pytest.raises(InputRejected, match="2 names but 1 positions"):
        joint_state_vector(_joints(["a", "b"], [1.0]), ["a"])
    with pytest.raises(InputRejected, match=r"non-finite values for \['a'\]") as err:
        joint_state_vector(_joints(["a"], [float("inf")]), ["a"])
    assert err.value.kind == "not_finite"


def test_state_bounds_with_margin():
    names = ["a", "b", "c"]
    low, high = np.array([-1.0, 0.0, -np.inf]), np.array([1.0, 0.08, np.inf])
    check_bounds(np.array([1.05, -0.05, 1e9]), names, low, high, margin=0.05)  # on the margin; c is unbounded
    with pytest.raises(InputRejected) as err:
        check_bounds(np.array([1.06, 0.2, 0.0]), names, low, high, margin=0.05)
    assert err.value.kind == "out_of_bounds"
    assert "a=1.06 outside [-1, 1], b=0.2 outside [0, 0.08], margin 0.05" in str(err.value)
    assert "widen safety.state_bounds" in str(err.value)
    with pytest.raises(InputRejected) as err:
        check_bounds(np.full(5, 5.0), [f"z{i}" for i in range(5)], np.zeros(5), np.ones(5), margin=0.0)
    assert "z0=5 outside [0, 1], z1=5 outside [0, 1], z2=5 outside [0, 1] (and 2 more)" in str(err.value)


def test_default_state_bounds_are_the_sim_pandas():
    """Read independently from the MJCF model and the env: joint ranges, two finger slides, the workspace."""
    import mujoco

    from sim.arm import STATE_NAMES
    from sim.mujoco_env import MujocoBatchedEnv

    assert SIM_STATE_NAMES == STATE_NAMES and list(SIM_STATE_BOUNDS) == STATE_NAMES
    model = mujoco.MjModel.from_xml_path(str(ROOT / "sim/assets/panda_lift.xml"))
    for i in range(7):
        assert SIM_STATE_BOUNDS[f"joint{i + 1}"] == pytest.approx(model.jnt_range[i].tolist())
    fingers = model.jnt_range[7:9]
    assert SIM_STATE_BOUNDS["gripper_width"] == pytest.approx([fingers[:, 0].sum(), fingers[:, 1].sum()])
    low, high = MujocoBatchedEnv.ACTION_LOW, MujocoBatchedEnv.ACTION_HIGH
    for i, name in enumerate(["ee_x", "ee_y", "ee_z"]):
        assert SIM_STATE_BOUNDS[name] == pytest.approx([low[i], high[i]])
    # configs/serve.yaml states the same bounds.
    import yaml

    served = yaml.safe_load((ROOT / "configs/serve.yaml").read_text())["safety"]
    assert served["state_bounds"] == SIM_STATE_BOUNDS and served["state_margin"] == ServeConfig().safety.state_margin


def test_state_bounds_config_is_validated():
    cfg = ServeConfig()
    cfg.safety.state_bounds = {"joint1": [1.0, -1.0]}
    with pytest.raises(ValueError, match=r"safety.state_bounds.joint1 must be \[low, high\]"):
        cfg.validate()
    cfg.safety.state_bounds, cfg.safety.state_margin = {}, -0.1
    with pytest.raises(ValueError, match="state_margin must be >= 0"):
        cfg.validate()


def test_chunk_problem_names_nan_and_shape():
    names = list(SIM_ACTION_NAMES)
    good = np.zeros((1, 8, 4), np.float32)
    assert chunk_problem(good, 8, names) is None
    assert chunk_problem(good[:, :3], 8, names) is None  # a shorter chunk is fine
    bad = good.copy()
    bad[0, 5, 3] = np.inf
    bad[0, 6, 0] = np.nan
    assert "2 non-finite (NaN/inf) values of 32, the first at step 5, grip" in chunk_problem(bad, 8, names)
    for shape in [(1, 8, 3), (2, 8, 4), (1, 9, 4), (1, 0, 4), (8, 4)]:
        assert f"shape {shape}, expected (1, 1..8, 4)" in chunk_problem(np.zeros(shape), 8, names)
    assert "shape None" in chunk_problem(None, 8, names)


def test_log_limiter_one_line_per_cause_per_period():
    now = [0.0]
    lines = []
    log = LogLimiter(lambda level, line: lines.append((level, line)), period_s=1.0, clock=lambda: now[0])
    for i in range(10):
        log("a", "warning", f"a {i}")
        log("b", "error", f"b {i}")
        now[0] += 0.05  # 10 calls in 0.45 s
    assert lines == [("warning", "a 0"), ("error", "b 0")]
    now[0] = 1.0  # one period after the first line
    assert log("a", "warning", "a again")
    assert not log("a", "warning", "a held")
    assert lines[-1] == ("warning", "a again (9 more like it in the last 1.0 s)")
    now[0] = 5.0
    log("a", "warning", "a later")
    assert lines[-1] == ("warning", "a later (1 more like it in the last 4.0 s)")


def _image(encoding, pixels, pad=0):
    h, w = pixels.shape[:2]
    c = 1 if pixels.ndim == 2 else pixels.shape[2]
    rows = np.zeros((h, w * c + pad), np.uint8)
    rows[:, : w * c] = pixels.reshape(h, w * c)
    return SimpleNamespace(encoding=encoding, height=h, width=w, step=w * c + pad, data=rows.tobytes())


def test_image_encodings_become_rgb():
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    assert (decode_image(_image("rgb8", rgb, pad=2)) == rgb).all()  # row padding skipped
    assert (decode_image(_image("bgr8", rgb[:, :, ::-1].copy())) == rgb).all()
    mono = np.array([[7, 9]], np.uint8)
    assert decode_image(_image("mono8", mono)).tolist() == [[[7, 7, 7], [9, 9, 9]]]
    with pytest.raises(InputRejected, match="expected height\\*step = 18"):
        bad = _image("rgb8", rgb)
        bad.data = bad.data[:-1]
        decode_image(bad)


def test_compressed_png_and_fit():
    rgb = np.zeros((4, 6, 3), np.uint8)
    rgb[..., 0] = 200  # red
    png = cv2.imencode(".png", rgb[:, :, ::-1])[1].tobytes()
    out = decode_image(SimpleNamespace(format="png", data=png))
    assert (out == rgb).all()
    with pytest.raises(InputRejected, match="does not decode"):
        decode_image(SimpleNamespace(format="jpeg", data=b"not an image"))
    with pytest.raises(InputRejected, match="4x6 but the policy expects 8x8"):
        fit_image(out, 8, resize=False)
    assert fit_image(out, 8, resize=True).shape == (8, 8, 3)


def _state_at(stamp_s: float) -> SimpleNamespace:
    """A JointState-shaped message of the sim Panda at its home pose (inside every default bound), stamped."""
    home = {name: (low + high) / 2 for name, (low, high) in SIM_STATE_BOUNDS.items()}
    sec = int(stamp_s)
    return SimpleNamespace(header=SimpleNamespace(stamp=SimpleNamespace(sec=sec, nanosec=round((stamp_s - sec) * 1e9))),
                           name=list(SIM_STATE_NAMES), position=[home.get(n, 0.0) for n in SIM_STATE_NAMES])  # fmt: skip


def test_a_stamp_ahead_of_the_clock_is_rejected_and_none_locks_its_stream_out():
    """Node clock at 100 s, future tolerance 0.5 s, staleness limit 0.25 s (values set here)."""
    from robot_bridge.diagnostics import BridgeDiagnostics
    from robot_bridge.inputs import BridgeInputs

    config = ServeConfig()
    config.safety.future_stamp_tolerance_s, config.safety.stale_after_s = 0.5, 0.25
    clock = [100.0]
    diagnostics = BridgeDiagnostics()
    inputs = BridgeInputs(config, diagnostics, LogLimiter(lambda level, line: None), lambda line: None,
                          clock_now=lambda: clock[0])  # fmt: skip

    def accepted(stamp: float, now: float) -> bool:
        clock[0] = now
        inputs.on_joint_state(_state_at(stamp))
        return "joint_states" not in inputs.faults

    assert not accepted(130.0, now=100.0)  # 30 s ahead: rejected, and nothing recorded
    assert inputs.faults["joint_states"][0] == "future_stamp" and "joint_states" not in inputs.stamp
    assert accepted(100.3, now=100.0)  # 0.3 s ahead: within the tolerance
    # 10 ms behind the clock, older than 100.3: the last accepted is still ahead of the clock, so the bar is
    # 100.02 - 0.25 = 99.77, and a message the robot could use is not locked out until the clock reaches 100.3.
    assert accepted(100.01, now=100.02)
    assert not accepted(100.005, now=100.04)  # older than 100.01, which is behind the clock: out of order
    assert inputs.faults["joint_states"][0] == "out_of_order"
    assert not accepted(99.9, now=100.3)  # still older than the last accepted (100.01)
    assert accepted(100.29, now=100.3)
    assert diagnostics.rejections == {"future_stamp": 1, "out_of_order": 2}


def test_the_tick_budget_caps_a_flood_at_the_control_rate_and_keeps_a_jittery_stream_whole():
    from robot_bridge.hold import TickBudget

    # A stream at the rate, each state up to 40% of a period early or late: every state ticks.
    budget = TickBudget(20.0)
    arrivals = [0.0, 0.03, 0.08, 0.15, 0.20, 0.25, 0.27, 0.35]  # gaps in periods: 0.6, 1, 1.4, 1, 1, 0.4, 1.6
    ticks = [budget.allow(t) for t in arrivals]
    # Credit by hand (period 0.05 s; at most 1 banked):
    # t=0: 1 -> tick, 0; 0.03: 0.6 -> tick, -0.4; 0.08: 0.6 -> tick, -0.4; 0.15: min(1, 1.0) -> tick, 0;
    # 0.20: 1 -> tick, 0; 0.25: 1 -> tick, 0; 0.27: 0.4 < 0.5 -> no tick; 0.35: 0.4 + 1.6 -> 1 -> tick, 0.
    assert ticks == [True, True, True, True, True, True, False, True]
    # A flood at 120 Hz for one second (121 states): credit 1/6 a state. Ticks at states 0, 3 (credit 0.5),
    # then every 6 (from -0.5 back to 0.5): 0, 3, 9, ..., 117: 21 ticks, within T * hz + 1.5 = 21.5.
    flood = TickBudget(20.0)
    assert sum(flood.allow(k / 120) for k in range(121)) == 21


def _image_at(stamp_s: float, value: int) -> SimpleNamespace:
    """A 2x2 rgb8 image of one value, stamped."""
    image = _image("rgb8", np.full((2, 2, 3), value, np.uint8))
    sec = int(stamp_s)
    image.header = SimpleNamespace(stamp=SimpleNamespace(sec=sec, nanosec=round((stamp_s - sec) * 1e9)))
    return image


def test_images_are_paired_with_the_joint_state_by_stamp_within_the_tolerance(monkeypatch):
    """Tolerance 50 ms, staleness 0.25 s (set here). Images stamped 9.90, 9.97 and 10.04 s; with the joint state at
    10.00 s the policy sees the 9.97 one (30 ms before it; the newest is 40 ms after), at 10.03 s the 10.04 one; at
    10.20 s none is within 50 ms: no observation, counted, and a hold cause once that has lasted over 0.25 s."""
    from robot_bridge import inputs as inputs_module
    from robot_bridge.diagnostics import BridgeDiagnostics
    from robot_bridge.inputs import BridgeInputs

    config = ServeConfig(cameras=[CameraTopic("front")])
    config.safety.pair_tolerance_s, config.safety.stale_after_s = 0.05, 0.25
    diagnostics = BridgeDiagnostics()
    inputs = BridgeInputs(config, diagnostics, LogLimiter(lambda level, line: None), lambda line: None)
    for stamp, value in ((9.90, 1), (9.97, 2), (10.04, 3)):
        inputs.on_image(config.cameras[0], _image_at(stamp, value))
    inputs.on_joint_state(_state_at(10.0))
    obs = inputs.observation()
    assert obs["observation.images.front"][0, 0, 0, 0] == 2  # 30 ms before, not the newest (40 ms after)
    inputs.on_joint_state(_state_at(10.03))
    assert inputs.observation()["observation.images.front"][0, 0, 0, 0] == 3  # 10 ms after it
    inputs.on_joint_state(_state_at(10.20))  # the nearest image is 160 ms older
    monkeypatch.setattr(inputs_module.time, "monotonic", lambda: 500.0)
    assert inputs.observation() is None and inputs.observation() is None
    assert diagnostics.counters["unpaired_observations"] == 2 and inputs.faults == {}
    assert inputs.pairing_problem(500.2) is None  # 0.2 s: not yet a hold (a stopped camera is stale first)
    key, text = inputs.pairing_problem(500.3)
    assert key == "unpaired camera front" and "safety.pair_tolerance_s" in text and "-160 ms" in text
    # The camera's next image pairs, and the problem ends before any request (none goes out while holding).
    inputs.on_image(config.cameras[0], _image_at(10.21, 4))
    assert inputs.pairing_problem(501.0) is None
    assert inputs.observation()["observation.images.front"][0, 0, 0, 0] == 4


def test_running_a_whole_plan_gives_what_stepping_it_gives_whether_or_not_a_limit_binds():
    """Period 0.1 s, |v| <= 1/s, |dv| <= 5/s per step (0.5/s at 0.1 s), positions in [-1, 1]: a slow ramp binds
    nothing (the clamped targets at once), a jump binds the velocity limit, a target past 1 the clamp."""
    for plan in (np.linspace(0.0, 0.3, 7)[1:, None], np.array([[0.05], [0.5], [0.5]]), np.array([[0.05], [1.5]])):
        stepped, ran = (
            SafetyFilter(0.1, 1, [-1.0], [1.0], [1.0], [5.0]),
            SafetyFilter(0.1, 1, [-1.0], [1.0], [1.0], [5.0]),
        )
        stepped.start_from(np.zeros(1), np.array([0.5]))
        ran.start_from(np.zeros(1), np.array([0.5]))
        np.testing.assert_allclose(ran.run(plan), np.stack([stepped.step(t) for t in plan]), rtol=0, atol=1e-12)
        np.testing.assert_allclose(ran.last_command, stepped.last_command, atol=1e-12)
        np.testing.assert_allclose(ran.step(np.array([0.2])), stepped.step(np.array([0.2])), atol=1e-12)
    # The jump from 0.05 to 0.5 at 0.1 s is 4.5/s: limited to 1/s, 0.15 then 0.25, not the target.
    limited = SafetyFilter(0.1, 1, [-1.0], [1.0], [1.0], [5.0])
    limited.start_from(np.zeros(1), np.array([0.5]))
    assert limited.run(np.array([[0.05], [0.5], [0.5]]))[:, 0] == pytest.approx([0.05, 0.15, 0.25])
