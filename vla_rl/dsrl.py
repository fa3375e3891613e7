"""`vla-rl dsrl`: DSRL, steering a frozen flow policy through the initial noise of the rows that run, as its
authors run it (DSRL-NA; `vla_rl.rl.sac` holds the method). One agent per setting (``env.variation``). Each
iteration rolls the agent out through the rollout PPO and GRPO use (`vla_rl.rl.rollout.collect`, the latency model
included; the first iterations with the base's own noise until the buffer holds ``sac.warmup_transitions``), adds
its transitions to the replay buffer and takes ``sac.utd`` gradient steps per new transition. It stops after
``iterations`` or once the rollouts used ``max_env_steps`` control steps. At the end the frozen policy and the
policy driven by the actor's deterministic noise are evaluated on the same held-out initial states (`vla-rl eval`'s
stage), and ``dsrl/`` (the encoder and the actor, config.json) and ``dsrl_summary.json`` are written atomically.

Every ``checkpoint_every`` iterations, and at a stop signal, ``dsrl_state.pt`` keeps what resuming needs: the
agent (encoder, critics, their targets, the actor, the temperature, the optimizers), the replay buffer, the
history and torch's random stream, and the setting's delay stream and measured lags. The same command resumes from
it to the result a run never stopped reaches (the rollouts reset from per-iteration seeds), and may extend it with
more ``iterations``; a state written with other training settings, or by the earlier `vla-rl dsrl`, is refused. It
holds the replay buffer's whole storage: the images as uint8 (a 64 x 64 camera: 24 KB a transition with its next
observation).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from sim.config import EXECUTION_FIELDS, EnvConfig, outcome_fields
from vla_core import interrupt
from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
from vla_rl.checkpoint import load_policy
from vla_rl.config_json import chunking_made_with
from vla_rl.eval_record import weights_sha256
from vla_rl.rl.sac import NoiseAgent, SACConfig, transitions
from vla_rl.steering import WrappedPolicy, check_steerable


@dataclass
class DSRLConfig:
    """DSRL: soft actor-critic over the initial noise of a frozen flow policy, in the batched sim."""

    checkpoint: str = "outputs/quickstart/train"  # the frozen flow policy
    env: EnvConfig = field(default_factory=lambda: EnvConfig(num_envs=16))  # the task, its variation, worlds
    iterations: int = 30  # at most; see max_env_steps
    max_env_steps: int = 50_000  # stop once the rollouts used this many control steps (0 = no budget)
    episodes_per_world: int = 1  # whole episodes each world runs per iteration
    seed: int = 8000  # rollouts reset from seed + 1,000,000 + iteration (never an evaluation seed)
    eval_episodes: int = 100  # held-out episodes per arm at the end (frozen, DSRL), on eval_seed's states
    eval_seed: int = 5000
    sac: SACConfig = field(default_factory=SACConfig)
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)
    device: str = "cpu"
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    checkpoint_every: int = 5  # iterations between saves of dsrl_state.pt (a stop signal saves too)
    output_dir: str = "outputs/dsrl"  # dsrl/, dsrl_summary.json, eval_base/, eval_dsrl/, dsrl_state.pt


class NoisePolicy(WrappedPolicy):
    """The frozen policy driven by the DSRL actor's deterministic noise: what evaluation runs."""

    def __init__(self, agent: NoiseAgent):
        super().__init__()
        self.base, self.actor = agent.policy, agent.actor_net
        self._agent = agent

    def predict_chunk(self, obs, obs_step=None, **kwargs):
        kwargs.pop("noise", None)  # the actor chooses it
        return self.base.predict_chunk(obs, obs_step, noise=self._agent.deterministic_noise(obs), **kwargs)


def run_dsrl(cfg: DSRLConfig) -> dict[str, Any]:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from sim.factory import make_env
    from vla_core.runtime.delayed_env import DelayedChunkEnv, step_policy_of
    from vla_rl.rl.rollout import collect
    from vla_rl.stages import EvalConfig, evaluate

    if cfg.checkpoint_every < 1:
        raise ValueError(f"checkpoint_every={cfg.checkpoint_every}: pass --checkpoint_every=1 or more (iterations)")
    if (cfg.delay.kind, cfg.delay.steps) != ("fixed", 0):
        raise ValueError("DSRL steers the noise of the rows that run at zero delay: run it without --delay")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy, _ = load_policy(cfg.checkpoint, device=cfg.device)
    policy.eval()
    check_steerable(policy)
    torch.manual_seed(cfg.seed)
    agent = NoiseAgent(policy, cfg.sac, cfg.chunking.execute_steps or policy.config.n_action_steps)
    replay = ReplayBuffer(storage=LazyTensorStorage(cfg.sac.buffer_size), batch_size=cfg.sac.batch_size)
    start = time.time()
    state_file = out / STATE_FILE
    # What a resumed run must share with the saved one; the evaluation, the folder, the iteration count and the
    # budget may change (a run can be extended: every iteration's rollouts reset from their own seed).
    free = ("num_threads", "checkpoint_every", "iterations", "max_env_steps", "eval_episodes", "eval_seed",
            "output_dir")  # fmt: skip
    made_with = {k: v for k, v in asdict(cfg).items() if k not in free}
    made_with["env"] = outcome_fields(cfg.env)  # its threads and renderers may change too
    made_with["chunking"] = chunking_made_with(cfg.chunking, [cfg.env.task])
    made_with["base_sha256"] = weights_sha256(policy)
    made_with["version"] = VERSION
    with make_env(cfg.env) as env:
        shell = DelayedChunkEnv(env, LatencySpec.of(policy), cfg.chunking, DelayModel(cfg.delay, env.control_dt),
                                use="finetune", step_policy=step_policy_of(policy))  # fmt: skip
        history = load_state(state_file, agent, replay, shell, made_with) if state_file.exists() else []
        with interrupt.deferred():  # a stop signal ends the run after an iteration, its state saved
            # The bar counts control steps against the budget (iterations when there is none): an iteration's
            # steps vary with its episodes' lengths, and the iteration cap is usually far above the budget.
            spent = sum(h["env_steps"] for h in history)
            by_steps = bool(cfg.max_env_steps)
            bar = tqdm(desc="dsrl", unit="step" if by_steps else "it", initial=spent if by_steps else len(history),
                       total=cfg.max_env_steps if by_steps else cfg.iterations)  # fmt: skip
            for it in range(len(history), cfg.iterations):
                if by_steps and spent >= cfg.max_env_steps:
                    break
                agent.warming_up = len(replay) < cfg.sac.warmup_transitions
                rollout, stats = collect(agent, shell, episodes_per_world=cfg.episodes_per_world,
                                         seed=cfg.seed + 1_000_000 + it, gamma=cfg.sac.gamma)  # fmt: skip
                kept = transitions(rollout, agent.rows)
                new = len(kept["reward"])
                if new:  # none where the time limit cut every episode after its first decision
                    replay.extend(TensorDict(kept, batch_size=[new]))
                updates = round(cfg.sac.utd * new) if len(replay) >= cfg.sac.warmup_transitions else 0
                losses: dict[str, float] = {}
                for _ in range(updates):
                    for key, value in agent.update(as_batch(replay.sample().to(agent.device))).items():
                        losses[key] = losses.get(key, 0.0) + value / updates
                history.append({"iteration": it, "warmup": agent.warming_up,
                                "success_rate": round(stats.success_rate, 4), "episodes": stats.episodes,
                                "env_steps": stats.env_steps, "buffer": len(replay), "updates": updates,
                                "truncated_left_out": int(rollout.truncated.sum()),
                                **{k: round(v, 5) for k, v in losses.items()}})  # fmt: skip
                spent += stats.env_steps
                bar.update(stats.env_steps if by_steps else 1)
                bar.set_postfix(success=history[-1]["success_rate"], buffer=len(replay))
                if interrupt.received() is not None or (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
                    save_state(state_file, agent, replay, shell, history, made_with)
                interrupt.raise_if_stopped()
            bar.close()
        save_state(state_file, agent, replay, shell, history, made_with)
    save_agent(out / "dsrl", agent, cfg)
    arms = {}
    for name, arm in (("base", policy), ("dsrl", NoisePolicy(agent))):
        arms[name] = evaluate(EvalConfig(checkpoint=cfg.checkpoint, env=cfg.env, num_episodes=cfg.eval_episodes,
                                         seed=cfg.eval_seed, chunking=cfg.chunking, delay=cfg.delay, video_episodes=0,
                                         output_dir=str(out / f"eval_{name}"), overwrite=True), policy=arm)  # fmt: skip
    rates = {name: {"success_rate": r["success_rate"], "ci95": r["success_ci95"]} for name, r in arms.items()}
    summary = {"config": asdict(cfg), "history": history, "eval": rates,
               "env_steps": sum(h["env_steps"] for h in history),
               "gain_points": round(100 * (rates["dsrl"]["success_rate"] - rates["base"]["success_rate"]), 1),
               "seconds": round(time.time() - start, 1)}  # fmt: skip
    tmp = out / "dsrl_summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "dsrl_summary.json")
    return summary


def as_batch(sample) -> dict[str, Any]:
    """A replay sample (a TensorDict) as the dict `NoiseAgent.update` takes: its observations as plain dicts."""
    keys = sample.keys()  # not ``for k in sample``: a TensorDict iterates over its rows
    return {k: dict(sample[k].items()) if k in ("obs", "next_obs") else sample[k] for k in keys}


VERSION = 2  # of a run's state and its saved agent: 2 = DSRL-NA on the rows that run (1: SAC on the whole noise)
STATE_FILE = "dsrl_state.pt"


def save_state(path: Path, agent: NoiseAgent, replay, shell, history: list[dict], made_with: dict) -> None:
    """What resuming needs (module docstring), and the shell's delay stream and measured lags (the measured delay
    estimate reads them across episodes), written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"made_with": made_with, "history": history, "agent": agent.state_dict(),
                "task": agent.task, "replay_rows": filled_rows(replay), "replay_writer": replay._writer.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "delay": shell.delay.state_dict(), "lags": shell.protocol.saved_lags()}, tmp)  # fmt: skip
    tmp.replace(path)


def filled_rows(replay):
    """The replay buffer's filled rows in its storage's order (a TensorDict; None when empty). torchrl's own
    state_dict holds the whole preallocated storage: gigabytes of images for a buffer a few percent full."""
    # a copy: the slice is a view, and torch.save writes a view's whole underlying storage
    return replay.storage[: len(replay)].clone() if len(replay) else None


def load_state(path: Path, agent: NoiseAgent, replay, shell, made_with: dict) -> list[dict]:
    """Restore a saved run into ``agent``, ``replay``, the shell (delay stream, lags) and torch's stream; returns
    its history (one entry per iteration done). Refused, naming the setting, when it was written with other
    settings or by the earlier `vla-rl dsrl`."""
    saved = torch.load(path, weights_only=False)  # our own file: it holds the replay buffer's TensorDicts
    for name, value in made_with.items():
        was = saved["made_with"].get(name)
        if name == "env" and isinstance(was, dict):  # files written before outcome_fields kept every field
            was = {k: v for k, v in was.items() if k not in EXECUTION_FIELDS}
        if json.loads(json.dumps(was)) != json.loads(json.dumps(value)):
            raise ValueError(f"{path} was written by a run with another {name} ({was!r} "
                             f"against {value!r}): pass another --output_dir, or delete it to start again")  # fmt: skip
    agent.load_state_dict(saved["agent"])
    agent.task = saved["task"]
    if "replay" in saved:  # written before 2026-12-07: torchrl's own state, the whole preallocated storage
        replay.load_state_dict(saved["replay"])
    else:  # the filled rows, in the storage's order, then the writer's cursor (where a full buffer writes next)
        if saved["replay_rows"] is not None:
            replay.extend(saved["replay_rows"])
        replay._writer.load_state_dict(saved["replay_writer"])
    torch.set_rng_state(saved["torch_rng"])
    shell.delay.load_state_dict(saved["delay"])
    shell.protocol.restore_lags(saved["lags"], str(path))
    return saved["history"]


def load_noise_policy(directory: str | Path, base) -> NoisePolicy:
    """The policy a `vla-rl dsrl` run wrote in ``directory`` (its dsrl/ folder), driving ``base``, the frozen
    policy it was trained on (refused, naming it, when the weights differ, or when the earlier `vla-rl dsrl` wrote
    it)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    if config.get("version") != VERSION:
        raise ValueError(f"{directory} holds an agent of the earlier vla-rl dsrl (SAC over the whole noise), which this "
                         "version no longer runs: train it again with `vla-rl dsrl`")  # fmt: skip
    if weights_sha256(base) != config["base_sha256"]:
        raise ValueError(f"{directory} steers the policy of {config['checkpoint']}, not this one (weights differ)")
    agent = NoiseAgent(base, SACConfig(**config["sac"]), config["executed_rows"])
    weights = load_file(str(directory / "model.safetensors"))
    agent.critics.encoder.load_state_dict(
        {k.removeprefix("encoder."): v for k, v in weights.items() if k.startswith("encoder.")}
    )
    agent.actor_net.load_state_dict({k.removeprefix("actor."): v for k, v in weights.items() if k.startswith("actor.")})
    return NoisePolicy(agent)


def save_agent(directory: Path, agent: NoiseAgent, cfg: DSRLConfig) -> None:
    """The encoder and the actor (model.safetensors) and what rebuilds them (config.json), each written
    atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = {**{f"encoder.{k}": v for k, v in agent.critics.encoder.state_dict().items()},
               **{f"actor.{k}": v for k, v in agent.actor_net.state_dict().items()}}  # fmt: skip
    tmp = directory / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
    tmp.replace(directory / "model.safetensors")
    config = {"version": VERSION, "sac": asdict(cfg.sac), "noise_shape": list(agent.policy.noise_shape),
              "executed_rows": agent.rows, "checkpoint": cfg.checkpoint, "env": asdict(cfg.env),
              "base_sha256": weights_sha256(agent.policy)}  # fmt: skip
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(directory / "config.json")
