"""Incompatible QoS between serve's topics and their peers, found in the ROS graph and named with the fix.

A DDS publisher and subscription whose QoS do not match never connect, and neither side gets a message: a
controller subscribing with transient-local durability to a volatile command publisher never receives a
command, and rclpy says so once in the log. The node asks the graph, at the diagnostics rate, for the QoS of
every peer on each topic it publishes or subscribes (`rclpy.node.Node.get_subscriptions_info_by_topic` and
`get_publishers_info_by_topic`) and gives them to `QosWatch`, which applies DDS's request-offered rule for the two
policies a ROS 2 graph sets (reliability: reliable requested of best-effort offered fails; durability: a
durability requested above the one offered fails) and names, for each mismatch, the topic, the peer, the policy
and the setting to change. A mismatch clears when the peer goes away or changes. No ROS import here.
"""

from __future__ import annotations

from dataclasses import dataclass

# DDS's order of each policy: offered must be at least requested (request-offered compatibility).
RELIABILITY = {"best_effort": 0, "reliable": 1}
DURABILITY = {"volatile": 0, "transient_local": 1, "transient": 2, "persistent": 3}


@dataclass(frozen=True)
class Qos:
    """The two policies that decide whether endpoints match; a value outside the tables (system default,
    unknown) is taken as matching anything."""

    reliability: str
    durability: str


@dataclass(frozen=True)
class OwnTopic:
    """One of serve's own topics: ``direction`` "publish" or "subscribe", its QoS, and per policy the setting of
    serve's config that changes it ("" where serve's side is fixed: the peer is the one to change)."""

    topic: str
    direction: str
    qos: Qos
    settings: tuple[
        tuple[str, str], ...
    ] = ()  # (policy, config setting), e.g. ("durability", "qos.command_durability")


def mismatches(offered: Qos, requested: Qos) -> list[str]:
    """The policies on which ``offered`` (a publisher's) fails ``requested`` (a subscription's)."""
    out = []
    for policy, order in (("reliability", RELIABILITY), ("durability", DURABILITY)):
        o, r = getattr(offered, policy), getattr(requested, policy)
        if o in order and r in order and order[o] < order[r]:
            out.append(policy)
    return out


class QosWatch:
    """The incompatible peers of each of ``endpoints``, from the graph's answers; ``own``: how the lines name this
    side ("serve", "the robot")."""

    def __init__(self, endpoints: list[OwnTopic], own: str = "serve"):
        self.endpoints, self.own = list(endpoints), own
        self.problems: list[str] = []  # one line per mismatch, sorted

    def update(self, peers: dict[tuple[str, str], list[tuple[str, Qos]]]) -> bool:
        """``peers``: (topic, direction of serve's endpoint) -> the other side's (node, Qos) -> whether the set of
        mismatches changed."""
        problems = []
        for endpoint in self.endpoints:
            settings = dict(endpoint.settings)
            for node, qos in peers.get((endpoint.topic, endpoint.direction), []):
                publishes = endpoint.direction == "publish"
                offered, requested = (endpoint.qos, qos) if publishes else (qos, endpoint.qos)
                for policy in mismatches(offered, requested):
                    wanted = getattr(requested if publishes else offered, policy)
                    ours = getattr(endpoint.qos, policy)
                    fix = (f"set {settings[policy]}: {wanted}" if settings.get(policy)
                           else f"make {node} {'request' if publishes else 'offer'} {ours}")  # fmt: skip
                    role = "requests" if publishes else "offers"
                    problems.append(f"{endpoint.topic}: {node} {role} {policy} {wanted}, {self.own} "
                                    f"{'offers' if publishes else 'requests'} {ours} ({fix})")  # fmt: skip
        problems.sort()
        changed, self.problems = problems != self.problems, problems
        return changed

    def describe(self) -> str:
        """One line naming every mismatch, "" when there is none."""
        return "; ".join(self.problems)


def read_graph(node, settings) -> tuple[list[OwnTopic], dict[tuple[str, str], list[tuple[str, Qos]]]]:
    """``node``'s own topics (an rclpy Node's publishers and subscriptions, ROS's own parameter events and rosout left
    out) and every other node's endpoints on them, from the graph. ``settings(topic, direction)``: the config
    settings that change ``node``'s side of that topic (`OwnTopic.settings`)."""
    own, endpoints, peers = (node.get_name(), node.get_namespace()), [], {}
    for direction, mine, ask in (("publish", node.publishers, node.get_subscriptions_info_by_topic),
                                 ("subscribe", node.subscriptions, node.get_publishers_info_by_topic)):  # fmt: skip
        for entity in mine:
            topic = entity.topic_name
            if topic in ("/parameter_events", "/rosout") or (topic, direction) in peers:
                continue
            endpoints.append(OwnTopic(topic, direction, qos_of(entity.qos_profile), settings(topic, direction)))
            peers[(topic, direction)] = [(node_of(i), qos_of(i.qos_profile)) for i in ask(topic)
                                         if (i.node_name, i.node_namespace) != own]  # fmt: skip
    return endpoints, peers


def qos_of(profile) -> Qos:
    """rclpy's QoSProfile -> the two policies compared here, as lowercase names."""
    return Qos(profile.reliability.name.lower(), profile.durability.name.lower())


def node_of(info) -> str:
    """A graph endpoint's node, fully qualified."""
    return info.node_namespace.rstrip("/") + "/" + info.node_name
