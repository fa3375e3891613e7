"""One commander: other nodes publishing on the command topics serve publishes on.

A ros2_control controller takes commands from every publisher on its topic, so a teleop node left running or a
second serve would command the robot beside this one, unnoticed. The node asks the ROS graph, at the diagnostics
rate, which nodes publish on each of its command topics (`rclpy.node.Node.get_publishers_info_by_topic`) and
gives the answers to `CommanderWatch`, which names every publisher that is not one of its own. No ROS import here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """A publisher as the ROS graph reports it: its node's name and namespace."""

    node_name: str
    node_namespace: str

    @property
    def node(self) -> str:
        """The node's fully qualified name, ``/ns/name``."""
        return self.node_namespace.rstrip("/") + "/" + self.node_name


class CommanderWatch:
    """The other publishers on each command topic.

    ``own``: this node's `Endpoint`; ``own_publishers``: topic -> how many publishers this node has on it. A node
    of the same name and namespace (a second serve started alike) is told apart by count: publishers of that name
    beyond this node's own are another node's.
    """

    def __init__(self, own: Endpoint, own_publishers: dict[str, int]):
        self.own, self.own_publishers = own, dict(own_publishers)
        self.others: dict[str, list[str]] = {}  # topic -> the other publishers' nodes, sorted; only topics with some

    @property
    def topics(self) -> list[str]:
        return list(self.own_publishers)

    def update(self, publishers: dict[str, list[Endpoint]]) -> bool:
        """The graph's publishers on each watched topic -> whether the set of others changed."""
        others = {}
        for topic, endpoints in publishers.items():
            mine = sum(e == self.own for e in endpoints)
            names = sorted(e.node for e in endpoints if e != self.own)
            names += [self.own.node] * max(0, mine - self.own_publishers.get(topic, 0))
            if names:
                others[topic] = names
        changed, self.others = others != self.others, others
        return changed

    def describe(self) -> str:
        """One line naming each topic's other publishers, "" when there are none."""
        return "; ".join(f"{topic}: {', '.join(nodes)}" for topic, nodes in sorted(self.others.items()))

    def problem(self) -> tuple[str, str] | None:
        """(key, text) for the hold while another node commands, None while serve is the only commander. The key
        names the topics and nodes, so a change of who commands is a new cause."""
        others = self.others  # read once: the graph-watch thread replaces it
        if not others:
            return None
        line = "; ".join(f"{topic}: {', '.join(nodes)}" for topic, nodes in sorted(others.items()))
        text = f"another node publishes on a command topic ({line}): stop it, or set other_commanders: warn to command"
        return f"other commanders {line}", text + " beside it"
