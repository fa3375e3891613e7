"""vla-rl: fine-tune vision-language-action policies in simulation and deploy them to robots.

This package stays light: importing ``vla_rl`` or ``vla_core.types`` never pulls in
trainers, simulators or ROS.
"""

__version__ = "0.2.0"
