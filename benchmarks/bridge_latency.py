"""The ROS 2 serve node's two outputs under a training load: trajectory output's starved controller ticks and late
chunks, per-tick output's late commands, and the latency added over a raw rclpy ping-pong in the same run.

The same code as `vla-rl bench bridge` (``robot_bridge.bench``, where the protocol and its dated history are): a
robot process and the serve node process over loopback DDS, the policy a real torch network calibrated to
``--inference_ms`` on the idle inference core, a training run on that core (``--load``).

Usage: python benchmarks/bridge_latency.py [--quick=true] [--outputs=[ticks,trajectory]] [--cycles=100000] [--help]
Writes JSON (default outputs/bench/bridge.json); the last line printed is
``starved_ticks=<n> late_chunks=<m> tick_mode_late=<k> ticks=<t>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":  # the spawned serve processes import this file again; only the parent runs
    sys.exit(main(["bench", "bridge", *sys.argv[1:]]))
