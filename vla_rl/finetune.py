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
rollout and update seconds per iteration, env-steps/s with the policy in the loop) and ``success.png``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from policies.denoising_chain import ExplorationNoise
from sim.config import EnvConfig
from vla_core import interrupt
from vla_core.files import write_text_atomic
from vla_core.runtime import ChunkingConfig, DelayConfig
from vla_core.types import TASK
from vla_rl.checkpoint import (
    TRAINING_STATE_DIR,
    begin_checkpoint,
    check_resume,
    commit_checkpoint,
    load_policy,
    write_policy,
)
from vla_rl.latency_warmup import LatencyWarmupConfig
from vla_rl.rl.grpo import GRPOConfig
from vla_rl.rl.ppo import PPOConfig
from vla_rl.rl.ray_runtime import RayConfig

Algo = Literal["ppo", "grpo"]
TRAINING_SEED_OFFSET = 1_000_000  # rollout seeds start here, far from every evaluation seed


@dataclass
class FinetuneConfig:
    """Fine-tune an imitation checkpoint with RL in the batched simulator."""

    checkpoint: str = "outputs/quickstart/train"  # imitation checkpoint (or training output dir: its last)
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
    mid_fraction: float = 0.5  # where in the inference window the mid-inference observation is taken, in [0, 1)
    latency_head_lr: float = 1e-4  # the fast head's learning rate (it starts at zero: the imitation policy)
    # Before RL, fit the fast head on demonstrations under the run's delays (`vla_rl.latency_warmup`);
    # steps=0 (default): RL starts it from zero.
    latency_warmup: LatencyWarmupConfig = field(default_factory=LatencyWarmupConfig)
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
        if self.chunking.merge != "latest":
            raise ValueError(
                f"--chunking.merge={self.chunking.merge} executes actions other than the sampled chunk, which its "
                f"log-probability does not describe; fine-tune with --chunking.merge=latest and evaluate other merges "
                f"with `vla-rl eval`"
            )
        self.chunking.validate()
        self.noise.validate()
        if self.noise.min_std <= 0:
            raise ValueError("--noise.min_std must be > 0: with no noise the chain has no log-probability")
        self.ppo.validate()
        if self.algo == "grpo":
            self.grpo.validate(self.env.num_envs)
        if self.iterations < 1 or self.update_epochs < 1 or self.minibatch_size < 1 or self.save_every < 1:
            raise ValueError("--iterations, --update_epochs, --minibatch_size and --save_every must be >= 1")
        if self.lr <= 0 or not 0 <= self.clip_low < 1 or self.clip_high < 0 or self.max_env_steps < 0:
            raise ValueError("--lr must be > 0, --clip_low in [0, 1), --clip_high and --max_env_steps >= 0")
        if self.eval_every < 0 or self.max_grad_norm < 0 or (self.eval_every and self.eval_episodes < 1):
            raise ValueError("--eval_every and --max_grad_norm must be >= 0, and --eval_episodes >= 1 when evaluating")
        if self.latency_aware and (not 0.0 <= self.mid_fraction < 1.0 or self.latency_head_lr <= 0):
            raise ValueError(
                f"--mid_fraction={self.mid_fraction} must be in [0, 1) (a point of the inference window, before "
                f"its end) and --latency_head_lr={self.latency_head_lr} > 0"
            )
        self.latency_warmup.validate()
        if self.latency_warmup.steps and not self.latency_aware:
            raise ValueError(
                "--latency_warmup.steps fits the fast head of a latency-aware run; add --latency_aware=true"
            )
        if self.runtime not in ("local", "ray"):
            raise ValueError(f"--runtime={self.runtime!r} is unknown; choose --runtime=local or --runtime=ray")
        if self.runtime == "ray":
            self.ray.validate()
            if len(self.task_list()) > 1:
                raise ValueError("--runtime=ray rolls out one task; drop --tasks or use --runtime=local")
        if self.train_last_steps < 0:
            raise ValueError(f"--train_last_steps={self.train_last_steps} must be >= 0 (0 = every denoising step)")


def check_policy_fits(policy, env, env_cfg: EnvConfig) -> None:
    """One line naming the fix when the checkpoint cannot act in this env or has no exact log-probs."""
    from policies import PreTrainedPolicy

    pcfg = policy.config
    if type(policy).log_prob is PreTrainedPolicy.log_prob:
        raise ValueError(
            f"the {pcfg.type!r} policy has no exact log-probabilities, which RL needs; fine-tune a diffusion or "
            f"diffusion_vla checkpoint (any objective)"
        )
    from policies.tokenizer import words

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


def finetune(cfg: FinetuneConfig) -> dict:
    from sim.factory import make_env
    from vla_core.runtime import DelayModel
    from vla_core.runtime.delayed_env import DelayedChunkEnv
    from vla_rl.rl import grpo, ppo
    from vla_rl.rl.curriculum import TaskCurriculum
    from vla_rl.rl.ray_runtime import AsyncRollouts
    from vla_rl.rl.rollout import Rollout, collect
    from vla_rl.rl.update import GradientStep, Processes, batched_log_prob
    from vla_rl.train import make_accelerator

    cfg.validate()
    if cfg.runtime == "ray" and cfg.ray.address:  # one line naming the fix, before anything starts
        from vla_rl.rl.ray_runtime import check_reachable

        check_reachable(cfg.ray.address)
    torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
    out = Path(cfg.output_dir)
    ckpt_dir = out / "checkpoints"
    source = check_resume(ckpt_dir, cfg.resume) or cfg.checkpoint
    trackers = [] if cfg.log_with == "none" else [cfg.log_with]
    # Under `accelerate launch` there are several processes, each with its own worlds (see Processes),
    # each on the device the launcher gives it; a single process runs on --device.
    accelerator = make_accelerator(trackers, out)
    processes = Processes(accelerator)
    if cfg.runtime == "ray" and processes.count > 1:
        raise ValueError(
            "--runtime=ray has one learner and its workers are the parallel part; run it without accelerate launch"
        )
    main = accelerator.is_main_process
    device = accelerator.device if processes.count > 1 else cfg.device
    policy, policy_dir = load_policy(source, device=device)
    pcfg = policy.config
    denoising = pcfg.num_inference_steps
    if cfg.train_last_steps > denoising:
        raise ValueError(
            f"--train_last_steps={cfg.train_last_steps} is more than the policy's {denoising} denoising steps; "
            f"set it in [0, {denoising}] (0 = all)"
        )
    trained = slice(denoising - cfg.train_last_steps, denoising) if cfg.train_last_steps else slice(None)
    execute_steps = cfg.chunking.steps_per_chunk(pcfg.n_action_steps, pcfg.horizon)
    tasks = cfg.task_list()
    env_cfgs = [replace(cfg.env, task=task) for task in tasks]

    with contextlib.ExitStack() as closing:
        envs = [closing.enter_context(make_env(env_cfg)) for env_cfg in env_cfgs]
        for env, env_cfg in zip(envs, env_cfgs, strict=True):
            check_policy_fits(policy, env, env_cfg)
        delay = DelayModel(cfg.delay, control_dt=envs[0].control_dt)  # one stream of delays for every task
        delay.check_fits(pcfg.horizon, pcfg.max_delay_steps)
        delay.generator.manual_seed(cfg.delay.seed + processes.index)  # each process its own delays
        gamma = cfg.ppo.gamma if cfg.algo == "ppo" else 1.0
        torch.manual_seed(cfg.seed)  # the fast head's and the critic's initial weights: the same in every process
        if cfg.resume and cfg.latency_aware and not pcfg.latency_aware:
            raise ValueError(
                f"the run in {out} is not latency-aware; resume it without --latency_aware, or start the "
                f"latency-aware run in a new --output_dir"
            )
        if cfg.latency_aware and not pcfg.latency_aware:  # a resumed run's checkpoint has its head already
            policy.add_latency_head(delay.max_steps, cfg.mid_fraction, list(cfg.env.cameras))
            if cfg.latency_warmup.steps:  # the run then starts from the warmed policy, saved in the run
                policy_dir = _warm_up_head(cfg, policy, out, envs[0].control_dt, processes)
        delayed = [
            DelayedChunkEnv.for_policy(
                env, pcfg, execute_steps, delay, gamma=gamma
            )  # with the mid observation if aware
            for env in envs
        ]
        # The value head reads the episode's progress: step / the env's time limit (every backend has one).
        max_episode_steps = max(
            int(getattr(env, "max_episode_steps", 0) or cfg.env.max_episode_steps or 1) for env in envs
        )

        # Eval mode throughout (no dropout): sampling and the update then score chains with the same network.
        policy.eval()
        # The fast head starts from zero (or from its warm-up), so it gets its own, larger learning rate.
        head = [p for name, p in policy.named_parameters() if name.startswith("latency_head.") and p.requires_grad]
        rest = [p for name, p in policy.named_parameters() if not name.startswith("latency_head.") and p.requires_grad]
        groups = [{"params": rest, "lr": cfg.lr}] + ([{"params": head, "lr": cfg.latency_head_lr}] if head else [])
        actor_opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
        actor_step = GradientStep(actor_opt, cfg.max_grad_norm, seed=cfg.seed, processes=processes)
        critic = critic_opt = critic_step = None
        if cfg.algo == "ppo":
            critic = ppo.ValueHead(policy.condition_dim, cfg.ppo.critic_hidden).to(device)
            critic_opt = torch.optim.Adam(critic.parameters(), lr=cfg.ppo.critic_lr)
            critic_step = GradientStep(critic_opt, cfg.max_grad_norm, processes=processes)
        reference = None
        if cfg.algo == "ppo" and cfg.ppo.kl_coef > 0:  # the imitation policy, frozen
            # Resumed: loaded from the run's first checkpoint, before the random streams are restored.
            initial = load_policy(_initial_checkpoint(out), device=device)[0] if cfg.resume else policy
            reference = copy.deepcopy(initial).eval().requires_grad_(False)
        curriculum = TaskCurriculum(tasks, seed=cfg.seed)
        generator = torch.Generator().manual_seed(cfg.seed)  # minibatch order, the same in every process
        state = {"iteration": 0, "env_steps": 0, "history": [], "evals": [],
                 "skipped_actor_updates": 0, "skipped_critic_updates": 0}  # fmt: skip
        streams = {"minibatches": generator, "delays": delay.generator, "pcgrad": actor_step.generator}
        schedules = [d.schedule for d in delayed]  # their measured lags carry over from one rollout to the next
        if cfg.resume:
            state = _load_training_state(
                source / TRAINING_STATE_DIR,
                actor_opt,
                critic,
                critic_opt,
                streams,
                curriculum,
                processes,
                schedules,
            )
            actor_step.skipped = state["skipped_actor_updates"]
            if critic_step is not None:
                critic_step.skipped = state["skipped_critic_updates"]
            if main:
                print(f"resumed from {policy_dir.parent} at iteration {state['iteration']}", file=sys.stderr)
        else:  # sampling noise: each process its own stream
            torch.manual_seed(cfg.seed + processes.index)
            random.seed(cfg.seed + processes.index)
            np.random.seed(cfg.seed + processes.index)

        if trackers:
            accelerator.init_trackers("finetune", config={"algo": cfg.algo, "lr": cfg.lr, "tasks": ",".join(tasks)})
        if main:
            out.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out / "finetune_config.json", json.dumps(asdict(cfg), indent=2))
            if not cfg.resume:
                write_text_atomic(out / "initial_checkpoint.txt", str(policy_dir))

        def evaluate_now(checkpoint: Path) -> None:
            """`vla-rl eval`'s own code on the policy as it is now, every task (``checkpoint``: where it is saved)."""
            from vla_rl.eval import EvalConfig, evaluate, wilson_interval

            # Evaluation seeds torch (and CUDA); the training streams go on untouched.
            rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
            by_task = {}
            for task, env_cfg in zip(tasks, env_cfgs, strict=True):
                folder = out / "eval" / f"iter-{state['iteration']:04d}"
                result = evaluate(
                    EvalConfig(
                        checkpoint=str(checkpoint),
                        env=replace(env_cfg, num_envs=min(env_cfg.num_envs * 2, cfg.eval_episodes)),
                        num_episodes=cfg.eval_episodes,
                        seed=cfg.eval_seed,
                        chunking=cfg.chunking,
                        delay=cfg.delay,
                        video_episodes=0,
                        device=str(device),
                        output_dir=str(folder / task if len(tasks) > 1 else folder),
                    ),
                    policy=policy,
                )
                by_task[task] = {k: result[k] for k in ("episodes", "successes", "success_rate", "success_ci95")}
            torch.set_rng_state(rng)
            if cuda_rng:
                torch.cuda.set_rng_state_all(cuda_rng)
            successes = sum(r["successes"] for r in by_task.values())
            episodes = sum(r["episodes"] for r in by_task.values())
            entry = {"iteration": state["iteration"], "env_steps": state["env_steps"],
                     "success_rate": successes / episodes, "success_ci95": list(wilson_interval(successes, episodes)),
                     "episodes": episodes}  # fmt: skip
            if len(tasks) > 1:
                entry["by_task"] = by_task
            state["evals"].append(entry)
            if trackers:
                accelerator.log({"eval/success_rate": entry["success_rate"]}, step=state["iteration"])

        def finished() -> bool:
            budget_spent = cfg.max_env_steps > 0 and state["env_steps"] >= cfg.max_env_steps
            return state["iteration"] >= cfg.iterations or budget_spent

        if not cfg.resume and cfg.eval_every and main:
            evaluate_now(policy_dir)
        start = time.time()
        by_steps = cfg.max_env_steps > 0  # with a budget, the bar counts env steps toward it
        bar = tqdm(
            total=cfg.max_env_steps if by_steps else cfg.iterations,
            initial=min(state["env_steps"], cfg.max_env_steps) if by_steps else state["iteration"],
            desc=f"finetune {cfg.algo}", unit="step" if by_steps else "it", disable=not main,
        )  # fmt: skip

        def collect_local(it: int):
            """This iteration's rollouts in this process, and the union of every process's: (rollout,
            stats, rollout seconds, the tasks rolled out, every process's (rollout, stats))."""
            chosen = curriculum.choose(cfg.curriculum_tasks or len(tasks))
            parts, stats = [], []
            for t in chosen:
                # Distinct seeds for every (iteration, task), from TRAINING_SEED_OFFSET up.
                run = (it * processes.count + processes.index) * len(tasks) + t  # every process its own
                seed_base = cfg.seed + TRAINING_SEED_OFFSET + run * cfg.env.num_envs
                if cfg.algo == "grpo":
                    seed, episodes = grpo.group_seeds(cfg.env.num_envs, cfg.grpo.group_size, seed_base), 1
                else:
                    seed, episodes = seed_base, cfg.ppo.episodes_per_world
                part, part_stats = collect(
                    policy, delayed[t], cfg.noise, episodes_per_world=episodes, seed=seed, task=t
                )
                parts.append(part)
                stats.append(part_stats)
            local = Rollout.cat(parts, cfg.env.num_envs)
            rollout_seconds = sum(st.seconds for st in stats)
            # Every process updates on the union of all processes' rollouts (each on its shard).
            everyone = processes.gather((local, stats))
            rollout = Rollout.cat([r for r, _ in everyone], len(tasks) * cfg.env.num_envs)
            stats = [st for _, process_stats in everyone for st in process_stats]
            for i, t in enumerate(chosen):  # the same update in every process: the union's success
                task_stats = [process_stats[i] for _, process_stats in everyone]
                episodes_t = sum(st.episodes for st in task_stats)
                curriculum.update(t, sum(st.successes for st in task_stats) / max(1, episodes_t))
            return rollout, stats, rollout_seconds, chosen, everyone

        rollouts_async = None
        if cfg.runtime == "ray":

            def ray_seeds(launch: int):
                # Launch k of a run started (or resumed) at iteration i: reset seeds from
                # TRAINING_SEED_OFFSET + (i * 10_000 + k) * num_envs, never an evaluation seed; the
                # sampling noise's seed from the run's seed, i and k.
                index = first_iteration * 10_000 + launch
                seed_base = cfg.seed + TRAINING_SEED_OFFSET + index * cfg.env.num_envs
                sampling = cfg.seed * 1_000_003 + index
                if cfg.algo == "grpo":
                    return grpo.group_seeds(cfg.env.num_envs, cfg.grpo.group_size, seed_base), 1, sampling
                return seed_base, cfg.ppo.episodes_per_world, sampling

            first_iteration = state["iteration"]
            rollouts_async = AsyncRollouts(policy, cfg, execute_steps, gamma, version=first_iteration, seeds=ray_seeds)
            closing.callback(rollouts_async.close)

        with interrupt.deferred():
            while not finished():
                it = state["iteration"]
                if rollouts_async is not None:
                    t_wait = time.perf_counter()
                    rollout, stats, ray_info = rollouts_async.next_batch()
                    rollout_seconds = time.perf_counter() - t_wait  # the learner's wait: collection overlaps updates
                    chosen, everyone = [0], [(rollout, stats)]
                    curriculum.update(0, sum(st.successes for st in stats) / max(1, sum(st.episodes for st in stats)))
                else:
                    rollout, stats, rollout_seconds, chosen, everyone = collect_local(it)
                t_update = time.perf_counter()
                behaviour = rollout.behaviour_log_prob  # recorded by asynchronous workers: their own weights'
                if behaviour is None:
                    behaviour = batched_log_prob(policy, rollout.obs, rollout.chain, cfg.minibatch_size)
                old_log_prob = behaviour[:, trained]
                shared = {
                    "epochs": cfg.update_epochs, "minibatch_size": cfg.minibatch_size, "clip_low": cfg.clip_low,
                    "clip_high": cfg.clip_high, "generator": generator, "actor_step": actor_step, "pcgrad": cfg.pcgrad,
                    "denoising_steps": trained,
                }  # fmt: skip
                if cfg.algo == "ppo":
                    reference_log_prob = (
                        batched_log_prob(reference, rollout.obs, rollout.chain, cfg.minibatch_size)[:, trained]
                        if reference is not None else None
                    )  # fmt: skip
                    ustats = ppo.update(
                        policy, critic, rollout, old_log_prob, reference_log_prob, cfg=cfg.ppo, processes=processes,
                        critic_step=critic_step, train_actor=it >= cfg.ppo.critic_warmup_iterations,
                        max_episode_steps=max_episode_steps, **shared,
                    )  # fmt: skip
                else:
                    ustats = grpo.update(policy, rollout, old_log_prob, cfg=cfg.grpo, processes=processes, **shared)
                if rollouts_async is not None:
                    rollouts_async.publish(policy)
                    ustats = {**ustats, **ray_info}
                update_seconds = time.perf_counter() - t_update
                env_steps = sum(st.env_steps for st in stats)
                episodes_done = sum(st.episodes for st in stats)
                success = sum(st.successes for st in stats) / max(1, episodes_done)
                state["iteration"] = it + 1
                state["env_steps"] += env_steps
                state["skipped_actor_updates"] = actor_step.skipped
                state["skipped_critic_updates"] = critic_step.skipped if critic_step is not None else 0
                record = {
                    "iteration": it + 1, "env_steps": state["env_steps"], "rollout_success": success,
                    "episodes": episodes_done, "diverged_episodes": sum(st.diverged for st in stats),
                    "rollout_seconds": round(rollout_seconds, 3), "update_seconds": round(update_seconds, 3),
                    "rollout_env_steps_per_s": round(sum(st.simulated_steps for st in stats) / max(rollout_seconds, 1e-9), 1),
                    "skipped_updates": state["skipped_actor_updates"] + state["skipped_critic_updates"],
                    **{k: _round(v) for k, v in ustats.items()},
                }  # fmt: skip
                if processes.count > 1:
                    record["decisions_per_process"] = [len(r) for r, _ in everyone]
                    record["weights_checksum_per_process"] = _check_in_sync(policy, critic, processes)
                if len(tasks) > 1:
                    record["rollout_success_by_task"] = {
                        tasks[t]: sum(ps[i].successes for _, ps in everyone)
                        / max(1, sum(ps[i].episodes for _, ps in everyone))
                        for i, t in enumerate(chosen)
                    }
                    record["curriculum_priorities"] = dict(
                        zip(tasks, [round(p, 4) for p in curriculum.priorities().tolist()], strict=True)
                    )
                state["history"].append(record)
                if trackers:
                    accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=it + 1)
                bar.update(min(env_steps, max(0, cfg.max_env_steps - bar.n)) if by_steps else 1)
                bar.set_postfix(
                    it=it + 1, success=f"{success:.2f}", sps=f"{record['rollout_env_steps_per_s']:.0f}",
                    loss=f"{ustats.get('policy_loss', float('nan')):.3f}",
                    **({"v_loss": f"{ustats.get('value_loss', float('nan')):.3f}"} if cfg.algo == "ppo" else {}),
                )  # fmt: skip
                evaluate_here = cfg.eval_every and (state["iteration"] % cfg.eval_every == 0 or finished())
                if evaluate_here and main:  # the weights it measured are saved just below, with its result
                    evaluate_now(ckpt_dir / f"step-{state['iteration']:08d}")
                if evaluate_here or finished() or state["iteration"] % cfg.save_every == 0:
                    _save(ckpt_dir, policy, critic, actor_opt, critic_opt, streams, schedules, curriculum, state, cfg,
                          processes)  # fmt: skip
                interrupt.raise_if_stopped()
        bar.close()
    if trackers:
        accelerator.end_training()
    summary = _summary(cfg, tasks, state, time.time() - start)
    if main:
        write_text_atomic(out / "finetune_summary.json", json.dumps(summary, indent=2))
        _plot_success(state, out / "success.png", cfg.algo)
    return summary


def _round(v):
    return round(v, 6) if isinstance(v, float) else v


def _warm_up_head(cfg: FinetuneConfig, policy, out: Path, control_dt: float, processes) -> Path:
    """Fit the fresh fast head on ``cfg.latency_warmup.dataset`` (`vla_rl.latency_warmup`) in the main
    process, saved as ``out/latency_warmup`` (an evaluable checkpoint, the run's starting point and its
    KL reference); the other processes then load it, so every process starts from the same weights
    whatever its device does. Returns that checkpoint's directory."""
    from vla_core.data import ChunkedDemos, open_dataset
    from vla_rl.checkpoint import save_checkpoint
    from vla_rl.latency_warmup import warm_up_latency_head

    warm, saved = cfg.latency_warmup, (out / "latency_warmup").resolve()
    dataset = open_dataset(warm.dataset)  # every process checks, so none waits on a refused run
    if abs(dataset.meta.fps * control_dt - 1.0) > 1e-6:
        raise ValueError(
            f"--latency_warmup.dataset={warm.dataset} was recorded at {dataset.meta.fps} fps but the env steps every "
            f"{control_dt} s, so its delays would be counted in other steps; record the dataset at the env's rate"
        )
    if processes.index == 0:
        demos = ChunkedDemos(dataset, list(policy.config.cameras))
        losses = warm_up_latency_head(policy, demos, cfg.delay, control_dt, warm, cfg.seed)
        window = max(1, len(losses) // 10)
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        meta = {"latency_warmup": {**asdict(warm), "first_loss": round(first, 6), "last_loss": round(last, 6),
                                   "from": cfg.checkpoint}}  # fmt: skip
        save_checkpoint(saved, warm.steps, policy, meta, keep_last=1)
        print(f"fast head fitted on {warm.dataset}: denoising loss {first:.4f} -> {last:.4f} over {warm.steps} "
              f"steps (first and last tenth)", file=sys.stderr)  # fmt: skip
    if processes.count > 1:
        processes.accelerator.wait_for_everyone()
        if processes.index != 0:
            policy.load_state_dict(load_policy(saved, device=policy.device)[0].state_dict())
    return saved


def _initial_checkpoint(out: Path) -> str:
    return (out / "initial_checkpoint.txt").read_text().strip()


def _check_in_sync(policy, critic, processes) -> list[float]:
    """Every process's checksum of its weights; a data-parallel run whose processes disagree stops."""
    modules = [policy] + ([critic] if critic is not None else [])
    checksum = float(sum(p.detach().double().abs().sum() for m in modules for p in m.parameters()))
    sums = processes.gather(checksum)
    if len(set(sums)) > 1:
        raise RuntimeError(f"the data-parallel processes' weights differ after an update (checksums {sums}); a bug")
    return sums


def _random_state(streams: dict, schedules: list) -> dict:
    """This process's random streams (torch's, CUDA's, numpy's, Python's and the run's generators) and
    the lags its schedules measured (the ``measured`` delay estimate reads them)."""
    return {
        "streams": {name: g.get_state() for name, g in streams.items()},
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "lags": [schedule.lags.cpu() for schedule in schedules],
    }


def _save(
    ckpt_dir, policy, critic, actor_opt, critic_opt, streams, schedules, curriculum, state, cfg, processes
) -> Path | None:
    """Checkpoint ``step-<iteration>``: the policy (as eval and serve load it) + what --resume needs,
    with every process's random streams. Written by the main process; every process takes part."""
    random_states = processes.gather(_random_state(streams, schedules))
    if processes.index != 0:
        if processes.accelerator is not None:
            processes.accelerator.wait_for_everyone()
        return None
    iteration = state["iteration"]
    tmp = begin_checkpoint(ckpt_dir, iteration)
    write_policy(tmp, policy, {"step": iteration, "finetune": {"algo": cfg.algo, "env_steps": state["env_steps"]}})
    training = tmp / TRAINING_STATE_DIR
    training.mkdir()
    torch.save(
        {
            "state": state,
            "actor_optimizer": actor_opt.state_dict(),
            "critic": critic.state_dict() if critic is not None else None,
            "critic_optimizer": critic_opt.state_dict() if critic_opt is not None else None,
            "curriculum": curriculum.state_dict(),
            "processes": random_states,
        },
        training / "finetune_state.pt",
    )
    path = commit_checkpoint(ckpt_dir, tmp, iteration)
    if processes.accelerator is not None:
        processes.accelerator.wait_for_everyone()
    return path


def _load_training_state(
    directory: Path, actor_opt, critic, critic_opt, streams, curriculum, processes, schedules
) -> dict:
    saved = torch.load(directory / "finetune_state.pt", weights_only=False)
    actor_opt.load_state_dict(saved["actor_optimizer"])
    if critic is not None:
        if saved["critic"] is None:
            raise ValueError(f"{directory} is a GRPO run (no critic); resume it with --algo=grpo")
        critic.load_state_dict(saved["critic"])
        critic_opt.load_state_dict(saved["critic_optimizer"])
    curriculum.load_state_dict(saved["curriculum"])
    if len(saved["processes"]) != processes.count:
        raise ValueError(
            f"{directory} was written by {len(saved['processes'])} processes; resume it with as many "
            f"(accelerate launch --num_processes={len(saved['processes'])})"
        )
    mine = saved["processes"][processes.index]
    for name, g in streams.items():
        g.set_state(mine["streams"][name])
    torch.set_rng_state(mine["torch_rng"])
    if mine["cuda_rng"]:
        torch.cuda.set_rng_state_all(mine["cuda_rng"])
    for schedule, lags in zip(schedules, mine["lags"], strict=True):
        schedule.lags = lags.to(schedule.lags.device)
    np.random.set_state(mine["numpy_rng"])
    random.setstate(mine["python_rng"])
    return saved["state"]


def _summary(cfg: FinetuneConfig, tasks: list[str], state: dict, seconds: float) -> dict:
    history = state["history"]
    rollout_s = sum(h["rollout_seconds"] for h in history)
    sim_steps = sum(h["rollout_env_steps_per_s"] * h["rollout_seconds"] for h in history)
    evals = state["evals"]
    return {
        "algo": cfg.algo,
        "tasks": tasks,
        "iterations": state["iteration"],
        "env_steps": state["env_steps"],
        "skipped_updates": {"actor": state["skipped_actor_updates"], "critic": state["skipped_critic_updates"]},
        "initial_success": evals[0]["success_rate"] if evals else None,
        "final_success": evals[-1]["success_rate"] if evals else None,
        "evals": evals,
        "rollout_seconds": round(rollout_s, 1),
        "update_seconds": round(sum(h["update_seconds"] for h in history), 1),
        "rollout_env_steps_per_s": round(sim_steps / max(rollout_s, 1e-9), 1),
        "seconds_since_start_or_resume": round(seconds, 1),
        "history": history,
        "config": asdict(cfg),
    }


def _plot_success(state: dict, path: Path, algo: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    history = state["history"]
    if history:
        ax.plot([h["env_steps"] for h in history], [h["rollout_success"] for h in history], ".-", alpha=0.6,
                label="rollouts (with exploration noise)")  # fmt: skip
    if state["evals"]:
        ev = state["evals"]
        x = [e["env_steps"] for e in ev]
        y = [e["success_rate"] for e in ev]
        lo = [e["success_rate"] - e["success_ci95"][0] for e in ev]
        hi = [e["success_ci95"][1] - e["success_rate"] for e in ev]
        label = "evaluation, all tasks" if "by_task" in ev[0] else "evaluation"
        ax.errorbar(x, y, yerr=[lo, hi], fmt="o-", capsize=3, label=f"{label} (95% Wilson interval)")
        for task in ev[0].get("by_task", {}):
            ax.plot(x, [e["by_task"][task]["success_rate"] for e in ev], "--", label=f"evaluation, {task}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"vla-rl finetune --algo={algo}")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
