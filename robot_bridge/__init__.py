"""Everything ROS 2: the serve node, the simulated robot, recording and conversion to datasets.

- `topics`: the one table of topic names and message types; `codec`: the one codec between
  messages and numpy (images, joint states, trajectories, stamps), both directions;
- `vla-rl serve`: `node` (ROS glue) around `inputs`, `hold`, `chunk_scheduler` and
  `diagnostics`, with `config`, `inference`, `safety`, `scheduling`, `log_limit`; `bench`;
- `vla-rl sim-robot`: `sim_robot`; `vla-rl record-ros`: `record`; `vla-rl convert`: `convert`.

Dependencies point one way: this package may import `vla_core.types`, `vla_core.runtime`,
`policies` and `sim`; `vla_rl`'s core never imports it (only its CLI dispatches to it). rclpy is
imported only inside the node modules (`node`, `bench`'s processes) and inside the functions of
the others that need it, so configs, checks and the codec load without ROS.
"""
