"""`vla-rl serve --inference=remote` over real rclpy, with the policy server in another process on loopback: the
robot is served, holds (naming the server) when the server disappears, and resumes when it returns."""

import socket
import subprocess
import sys
from pathlib import Path

from extras import require

require("rclpy", "ros")

import test_bridge_node
from test_bridge_node import make_bridge, spin_until

ros = test_bridge_node.ros  # the fixture the test takes

ROOT = Path(__file__).resolve().parents[1]
SERVER = (
    "import sys; sys.path.insert(0, 'tests'); from bridge_policies import ramp_policy; "
    "from robot_bridge.policy_server import PolicyServerConfig, run_policy_server; "
    "run_policy_server(PolicyServerConfig(address=sys.argv[1]), ramp_policy)"
)


def start_server(address: str) -> subprocess.Popen:
    """A policy server of the ramp policy in its own process, once it listens."""
    server = subprocess.Popen([sys.executable, "-c", SERVER, address], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()  # "policy server for ... listening on ..." once the port is open
    assert "listening on" in line, line
    return server


def test_the_robot_holds_while_the_policy_server_is_gone_and_resumes_when_it_returns(ros):
    context, executor = ros
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    server = start_server(address)
    bridge, robot = make_bridge(context, executor, inference="remote", inference_server=address, load_retry_s=0.3)
    try:
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING" and len(robot.chunks) >= 2), (
            bridge.hold.cause
        )
        server.kill()  # gone without a word, as a machine that loses power
        server.wait()
        # FAILED, as a policy that fails to load: the node keeps commanding the hold, naming the server.
        assert spin_until(executor, lambda: bridge.hold.state == "FAILED"), bridge.hold.state
        assert f"policy server at {address} unreachable" in bridge.hold.cause, bridge.hold.cause
        held, commands = len(robot.chunks), len(robot.commands)
        assert spin_until(executor, lambda: len(robot.commands) >= commands + 5)  # still commanded: the hold
        assert len({tuple(c[1]) for c in robot.commands[-3:]}) == 1
        server = start_server(address)
        assert spin_until(executor, lambda: bridge.hold.state == "RUNNING" and len(robot.chunks) >= held + 2), (
            bridge.hold.cause
        )
    finally:
        bridge.close()
        server.kill()
        server.wait()
