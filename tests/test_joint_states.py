"""`robot_bridge.joint_states.JointStateAssembly`: the state by joint name from messages of several sources."""

import numpy as np
import pytest

from robot_bridge.codec import InputRejected
from robot_bridge.joint_states import JointStateAssembly, source_name

WANTED = ["j1", "j2", "grip"]


def test_partial_messages_assemble_the_state_each_joint_with_its_own_stamp_and_age():
    joints = JointStateAssembly(WANTED, agreement_tolerance=0.01, pair_tolerance_s=0.1)
    arm, carried, values = joints.read(["j2", "j1", "other"], [0.2, 0.1, 9.0])  # unknown names ignored
    assert carried.tolist() == [1, 0] and values.tolist() == [0.2, 0.1]
    joints.take(arm, carried, values, stamp=10.0, arrival=100.0)
    assert not joints.complete and joints.missing() == ["grip"]
    gripper, carried, values = joints.read(["grip"], [0.04])
    assert joints.disagreement(gripper, carried, values, stamp=10.05) == ""
    joints.take(gripper, carried, values, stamp=10.05, arrival=100.3)
    assert joints.complete and joints.values.tolist() == [0.1, 0.2, 0.04]
    assert joints.stale(now=100.5, limit=0.25) == ["j1", "j2"]  # the arm's last report 0.5 s old, the grip's 0.2
    assert source_name(gripper, WANTED) == "joint_states [grip]"
    assert source_name(frozenset(["a", "j1", "j2", "grip"]), WANTED) == "joint_states [j1 j2 grip]"


def test_two_sources_disagreeing_near_in_stamp_is_named_and_far_in_stamp_is_not():
    joints = JointStateAssembly(WANTED, agreement_tolerance=0.01, pair_tolerance_s=0.1)
    full = joints.read(WANTED, [0.1, 0.2, 0.04])
    joints.take(*full, stamp=10.0, arrival=1.0)
    gripper, carried, _ = joints.read(["grip"], [0.06])
    why = joints.disagreement(gripper, carried, np.array([0.06]), stamp=10.05)
    assert "grip is 0.04 from joint_states [j1 j2 grip] and 0.06 from joint_states [grip]" in why
    assert joints.disagreement(gripper, carried, np.array([0.045]), stamp=10.05) == ""  # within 0.01
    assert joints.disagreement(gripper, carried, np.array([0.06]), stamp=10.2) == ""  # 0.2 s apart: it may have moved
    assert joints.disagreement(full[0], full[1], np.array([0.1, 0.2, 0.5]), stamp=10.01) == ""  # its own report


def test_a_message_of_unequal_lengths_or_a_non_finite_wanted_joint_is_refused():
    joints = JointStateAssembly(WANTED, agreement_tolerance=0.01, pair_tolerance_s=0.1)
    with pytest.raises(InputRejected, match="2 names but 1 positions"):
        joints.read(["j1", "j2"], [0.1])
    with pytest.raises(InputRejected, match=r"non-finite values for \['j2'\]"):
        joints.read(["j1", "j2"], [0.1, float("nan")])
    assert joints.read(["other"], [float("nan")])[1].size == 0  # a joint the policy does not read: ignored
