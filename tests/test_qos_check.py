"""`robot_bridge.qos_check`: DDS's request-offered rule for reliability and durability, and the fix it names."""

from robot_bridge.qos_check import OwnTopic, Qos, QosWatch, mismatches

RELIABLE, BEST_EFFORT = Qos("reliable", "volatile"), Qos("best_effort", "volatile")
LATCHED = Qos("reliable", "transient_local")


def test_offered_must_be_at_least_requested_on_each_policy():
    assert mismatches(offered=BEST_EFFORT, requested=RELIABLE) == ["reliability"]
    assert mismatches(offered=RELIABLE, requested=BEST_EFFORT) == []
    assert mismatches(offered=RELIABLE, requested=LATCHED) == ["durability"]
    assert mismatches(offered=LATCHED, requested=RELIABLE) == []
    assert mismatches(offered=Qos("best_effort", "volatile"), requested=LATCHED) == ["reliability", "durability"]
    assert mismatches(offered=Qos("system_default", "unknown"), requested=LATCHED) == []  # not judged


def test_each_mismatch_names_topic_peer_policy_and_the_setting_to_change():
    command = OwnTopic("/cmd", "publish", RELIABLE, (("durability", "qos.command_durability"),))
    sensor = OwnTopic("/joint_states", "subscribe", RELIABLE, (("reliability", "qos.sensor_reliability"),))
    report = OwnTopic("/diagnostics", "publish", RELIABLE)
    watch = QosWatch([command, sensor, report])
    assert watch.update({("/cmd", "publish"): [("/controller", LATCHED)],
                         ("/joint_states", "subscribe"): [("/driver", BEST_EFFORT)],
                         ("/diagnostics", "publish"): [("/monitor", LATCHED)]})  # fmt: skip
    assert watch.problems == [
        (
            "/cmd: /controller requests durability transient_local, serve offers volatile (set qos.command_durability: "
            "transient_local)"
        ),
        (
            "/diagnostics: /monitor requests durability transient_local, serve offers volatile (make /monitor request "
            "volatile)"
        ),
        (
            "/joint_states: /driver offers reliability best_effort, serve requests reliable (set qos.sensor_reliability: "
            "best_effort)"
        ),
    ]
    assert not watch.update({("/cmd", "publish"): [("/controller", LATCHED)], ("/joint_states", "subscribe"): [
        ("/driver", BEST_EFFORT)], ("/diagnostics", "publish"): [("/monitor", LATCHED)]})  # unchanged  # fmt: skip
    assert watch.update({("/cmd", "publish"): [("/controller", RELIABLE)]}) and watch.describe() == ""
