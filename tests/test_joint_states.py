"""`robot_bridge.joint_states.JointStateAssembly`: the state by joint name from messages of several sources."""

import numpy as np
import pytest

from robot_bridge.codec import InputRejected
from robot_bridge.joint_states import JointStateAssembly, source_name

WANTED = ["j1", "j2", "grip"]


def test_partial_messages_assemble_the_state_each_joint_with_its_own_stamp_and_age():
    joints = JointStateAssembly(WANTED, agreement_tolerance=0.01)
    arm, carried, values = joints.read(["j2", "j1", "other"], [0.2, 0.1, 9.0])  # unknown names ignored
    assert carried.tolist() == [1, 0] and values.tolist() == [0.2, 0.1]
    assert joints.take(arm, carried, values, stamp=10.0, arrival=100.0)
    assert not joints.complete and joints.missing() == ["grip"]
    gripper, carried, values = joints.read(["grip"], [0.04])
    assert joints.disagreement(gripper, carried, values, stamp=10.05) == ""
    assert joints.take(gripper, carried, values, stamp=10.05, arrival=100.3)
    assert joints.complete and joints.values.tolist() == [0.1, 0.2, 0.04]
    assert joints.stale(now=100.5, limit=0.25) == ["j1", "j2"]  # the arm's last report 0.5 s old, the grip's 0.2
    assert source_name(gripper, WANTED) == "joint_states [grip]"
    assert source_name(frozenset(["a", "j1", "j2", "grip"]), WANTED) == "joint_states [j1 j2 grip]"


def test_two_sources_disagreeing_at_one_instant_is_named_and_a_lagging_source_never_moves_a_joint_back():
    joints = JointStateAssembly(WANTED, agreement_tolerance=0.01)  # compared within 5 ms
    full = joints.read(WANTED, [0.1, 0.2, 0.04])
    joints.take(*full, stamp=10.0, arrival=1.0)
    gripper, carried, _ = joints.read(["grip"], [0.06])
    why = joints.disagreement(gripper, carried, np.array([0.06]), stamp=10.004)
    assert "grip is 0.04 from joint_states [j1 j2 grip] and 0.06 from joint_states [grip]" in why
    assert joints.disagreement(gripper, carried, np.array([0.045]), stamp=10.004) == ""  # within 0.01
    assert joints.disagreement(gripper, carried, np.array([0.06]), stamp=10.02) == ""  # 20 ms apart: it may have moved
    assert joints.disagreement(full[0], full[1], np.array([0.1, 0.2, 0.5]), stamp=10.001) == ""  # its own report
    assert not joints.take(gripper, carried, np.array([0.07]), stamp=9.9, arrival=1.1)  # older than the arm's report
    assert joints.values[2] == 0.04 and joints.stamps[2] == 10.0
    assert joints.take(full[0], full[1], np.array([0.1, 0.2, 0.03]), stamp=9.95, arrival=1.2)  # its own, older: taken


def test_a_message_of_unequal_lengths_or_a_non_finite_wanted_joint_is_refused():
    joints = JointStateAssembly(WANTED, agreement_tolerance=0.01)
    with pytest.raises(InputRejected, match="2 names but 1 positions"):
        joints.read(["j1", "j2"], [0.1])
    with pytest.raises(InputRejected, match=r"non-finite values for \['j2'\]"):
        joints.read(["j1", "j2"], [0.1, float("nan")])
    assert joints.read(["other"], [float("nan")])[1].size == 0  # a joint the policy does not read: ignored


def _inputs(lines=None):
    from robot_bridge.config import ServeConfig
    from robot_bridge.diagnostics import BridgeDiagnostics
    from robot_bridge.inputs import BridgeInputs
    from robot_bridge.log_limit import LogLimiter

    sink = LogLimiter(lambda level, line: lines.append(line) if lines is not None else None)
    return BridgeInputs(ServeConfig(checkpoint="(test)"), BridgeDiagnostics(), sink, print)


def _msg(names, positions, stamp):
    from types import SimpleNamespace

    return SimpleNamespace(name=list(names), position=list(positions),
                           header=SimpleNamespace(stamp=SimpleNamespace(sec=int(stamp), nanosec=round(stamp % 1 * 1e9))))  # fmt: skip


def test_each_set_of_names_is_its_own_source_and_a_silent_sources_fault_expires(monkeypatch):
    """Two publishers of every joint, one with an extra name, disagreeing about gripper_width: the second's fault is
    its own (the first's messages do not clear it, its stamps are not judged against the first's), and it expires
    once that publisher has been silent for safety.stale_after_s."""
    import robot_bridge.inputs as inputs_module
    from robot_bridge.config import SIM_STATE_NAMES

    now = [100.0]
    monkeypatch.setattr(inputs_module.time, "monotonic", lambda: now[0])
    lines = []
    inputs = _inputs(lines)
    position = [0.0, 0.1, 0.0, -2.2, 0.0, 2.3, 0.7854, 0.04, 0.5, 0.0, 0.2]
    inputs.on_joint_state(_msg(SIM_STATE_NAMES, position, 10.0))
    other = position.copy()
    other[SIM_STATE_NAMES.index("gripper_width")] = 0.07
    inputs.on_joint_state(_msg([*SIM_STATE_NAMES, "extra"], [*other, 1.0], 10.001))
    assert any("more than one source (joint_states, joint_states #2)" in line and "clock: timer" in line
               for line in lines)  # joint states tick the loop by default: uneven ticks, said once  # fmt: skip
    key, text = inputs.fault()
    assert key == "rejected joint_states #2 disagreement" and "gripper_width is 0.04" in text  # its own name
    now[0] += 0.02
    inputs.on_joint_state(_msg(SIM_STATE_NAMES, position, 10.02))  # the first source's next message
    assert inputs.fault() is not None  # still the second's fault
    now[0] += inputs.config.safety.stale_after_s + 0.01  # the second publisher fell silent
    inputs.on_joint_state(_msg(SIM_STATE_NAMES, position, 10.3))
    assert inputs.fault() is None and inputs.state_time == 10.3
