"""vla-rl: fine-tune vision-language-action policies in simulation and deploy them to robots.

This package holds the commands and compositions (record, train, eval, finetune, the benchmarks, the
stages API); the low layer they build on is `vla_core`. Importing ``vla_rl`` stays light: it pulls
in no trainer, simulator or ROS.
"""

__version__ = "0.3.0"
