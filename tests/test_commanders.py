"""`robot_bridge.commanders.CommanderWatch`: which publishers on serve's command topics are another node's."""

from robot_bridge.commanders import CommanderWatch, Endpoint

SERVE = Endpoint("vla_rl_serve", "/")


def test_other_publishers_are_named_per_topic_and_a_second_serve_of_the_same_name_is_counted():
    watch = CommanderWatch(SERVE, {"/arm": 1, "/gripper": 1})
    assert not watch.update({"/arm": [SERVE], "/gripper": [SERVE]}) and watch.problem() is None
    assert watch.update({"/arm": [SERVE, Endpoint("teleop", "/operator")], "/gripper": [SERVE]})
    assert watch.describe() == "/arm: /operator/teleop"
    key, text = watch.problem()
    assert "/arm: /operator/teleop" in key and "other_commanders: warn" in text
    # a second serve started alike: two publishers of this node's name where it has one
    watch.update({"/arm": [SERVE], "/gripper": [SERVE, SERVE]})
    assert watch.describe() == "/gripper: /vla_rl_serve"
    assert not watch.update({"/arm": [SERVE], "/gripper": [SERVE, SERVE]})  # unchanged: nothing to log again
    assert watch.update({"/arm": [SERVE], "/gripper": [SERVE]}) and watch.problem() is None
