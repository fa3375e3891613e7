"""Everything ROS 2: the serve node, recording and conversion to datasets.

- `topics`: the one table of topic names and message types; `codec`: the one codec between
  messages and numpy (images, joint states, trajectories, stamps), both directions;
- `vla-rl serve`: `node` (ROS glue) around `inputs`, `hold`, `chunk_scheduler` and
  `diagnostics`, with `config`, `inference`, `safety`, `scheduling`, `log_limit`; `bench`;
- `vla-rl record-ros`: `record`; `vla-rl convert`: `convert`. The simulated robot (`vla-rl
  sim-robot`) composes the simulator with this package, so it is a command: `vla_rl.sim_robot`.

Dependencies point one way: this package imports only `vla_core` (the contracts, the latency
model, the robot description `vla_core.robot`); `vla_rl` imports it only inside the functions
of the commands that need ROS. rclpy is imported only inside the node modules (`node`, `bench`'s
processes) and inside the functions of the others that need it, so configs, checks and the codec
load without ROS.
"""
