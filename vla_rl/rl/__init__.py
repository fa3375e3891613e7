"""RL fine-tuning of chunked diffusion and flow policies: rollouts through the latency model
(``rollout``), what PPO and GRPO share in an update (``update``), one file per algorithm (``ppo``,
``grpo``), and the multi-task parts (``curriculum``, ``pcgrad``). The command is ``vla_rl.finetune``."""
