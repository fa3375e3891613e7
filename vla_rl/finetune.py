"""`vla-rl finetune`: improve an imitation checkpoint from its own rollouts with PPO or GRPO.

One iteration: roll the policy out in the batched env through the latency model
(`vla_rl.rl.rollout`, the same `DelayedChunkEnv` as ``vla-rl eval``), then update it with the
algorithm of ``--algo`` (`vla_rl.rl.ppo`, `vla_rl.rl.grpo`; one file each, the math in their
docstrings). The decision is a chunk and the RL action is its denoising chain, a Gaussian policy
(``--noise.*``: `policies.denoising_chain.ExplorationNoise`).

Merging: RL trains with ``--chunking.merge=latest`` only. Ensembling or RTC blending would execute
actions other than the sampled ones, which the chain's log-probability would not describe; they
are refused, not corrected. Evaluate the fine-tuned policy under any merge with ``vla-rl eval``.

Sampling during RL is the deterministic sampler plus noise by default (``noise.eta=0``,
``noise.min_std=0.1``): the policy that ``vla-rl eval`` and ``vla-rl serve`` run (the chain with
noise -> 0) is then the mean of the one RL trains.

``--train_last_steps=k`` restricts the actor loss to the last k of the K denoising steps (DPPO
found the late steps matter most). Unlike DPPO, which samples the early steps from a frozen copy of
the imitation policy and saves both, every step here runs the trained weights, in sampling and in
``vla-rl eval`` alike: one network, so the checkpoint loads anywhere unchanged. The early steps are
not trained directly, but they drift with the shared weights.

``--latency_aware=true`` adds the fast head of ARLI (`policies.latency_head`); with
``--latency_warmup.steps`` it is first fitted on demonstrations under the run's delays
(`vla_rl.latency_warmup`), and the run starts from that policy (saved as ``latency_warmup/``).

``--reward.process_model=DIR`` (a ``vla-rl train-prm`` output, VLA-RL's process reward) adds a dense
reward to every chunk decision of PPO: potential-based shaping with the model's progress estimate,
zero at every episode's end, so the optimal policy is unchanged (`vla_rl.rl.process_reward`). It reads
only the observations, so it works for any policy kind; the history records its mean per decision.

Several tasks (``--tasks=[lift,reach,push]``): each gets its own batch of ``env.num_envs`` worlds
(task-balanced), and the policy must have been trained on all of them. ``--curriculum_tasks=k``
rolls out k of them per iteration, drawn by success and learning progress
(`vla_rl.rl.curriculum`); ``--pcgrad=true`` projects conflicting per-task gradients
(`vla_rl.rl.pcgrad`). Evaluations run on every task.

Seeds: rollout r of the run resets with seeds from ``seed + 1_000_000`` upward, so they never meet
the evaluation seeds (``eval_seed``, 1000 by default, one per evaluation round as in ``vla-rl eval``).

Writes into ``output_dir``: ``checkpoints/step-<iteration>/`` (the policy as ``vla-rl eval`` and
``vla-rl serve`` load it, plus ``training_state/`` for ``--resume``), ``eval/iter-<n>/`` (periodic
evaluations through ``vla-rl eval``'s own code), ``finetune_summary.json`` (success curve, losses,
rollout and update seconds per iteration, executed env-steps per second of the whole iteration (see
`vla_rl.rl.report.iteration_record`)) and ``success.png``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm import tqdm

from policies.denoising_chain import ExplorationNoise
from policies.lerobot.adaptation import AdaptationConfig
from sim.config import EnvConfig
from vla_core import crash_log, interrupt
from vla_core.files import write_text_atomic
from vla_core.runtime import (
    DEFAULT_MID_FRACTION,
    ChunkingConfig,
    DelayConfig,
    DelayModel,
    LatencySpec,
    check_merge,
    check_mid_fraction,
)
from vla_core.runtime.delayed_env import DelayedChunkEnv, step_policy_of
from vla_core.types import TASK
from vla_rl.checkpoint import (
    TRAINING_STATE_DIR,
    check_resume,
    load_policy,
    resolve_policy_dir,
)
from vla_rl.latency_warmup import LatencyWarmupConfig
from vla_rl.rl import checkpointing, report
from vla_rl.rl.evaluation import PeriodicEvaluation
from vla_rl.rl.grpo import GRPOConfig
from vla_rl.rl.latency_aware import make_latency_aware, warm_up_fast_part
from vla_rl.rl.ppo import PPOConfig
from vla_rl.rl.process_reward import RewardConfig, check_resumed_reward, load_process_reward
from vla_rl.rl.ray_runtime import RayConfig
from vla_rl.rl.sources import LocalRollouts, RayRollouts

Algo = Literal["ppo", "grpo"]


@dataclass
class FinetuneConfig:
    """Fine-tune an imitation checkpoint with RL in the batched simulator."""

    checkpoint: str = "outputs/quickstart/train"  # imitation checkpoint (or training output dir: its last)
    # A LeRobot VLA checkpoint's tokenizer, in a local folder (pi0/pi05: PaliGemma's; SmolVLA: its VLM's,
    # with config.json); "": the checkpoint's tokenizer/ folder, else the Hugging Face cache.
    tokenizer_dir: str = ""
    # A LeRobot flow VLA (pi0, pi05, SmolVLA): which weights train (all, the action expert, LoRA
    # adapters), their dtype and gradient checkpointing (`policies.lerobot.adaptation`).
    vla: AdaptationConfig = field(default_factory=AdaptationConfig)
    algo: Algo = "ppo"  # ppo (value head, GAE) or grpo (groups of rollouts from one state, no critic)
    env: EnvConfig = field(default_factory=lambda: EnvConfig(num_envs=16))  # task and worlds of the rollouts
    # Several tasks in one run, e.g. [lift,reach,push]: env.num_envs worlds each (task-balanced);
    # empty = env.task alone. The policy must have been trained on their data.
    tasks: list[str] = field(default_factory=list)
    # Tasks rolled out per iteration, chosen by the success-and-progress curriculum
    # (`vla_rl.rl.curriculum`); 0 = every task every iteration.
    curriculum_tasks: int = 0
    pcgrad: bool = False  # project conflicting per-task gradients (PCGrad); needs two tasks or more
    iterations: int = 20  # rollout + update rounds
    max_env_steps: int = 0  # stop once the rollouts used this many control steps (0 = no budget)
    # Steps executed per chunk (0 = the policy's n_action_steps); merge must stay latest (see the docstring).
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)  # inference delay of the rollouts (0 = none)
    noise: ExplorationNoise = field(default_factory=lambda: ExplorationNoise(eta=0.0, min_std=0.1))
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # Dense rewards added to the sparse success reward: --reward.process_model=<a vla-rl train-prm output>
    # shapes each chunk's reward with VLA-RL's process reward model (`vla_rl.rl.process_reward`; PPO only).
    reward: RewardConfig = field(default_factory=RewardConfig)
    lr: float = 1e-5  # actor learning rate (AdamW)
    update_epochs: int = 4  # passes over each rollout
    minibatch_size: int = 64  # chunk decisions per gradient step
    clip_low: float = 0.2  # ratio kept >= 1 - clip_low
    clip_high: float = 0.28  # ratio kept <= 1 + clip_high (clip-higher)
    # The actor loss covers only the last k of the K denoising steps (DPPO's advice: the late steps
    # shape the action); 0 = all K. Sampling still runs every step with the trained weights.
    train_last_steps: int = 0
    # Latency-aware RL (ARLI): the policy gains a fast head that reads the committed actions and the
    # mid-inference observation (`policies.latency_head`). false: naive RL, the policy sees only the
    # observation its request was made from, and its chunk starts d steps later.
    latency_aware: bool = False
    mid_fraction: float = DEFAULT_MID_FRACTION  # where in the inference window the mid observation is taken, in [0, 1)
    latency_head_lr: float = 1e-4  # the fast head's learning rate (it starts at zero: the imitation policy)
    # Before RL, fit the fast head on demonstrations under the run's delays (`vla_rl.latency_warmup`);
    # steps=0 (default): RL starts it from zero.
    latency_warmup: LatencyWarmupConfig = field(default_factory=LatencyWarmupConfig)
    # ARLI's low-latency policy (`policies.low_latency`): the policy gains a small fast part that acts every
    # control step on the freshest observation, correcting the plan; RL trains it alone at the control-step
    # level (`vla_rl.rl.low_latency`), the slow policy frozen. Checkpoints then run it in eval and serve.
    low_latency: bool = False
    low_latency_rows: int = 0  # plan rows the fast part reads (0 = the policy's horizon)
    # Where rollouts run: local = this process, between updates (reproducible bit for bit); ray =
    # asynchronous Ray actors that collect while the learner updates (`vla_rl.rl.ray_runtime`).
    runtime: Literal["local", "ray"] = "local"
    ray: RayConfig = field(default_factory=RayConfig)
    max_grad_norm: float = 1.0  # gradient clipping (0 = off)
    eval_every: int = 5  # evaluate every this many iterations, and before the first and after the last (0 = never)
    eval_episodes: int = 50
    eval_seed: int = 1000  # as `vla-rl eval --seed`
    save_every: int = 1  # checkpoint every this many iterations (and after the last)
    seed: int = 0
    output_dir: str = "outputs/finetune"
    resume: bool = False  # continue the run in output_dir from its last checkpoint
    device: str = "cpu"  # torch device of the policy (under `accelerate launch`: the one each process is given)
    num_threads: int = 0  # torch CPU threads; 0 = all cores
    log_with: Literal["tensorboard", "wandb", "none"] = "tensorboard"  # accelerate tracker

    def task_list(self) -> list[str]:
        return list(self.tasks) or [self.env.task]

    def validate(self) -> None:
        tasks = self.task_list()
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"--tasks={tasks} names a task twice; list each once")
        if self.pcgrad and len(tasks) < 2:
            raise ValueError("--pcgrad=true projects one task's gradient against another's; give --tasks=[a,b,...]")
        if self.pcgrad and self.curriculum_tasks == 1:
            raise ValueError("--pcgrad=true needs two tasks in each rollout; set --curriculum_tasks=0 or >= 2")
        if not 0 <= self.curriculum_tasks <= len(tasks):
            raise ValueError(
                f"--curriculum_tasks must be in [0, {len(tasks)}] (the number of tasks), got {self.curriculum_tasks}"
            )
        if self.algo not in ("ppo", "grpo"):
            raise ValueError(f"--algo={self.algo!r} is unknown; choose --algo=ppo or --algo=grpo")
        self.chunking.validate()
        check_merge(self.chunking.merge, use="finetune")  # the latency protocol's table
        self.noise.check_density()  # RL needs the chain's log-probability
        self.vla.validate()
        self.ppo.validate()
        self.reward.validate(self.algo)
        if self.algo == "grpo":
            self.grpo.validate(self.env.num_envs)
        # The other algorithm's settings would be ignored: refused, naming them.
        unused, kind = (self.ppo, PPOConfig) if self.algo == "grpo" else (self.grpo, GRPOConfig)
        changed = [f.name for f in fields(kind) if getattr(unused, f.name) != getattr(kind(), f.name)]
        if changed:
            other = "ppo" if self.algo == "grpo" else "grpo"
            raise ValueError(
                f"--{other}.{changed[0]} does nothing under --algo={self.algo}; drop the --{other}.* flags "
                f"({', '.join(changed)}) or set --algo={other}"
            )
        if self.iterations < 1 or self.update_epochs < 1 or self.minibatch_size < 1 or self.save_every < 1:
            raise ValueError("--iterations, --update_epochs, --minibatch_size and --save_every must be >= 1")
        if self.lr <= 0 or not 0 <= self.clip_low < 1 or self.clip_high < 0 or self.max_env_steps < 0:
            raise ValueError("--lr must be > 0, --clip_low in [0, 1), --clip_high and --max_env_steps >= 0")
        if self.eval_every < 0 or self.max_grad_norm < 0 or (self.eval_every and self.eval_episodes < 1):
            raise ValueError("--eval_every and --max_grad_norm must be >= 0, and --eval_episodes >= 1 when evaluating")
        if self.latency_aware:
            check_mid_fraction(self.mid_fraction, "--mid_fraction")
            if self.latency_head_lr <= 0:
                raise ValueError(f"--latency_head_lr={self.latency_head_lr} must be > 0")
        self.latency_warmup.validate()
        if self.latency_warmup.steps and not (self.latency_aware or self.low_latency):
            raise ValueError(
                "--latency_warmup.steps fits the fast head of a latency-aware run or the low-latency part of a "
                "--low_latency run; add --latency_aware=true or --low_latency=true"
            )
        if self.runtime not in ("local", "ray"):
            raise ValueError(f"--runtime={self.runtime!r} is unknown; choose --runtime=local or --runtime=ray")
        if self.runtime == "ray":
            self.ray.validate()
            if len(self.task_list()) > 1:
                raise ValueError("--runtime=ray rolls out one task; drop --tasks or use --runtime=local")
            if self.algo == "grpo" and self.grpo.dynamic_sampling and self.grpo.max_refills:
                raise ValueError(
                    "--runtime=ray does not refill GRPO batches (its rollouts arrive as they come; uniform groups "
                    "are only dropped); pass --grpo.max_refills=0, or use --runtime=local"
                )
        else:  # Ray's settings would be ignored: refused, naming them
            changed = [f.name for f in fields(RayConfig) if getattr(self.ray, f.name) != getattr(RayConfig(), f.name)]
            if changed:
                raise ValueError(
                    f"--ray.{changed[0]} does nothing under --runtime={self.runtime}; drop the --ray.* flags "
                    f"({', '.join(changed)}) or set --runtime=ray"
                )
        if self.train_last_steps < 0:
            raise ValueError(f"--train_last_steps={self.train_last_steps} must be >= 0 (0 = every denoising step)")
        self._validate_low_latency()

    def _validate_low_latency(self) -> None:
        """What a low-latency run (its fast part trained alone, per control step) cannot be combined with."""
        if self.low_latency_rows < 0:
            raise ValueError(f"--low_latency_rows={self.low_latency_rows} must be >= 0 (0 = the policy's horizon)")
        if not self.low_latency:
            if self.low_latency_rows:
                raise ValueError(
                    "--low_latency_rows shapes the fast part of --low_latency=true; add it or drop the flag"
                )
            return
        conflicts = {
            "--algo=grpo": self.algo == "grpo", "--runtime=ray": self.runtime == "ray",
            "--latency_aware=true": self.latency_aware, "--train_last_steps": self.train_last_steps > 0,
            "--reward.process_model": bool(self.reward.process_model), "--ppo.kl_coef": self.ppo.kl_coef > 0,
        }  # fmt: skip
        found = [flag for flag, on in conflicts.items() if on]
        if found:
            raise ValueError(
                f"--low_latency=true trains the fast part alone, with PPO per control step, locally, the slow policy "
                f"frozen; drop {found[0]}"
            )


def check_policy_fits(policy, env, env_cfg: EnvConfig) -> None:
    """One line naming the fix when the checkpoint cannot act in this env."""
    from policies.tokenizer import words

    pcfg = policy.config

    # Words of the task's instruction the policy never read: it was not trained on this task.
    instructions = set(env.reset(seed=0)[TASK])
    unknown = sorted({w for text in instructions for w in words(text)} - set(pcfg.vocabulary))
    if pcfg.vocabulary and unknown:
        raise ValueError(
            f"the policy was not trained on {env_cfg.task!r}: its instruction has words it never read ({', '.join(unknown)}); "
            f"fine-tune a checkpoint trained on this task's data (vla-rl record --tasks=[...], then vla-rl train)"
        )
    state_dim = env.features["observation.state"]["shape"][0]
    if pcfg.action_dim != env.action_dim or pcfg.state_dim != state_dim:
        raise ValueError(
            f"the checkpoint acts in {pcfg.action_dim} dims on a {pcfg.state_dim}-dim state but env {env_cfg.task!r} "
            f"has {env.action_dim} and {state_dim}; choose a checkpoint trained on this task's data"
        )
    if list(env_cfg.cameras) != list(pcfg.cameras):
        raise ValueError(
            f"the policy reads cameras {pcfg.cameras} but the env renders {env_cfg.cameras}; "
            f"set --env.cameras=[{','.join(pcfg.cameras)}]"
        )
    if env_cfg.image_size != pcfg.image_size:
        raise ValueError(
            f"the policy expects {pcfg.image_size}px images but the env renders {env_cfg.image_size}px; "
            f"set --env.image_size={pcfg.image_size}"
        )


@dataclass
class _Run:
    """What one fine-tuning run wires together (see `finetune`)."""

    cfg: FinetuneConfig
    tasks: list[str]
    out: Path
    accelerator: Any
    processes: Any  # `vla_rl.rl.update.Processes`
    actor: Any  # `vla_core.rl.RLPolicy`
    learner: Any  # `vla_rl.rl.ppo.PPO` or `vla_rl.rl.grpo.GRPO`
    shells: list  # one `DelayedChunkEnv` per task
    delay: Any  # the `DelayModel` every task draws from
    curriculum: Any
    streams: dict[str, torch.Generator]  # the run's own random streams, saved with every checkpoint
    state: dict  # iteration, env_steps, history, evals, skipped updates
    evaluation: Any  # `vla_rl.rl.evaluation.PeriodicEvaluation`
    logging: bool  # to the accelerate trackers
    process_reward: Any = None  # `vla_rl.rl.process_reward.ProcessReward` of --reward.process_model, or None

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    def finished(self) -> bool:
        budget_spent = self.cfg.max_env_steps > 0 and self.state["env_steps"] >= self.cfg.max_env_steps
        return self.state["iteration"] >= self.cfg.iterations or budget_spent

    def save(self) -> None:
        protocols = [shell.protocol for shell in self.shells]
        checkpointing.save(self.checkpoints, self.actor.policy, self.learner, self.streams, protocols, self.delay,
                           self.curriculum, self.state, self.cfg.algo, self.processes)  # fmt: skip


def finetune(cfg: FinetuneConfig) -> dict:
    """Fine-tune ``cfg.checkpoint`` (or resume the run in ``cfg.output_dir``); returns the summary it writes
    to ``finetune_summary.json``. Reads top to bottom: the policy and its RL actor, the envs behind the
    latency protocol, the learner, then rollout -> update -> evaluate -> checkpoint until done."""
    from sim.factory import make_env
    from vla_rl.accelerator import make_accelerator
    from vla_rl.rl.update import Processes

    cfg.validate()
    if cfg.runtime == "ray" and cfg.ray.address:  # one line naming the fix, before anything starts
        from vla_rl.rl.ray_runtime import check_reachable

        check_reachable(cfg.ray.address)
    torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
    out = Path(cfg.output_dir)
    source = check_resume(out / "checkpoints", cfg.resume) or cfg.checkpoint
    if cfg.resume:
        check_resumed_reward(out, cfg.reward)
    # Under `accelerate launch` there are several processes, each with its own worlds (see Processes),
    # each on the device the launcher gives it; a single process runs on --device.
    accelerator = make_accelerator([] if cfg.log_with == "none" else [cfg.log_with], out)
    processes = Processes(accelerator)
    if cfg.runtime == "ray" and processes.count > 1 and not cfg.ray.address:
        raise ValueError(
            "--runtime=ray under accelerate launch joins one cluster from every learner process: start it with "
            "`ray start --head` and pass --ray.address=auto"
        )
    device = accelerator.device if processes.count > 1 else cfg.device
    policy, policy_dir = _load_trained_policy(cfg, source, device, out)
    # The RL contract: refused, with the fix, for a policy that has none (its actor is built for the run's
    # latency protocol once the envs are open).
    factors = trained_factors(cfg.train_last_steps, policy.rl_actor(cfg.noise))
    tasks = cfg.task_list()
    env_cfgs = [replace(cfg.env, task=task) for task in tasks]
    with contextlib.ExitStack() as closing:
        # Under Ray the worlds are the workers'; this process keeps one, for the checks and the control period.
        own = [replace(c, num_envs=1, render_threads=1) if cfg.runtime == "ray" else c for c in env_cfgs]
        envs = [closing.enter_context(make_env(env_cfg)) for env_cfg in own]
        for env, env_cfg in zip(envs, env_cfgs, strict=True):
            check_policy_fits(policy, env, env_cfg)
        process_reward = load_process_reward(cfg.reward, envs, env_cfgs, policy.device)  # checked against every env
        gamma = cfg.ppo.gamma if cfg.algo == "ppo" else 1.0  # the credit windows' discount per control step
        run, policy_dir = _wire(cfg, tasks, env_cfgs, envs, out, accelerator, processes, policy, factors, policy_dir)
        actor, run.process_reward = run.actor, process_reward
        if run.logging:
            accelerator.init_trackers("finetune", config={"algo": cfg.algo, "lr": cfg.lr, "tasks": ",".join(tasks)})
        if accelerator.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
        closing.enter_context(crash_log.into(out, processes.index))
        if accelerator.is_main_process:
            write_text_atomic(out / "finetune_config.json", json.dumps(asdict(cfg), indent=2))
            if not cfg.resume:
                write_text_atomic(out / "initial_checkpoint.txt", str(policy_dir))
            if not cfg.resume and cfg.eval_every:
                run.evaluation(actor.policy, policy_dir, run.state)
        rollouts = (RayRollouts(actor, cfg, gamma, run.state["iteration"], run.curriculum, processes)
                    if cfg.runtime == "ray" else LocalRollouts(actor, run.shells, cfg, gamma, run.curriculum, processes,
                                                      collector(cfg)))  # fmt: skip
        closing.callback(rollouts.close)
        start = time.time()
        _train(run, rollouts)
    if run.logging:
        accelerator.end_training()
    summary = report.summary(cfg, tasks, run.state, time.time() - start, actor.policy.device)
    if accelerator.is_main_process:
        write_text_atomic(out / "finetune_summary.json", json.dumps(summary, indent=2))
        report.plot_success(run.state, out / "success.png", cfg.algo)
    return summary


def collector(cfg: FinetuneConfig):
    """How the run's rollouts are collected: per control step of the low-latency part
    (`vla_rl.rl.low_latency.collect_steps`), or None: per chunk decision (`vla_rl.rl.rollout.collect`)."""
    if cfg.low_latency:
        from vla_rl.rl.low_latency import collect_steps

        return collect_steps
    return None


def _load_trained_policy(cfg: FinetuneConfig, source: str | Path, device, out: Path):
    """The policy RL trains, from ``source``, with ``cfg.vla``'s adaptation (a LeRobot VLA). A resumed LoRA
    run rebuilds its exact weights: the run's initial checkpoint plus the adapters its last one saved (the
    last checkpoint's weights hold them merged, and are not loaded: one VLA in memory, not two). Returns
    (policy, the directory of ``source``)."""
    if cfg.vla.trainable == "lora" and cfg.resume:
        policy_dir = resolve_policy_dir(source)
        policy, _ = load_policy(checkpointing.initial_checkpoint(out), device=device, tokenizer_dir=cfg.tokenizer_dir)
    else:
        policy, policy_dir = load_policy(source, device=device, tokenizer_dir=cfg.tokenizer_dir)
    if cfg.vla.is_default():
        return policy, policy_dir
    if not getattr(policy, "is_flow", False):
        raise ValueError(
            f"--vla.* adapts LeRobot's flow VLAs (pi0, pi05, SmolVLA) for fine-tuning; {source} holds a "
            f"{getattr(policy.config, 'lerobot_type', '') or policy.config.type!r} policy: drop the --vla.* flags"
        )
    policy.adapt(cfg.vla, cfg.seed)
    if cfg.vla.trainable == "lora" and cfg.resume:
        policy.adapted.load_adapter(policy.model, policy_dir)
    return policy, policy_dir


def make_low_latency(cfg: FinetuneConfig, policy, max_delay: int, lead: int, steps_per_chunk: int, out: Path,
                     control_dt: float, processes):  # fmt: skip
    """With ``--low_latency``: give ``policy`` its low-latency part (unless it has one: a resumed run's) for plan
    ages up to the largest delay (``max_delay`` + ``lead``) plus a chunk's steps, fitted on demonstrations first
    with ``--latency_warmup.steps`` (`vla_rl.low_latency_warmup`), freeze everything else. Returns (the part's RL
    actor, the warmed-up checkpoint the run starts from or None); (None, None) without the flag."""
    if not cfg.low_latency:
        return None, None
    from vla_rl.low_latency_warmup import warm_up_low_latency
    from vla_rl.rl.low_latency import LowLatencyActor

    rows, max_age = cfg.low_latency_rows or policy.config.horizon, max_delay + lead + steps_per_chunk
    warmed = None
    if policy.low_latency is None:
        policy.add_low_latency(rows, max_age, list(policy.config.cameras))
        if cfg.latency_warmup.steps:
            warmed = warm_up_fast_part(cfg, policy, out, control_dt, processes,
                                       lambda demos: warm_up_low_latency(policy, demos, max_delay + lead, steps_per_chunk,
                                                                         cfg.latency_warmup, cfg.seed))  # fmt: skip
    elif (policy.config.low_latency_rows, policy.config.low_latency_max_age) != (rows, max_age):
        raise ValueError(
            f"the checkpoint's low-latency part reads {policy.config.low_latency_rows} rows for ages up to "
            f"{policy.config.low_latency_max_age} steps; fine-tune it with --low_latency_rows="
            f"{policy.config.low_latency_rows} under the delays it was made for ({policy.config.low_latency_max_age} "
            f"steps of age)"
        )
    policy.requires_grad_(False)  # the slow policy stays as it is
    policy.low_latency.requires_grad_(True)
    return LowLatencyActor(policy), warmed


def privileged_width(cfg: FinetuneConfig, tasks: list[str], envs: list) -> int:
    """P of the asymmetric critic's ``observation.privileged`` (0 without ``--ppo.privileged_critic``): one
    width for every task of the run, or the run is refused (one critic reads them all)."""
    if not (cfg.algo == "ppo" and cfg.ppo.privileged_critic):
        return 0
    from vla_rl.rl.rollout import privileged_features

    widths = {task: privileged_features(env).shape[1] for task, env in zip(tasks, envs, strict=True)}
    if len(set(widths.values())) > 1:
        raise ValueError(
            f"--ppo.privileged_critic reads one privileged state for every task, but these differ in width "
            f"({', '.join(f'{t}: {w}' for t, w in widths.items())}); fine-tune them apart, or drop the flag"
        )
    return next(iter(widths.values()))


def trained_factors(train_last_steps: int, actor) -> slice:
    """The factors of each decision the actor loss covers: the last ``train_last_steps`` (0: all) of ``actor``'s.
    Refused for an actor whose factors are not ordered steps of one chain (a token sequence is padded to its
    budget, so its last factors are mostly padding)."""
    num_factors = actor.num_factors
    if train_last_steps and not getattr(actor, "factors_are_steps", True):
        raise ValueError(
            f"--train_last_steps={train_last_steps} keeps the last denoising steps of a chain; this policy's factors "
            f"are the tokens of a sequence: drop --train_last_steps"
        )
    if train_last_steps > num_factors:
        raise ValueError(
            f"--train_last_steps={train_last_steps} is more than the policy's {num_factors} denoising steps; "
            f"set it in [0, {num_factors}] (0 = all)"
        )
    return slice(num_factors - train_last_steps, num_factors) if train_last_steps else slice(None)


def _wire(cfg, tasks, env_cfgs, envs, out, accelerator, processes, policy, factors, policy_dir) -> tuple[_Run, Path]:
    """The run's delay streams, latency head, shells, learner and random streams, resumed or freshly seeded;
    returns it and the checkpoint it starts from (a warmed-up latency head's, when there is one)."""
    from vla_rl.rl import grpo, ppo
    from vla_rl.rl.curriculum import TaskCurriculum
    from vla_rl.rl.update import UpdateSettings

    # One stream of delays for every task, each process its own.
    delay = DelayModel(cfg.delay, control_dt=envs[0].control_dt, stream=processes.index)
    lead = cfg.chunking.lead_steps  # a chunk's actions start this much later: more delay, to the policy
    LatencySpec.of(policy).check_delay(delay.max_steps, lead_steps=lead)  # before a latency head is fitted to it
    torch.manual_seed(cfg.seed)  # the fast head's and the critic's initial weights: the same in every process
    policy_dir = make_latency_aware(cfg, policy, delay.max_steps + lead, out, envs[0].control_dt, processes) \
        or policy_dir  # fmt: skip
    steps_per_chunk = cfg.chunking.steps_per_chunk(policy.config.n_action_steps, policy.config.horizon)
    fast, warmed = make_low_latency(cfg, policy, delay.max_steps, lead, steps_per_chunk, out, envs[0].control_dt,
                                    processes)  # fmt: skip
    policy_dir = warmed or policy_dir
    spec = LatencySpec.of(policy)  # with its head, a latency-aware policy's mid observation
    step_policy = fast.step_policy if fast is not None else step_policy_of(policy)
    shells = [DelayedChunkEnv(env, spec, cfg.chunking, delay, use="finetune", step_policy=step_policy) for env in envs]
    width = shells[0].protocol.width  # the augmentation the rollouts carry, which the value features read
    actor = fast or policy.rl_actor(cfg.noise, augmentation_width=width)
    # Eval mode throughout (no dropout): sampling and the update then score decisions with the same network.
    policy.eval()
    settings = UpdateSettings(
        epochs=cfg.update_epochs, minibatch_size=cfg.minibatch_size, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        factors=factors, pcgrad=cfg.pcgrad, max_grad_norm=cfg.max_grad_norm, lr=cfg.lr, head_lr=cfg.latency_head_lr,
        generator=torch.Generator().manual_seed(cfg.seed), seed=cfg.seed,  # minibatch order, the same in every process
        rho_bar=cfg.ray.rho_bar,
    )  # fmt: skip
    if cfg.algo == "ppo":
        reference = None
        if cfg.ppo.kl_coef > 0:  # the imitation policy, frozen; resumed: the run's first checkpoint
            initial = (
                load_policy(
                    checkpointing.initial_checkpoint(out), device=policy.device, tokenizer_dir=cfg.tokenizer_dir
                )[0]
                if cfg.resume
                else policy
            )
            reference = copy.deepcopy(initial).eval().requires_grad_(False).rl_actor(cfg.noise, width)
        # The value head reads the episode's progress: step / the env's time limit (every backend has one).
        limit = max(int(getattr(env, "max_episode_steps", 0) or cfg.env.max_episode_steps or 1) for env in envs)
        learner = ppo.PPO(actor, cfg.ppo, settings, processes, reference, limit, privileged_width(cfg, tasks, envs))
    else:
        learner = grpo.GRPO(actor, cfg.grpo, settings, processes)
    curriculum = TaskCurriculum(tasks, seed=cfg.seed)
    streams = {"minibatches": settings.generator, "delays": delay.generator, "pcgrad": learner.actor_step.generator}
    state = {"iteration": 0, "env_steps": 0, "history": [], "evals": [],
             "skipped_actor_updates": 0, "skipped_critic_updates": 0}  # fmt: skip
    if cfg.resume:
        protocols = [shell.protocol for shell in shells]
        resumed = Path(policy_dir).parent  # the checkpoint dir: pretrained_model/ and training_state/
        state = checkpointing.load(
            resumed / TRAINING_STATE_DIR, learner, streams, protocols, delay, curriculum, processes
        )
        if accelerator.is_main_process:
            print(f"resumed from {resumed} at iteration {state['iteration']}", file=sys.stderr)
    else:  # sampling noise: each process its own stream
        torch.manual_seed(cfg.seed + processes.index)
        random.seed(cfg.seed + processes.index)
        np.random.seed(cfg.seed + processes.index)
    logging = cfg.log_with != "none"
    evaluation = PeriodicEvaluation(cfg, tasks, env_cfgs, out, policy.device, accelerator.log if logging else None)
    run = _Run(cfg, tasks, out, accelerator, processes, actor, learner, shells, delay, curriculum, streams, state,
               evaluation, logging)  # fmt: skip
    return run, policy_dir


def _train(run: _Run, rollouts) -> None:
    """Rollout -> update -> record -> evaluate -> checkpoint, until the iterations or the env-step budget are
    spent. A stop signal ends the run at an iteration boundary, with a checkpoint there."""
    cfg, state, main = run.cfg, run.state, run.accelerator.is_main_process
    by_steps = cfg.max_env_steps > 0  # with a budget, the bar counts env steps toward it
    bar = tqdm(
        total=cfg.max_env_steps if by_steps else cfg.iterations,
        initial=min(state["env_steps"], cfg.max_env_steps) if by_steps else state["iteration"],
        desc=f"finetune {cfg.algo}", unit="step" if by_steps else "it", disable=not main,
    )  # fmt: skip
    with interrupt.deferred():
        while not run.finished():
            it = state["iteration"]
            t_start = time.perf_counter()
            batch = rollouts.next(it)
            if run.process_reward is not None:  # dense rewards into the rollout, before the learner reads it
                batch.info.update(run.process_reward.shape(batch.rollout, run.processes))
            t_update = time.perf_counter()
            update_stats = {**run.learner.update(batch.rollout, it), **batch.info}
            rollouts.updated(run.actor)
            update_seconds = time.perf_counter() - t_update
            iteration_seconds = time.perf_counter() - t_start  # rollout (or the wait for one) and update
            env_steps = sum(st.env_steps for st in batch.stats)
            skipped = run.learner.skipped
            state.update(iteration=it + 1, env_steps=state["env_steps"] + env_steps,
                         skipped_actor_updates=skipped["actor"], skipped_critic_updates=skipped["critic"])  # fmt: skip
            checksums = None
            if run.processes.count > 1:
                modules = [run.actor.module] + ([run.learner.critic] if cfg.algo == "ppo" else [])
                checksums = checkpointing.check_in_sync(modules, run.processes)
            record = report.iteration_record(state, batch, update_seconds, iteration_seconds, update_stats, run.tasks,
                                             run.curriculum, checksums)  # fmt: skip
            state["history"].append(record)
            if run.logging:
                run.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=it + 1)
            bar.update(min(env_steps, max(0, cfg.max_env_steps - bar.n)) if by_steps else 1)
            bar.set_postfix(
                it=it + 1, success=f"{batch.success:.2f}", sps=f"{record['rollout_env_steps_per_s']:.0f}",
                loss=f"{update_stats.get('policy_loss', float('nan')):.3f}",
                **({"v_loss": f"{update_stats.get('value_loss', float('nan')):.3f}"} if cfg.algo == "ppo" else {}),
                **({"prm": f"{update_stats['process_reward_mean']:.3f}"} if run.process_reward is not None else {}),
            )  # fmt: skip
            evaluate_here = cfg.eval_every and (state["iteration"] % cfg.eval_every == 0 or run.finished())
            if evaluate_here and main:  # the weights it measured are saved just below, with its result
                run.evaluation(run.actor.policy, run.checkpoints / f"step-{state['iteration']:08d}", state)
            if evaluate_here or run.finished() or state["iteration"] % cfg.save_every == 0:
                run.save()
            interrupt.raise_if_stopped()
    bar.close()
