"""Deadline misses, jitter and added latency of the ROS 2 serve node, against raw rclpy ping-pong in the same run.

The same code as `vla-rl bench bridge` (``robot_bridge.bench``): a robot process and the serve node
process over loopback DDS, the policy a real torch network calibrated to ``--inference_ms`` on one core.

Usage: python benchmarks/bridge_latency.py [--rates_hz=[50,100]] [--cycles=10000] [--inference_ms=300] [--help]
Writes JSON (default outputs/bench/bridge.json); the last line printed is
``deadline_misses=<n> added_latency_p99_ms=<x> jitter_p99_ms=<y> realtime_scheduling=<granted|refused>
memory_locking=<granted|refused>``; a miss is a command more than ``--deadline_ms`` (default 5) late.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":  # the spawned serve processes import this file again; only the parent runs
    sys.exit(main(["bench", "bridge", *sys.argv[1:]]))
