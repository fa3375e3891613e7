"""Sim-to-ROS parity of the latency model: one checkpoint served through `vla-rl serve` to `vla-rl sim-robot`
over ROS 2 with a real inference delay, and evaluated in the batched simulation on the same initial states
under the latency trace the robot measured, replayed in order, with the same noise per request.

The same code as `vla-rl bench robot-parity` (``vla_rl.bench_robot_parity``, whose docstring states the protocol
and its dated history).

Usage: python benchmarks/robot_parity.py --checkpoint=DIR [--task=track] [--quick=true] [--help]
Writes outputs/bench/robot_parity/robot_parity.json; the last line printed is
``sim_success=<x> ros_success=<y> gap_points=<y-x in points> episodes=<per side> mcnemar_p=<p>``.
"""

import sys

from vla_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "robot-parity", *sys.argv[1:]]))
