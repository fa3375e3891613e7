"""The low layer of vla-rl that every other package builds on: the contracts (`vla_core.types`,
`vla_core.rl`), the latency model (`vla_core.runtime`), the robot description (`vla_core.robot`),
the registries (`vla_core.registry`), dataset and file helpers and the stop-signal handling.

Torch, numpy and the dataset library only: importing it pulls in no trainer, simulator or ROS.
"""
