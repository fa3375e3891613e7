"""LeRobot's policies in vla-rl (type ``lerobot``): ACT, diffusion, pi0, SmolVLA, ... saved by LeRobot."""

from policies.lerobot.configuration_lerobot import LeRobotConfig

__all__ = ["LeRobotConfig"]
