"""`vla-rl dsrl`: DSRL, steering a frozen flow policy through its initial noise with soft actor-critic
(`vla_rl.rl.sac` holds the method). Each iteration rolls the agent out through the rollout PPO and GRPO use
(`vla_rl.rl.rollout.collect`, the latency model included), adds its transitions to the replay buffer and
takes ``sac.updates`` gradient steps. At the end the frozen policy and the policy driven by the actor's
deterministic noise are evaluated on the same held-out initial states (`vla-rl eval`'s stage), and
``dsrl/`` (the actor, config.json) and ``dsrl_summary.json`` are written atomically.

Every ``checkpoint_every`` iterations, and at a stop signal, ``dsrl_state.pt`` keeps what resuming needs: the
agent (actor, critics, their targets, the temperature), its optimizer, the replay buffer, the history and
torch's random stream, and each setting's delay stream and measured lags. The same command resumes from it to
the result a run never stopped reaches (the rollouts reset from per-iteration seeds), and may extend it with
more ``iterations``; a state written with other training settings is refused. It holds the replay buffer's
whole preallocated storage (``sac.buffer_size`` rows of features, noise and reward): about 200 MB at the
defaults with 256 features.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from sim.config import EnvConfig
from vla_core import interrupt
from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
from vla_rl.checkpoint import load_policy
from vla_rl.eval_record import weights_sha256
from vla_rl.rl.sac import NoiseAgent, SACConfig, chunk_discount, transitions
from vla_rl.steering import WrappedPolicy, check_steerable


@dataclass
class DSRLConfig:
    """DSRL: soft actor-critic over the initial noise of a frozen flow policy, in the batched sim."""

    checkpoint: str = "outputs/quickstart/train"  # the frozen flow policy
    env: EnvConfig = field(default_factory=lambda: EnvConfig(num_envs=16))  # the task, its variation, worlds
    # Train across several settings: iteration i runs env.variation = variations[i % len] ("" = in
    # distribution); empty = env.variation throughout. The final evaluation runs env as given.
    variations: list[str] = field(default_factory=list)
    iterations: int = 30
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
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from sim.factory import make_env
    from vla_core.runtime.delayed_env import DelayedChunkEnv, step_policy_of
    from vla_rl.rl.rollout import collect
    from vla_rl.stages import EvalConfig, evaluate

    if cfg.checkpoint_every < 1:
        raise ValueError(f"checkpoint_every={cfg.checkpoint_every}: pass --checkpoint_every=1 or more (iterations)")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy, _ = load_policy(cfg.checkpoint, device=cfg.device)
    policy.eval()
    check_steerable(policy)
    torch.manual_seed(cfg.seed)
    agent = NoiseAgent(policy, cfg.sac)
    replay = ReplayBuffer(storage=LazyTensorStorage(cfg.sac.buffer_size), batch_size=cfg.sac.batch_size)
    start = time.time()
    state_file = out / STATE_FILE
    # What a resumed run must share with the saved one; the evaluation, the folder and the iteration count may
    # change (a run can be extended: every iteration's rollouts reset from their own seed).
    free = ("num_threads", "checkpoint_every", "iterations", "eval_episodes", "eval_seed", "output_dir")
    made_with = {k: v for k, v in asdict(cfg).items() if k not in free}
    made_with["base_sha256"] = weights_sha256(policy)
    settings = [replace(cfg.env, variation=v) for v in cfg.variations] or [cfg.env]
    envs = [make_env(setting) for setting in settings]
    try:
        shells = [DelayedChunkEnv(env, LatencySpec.of(policy), cfg.chunking, DelayModel(cfg.delay, env.control_dt),
                                  use="finetune", step_policy=step_policy_of(policy)) for env in envs]  # fmt: skip
        history = load_state(state_file, agent, replay, shells, made_with) if state_file.exists() else []
        with interrupt.deferred():  # a stop signal ends the run after an iteration, its state saved
            for it in tqdm(range(len(history), cfg.iterations), desc="dsrl", unit="it", initial=len(history),
                           total=cfg.iterations):  # fmt: skip
                rollout, stats = collect(agent, shells[it % len(shells)], episodes_per_world=cfg.episodes_per_world,
                                         seed=cfg.seed + 1_000_000 + it, gamma=cfg.sac.gamma)  # fmt: skip
                if agent.gamma_chunk is None:
                    agent.gamma_chunk = chunk_discount(rollout, cfg.sac.gamma)
                    agent.loss.make_value_estimator(gamma=agent.gamma_chunk)
                kept = transitions(rollout)
                if len(kept):  # none where the time limit cut every episode after its first decision
                    replay.extend(kept)
                losses = agent.update(replay) if len(replay) >= cfg.sac.batch_size else {}
                history.append({"iteration": it, "variation": settings[it % len(settings)].variation,
                                "success_rate": round(stats.success_rate, 4), "episodes": stats.episodes,
                                "env_steps": stats.env_steps, "buffer": len(replay),
                                "truncated_left_out": int(rollout.truncated.sum()),
                                **{k: round(v, 5) for k, v in losses.items()}})  # fmt: skip
                if interrupt.received() is not None or (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
                    save_state(state_file, agent, replay, shells, history, made_with)
                interrupt.raise_if_stopped()
    finally:
        for env in envs:
            env.close()
    save_agent(out / "dsrl", agent, cfg)
    arms = {}
    for name, arm in (("base", policy), ("dsrl", NoisePolicy(agent))):
        arms[name] = evaluate(EvalConfig(checkpoint=cfg.checkpoint, env=cfg.env, num_episodes=cfg.eval_episodes,
                                         seed=cfg.eval_seed, chunking=cfg.chunking, delay=cfg.delay, video_episodes=0,
                                         output_dir=str(out / f"eval_{name}"), overwrite=True), policy=arm)  # fmt: skip
    rates = {name: {"success_rate": r["success_rate"], "ci95": r["success_ci95"]} for name, r in arms.items()}
    summary = {"config": asdict(cfg), "history": history, "gamma_chunk": agent.gamma_chunk, "eval": rates,
               "gain_points": round(100 * (rates["dsrl"]["success_rate"] - rates["base"]["success_rate"]), 1),
               "seconds": round(time.time() - start, 1)}  # fmt: skip
    tmp = out / "dsrl_summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "dsrl_summary.json")
    return summary


STATE_FILE = "dsrl_state.pt"


def save_state(path: Path, agent: NoiseAgent, replay, shells: list, history: list[dict], made_with: dict) -> None:
    """What resuming needs (module docstring), and each shell's delay stream and measured lags (the measured delay
    estimate reads them across episodes), written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"made_with": made_with, "history": history, "gamma_chunk": agent.gamma_chunk,
                "loss": agent.loss.state_dict(), "optimizer": agent.optimizer.state_dict(),
                "replay": replay.state_dict(), "torch_rng": torch.get_rng_state(),
                "delays": [shell.delay.state_dict() for shell in shells],
                "lags": [shell.protocol.lags.cpu() for shell in shells]}, tmp)  # fmt: skip
    tmp.replace(path)


def load_state(path: Path, agent: NoiseAgent, replay, shells: list, made_with: dict) -> list[dict]:
    """Restore a saved run into ``agent``, ``replay``, the shells (delay streams, lags) and torch's stream; returns its history (one entry per
    iteration done). Refused, naming the setting, when it was written with other settings."""
    saved = torch.load(path, weights_only=False)  # our own file: it holds the replay buffer's TensorDicts
    for name, value in made_with.items():
        if json.loads(json.dumps(saved["made_with"].get(name))) != json.loads(json.dumps(value)):
            raise ValueError(f"{path} was written by a run with another {name} ({saved['made_with'].get(name)!r} "
                             f"against {value!r}): pass another --output_dir, or delete it to start again")  # fmt: skip
    agent.gamma_chunk = saved["gamma_chunk"]
    if agent.gamma_chunk is not None:
        agent.loss.make_value_estimator(gamma=agent.gamma_chunk)
    agent.loss.load_state_dict(saved["loss"])
    agent.optimizer.load_state_dict(saved["optimizer"])
    replay.load_state_dict(saved["replay"])
    torch.set_rng_state(saved["torch_rng"])
    for shell, delay, lags in zip(shells, saved["delays"], saved["lags"], strict=True):
        shell.delay.load_state_dict(delay)
        shell.protocol.lags = lags.to(shell.protocol.lags.device)
    return saved["history"]


def load_noise_policy(directory: str | Path, base) -> NoisePolicy:
    """The policy a `vla-rl dsrl` run wrote in ``directory`` (its dsrl/ folder), driving ``base``, the frozen
    policy it was trained on (refused, naming it, when the weights differ)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    if weights_sha256(base) != config["base_sha256"]:
        raise ValueError(f"{directory} steers the policy of {config['checkpoint']}, not this one (weights differ)")
    agent = NoiseAgent(base, SACConfig(**config["sac"]))
    agent.actor_net.load_state_dict(load_file(str(directory / "model.safetensors")))
    return NoisePolicy(agent)


def save_agent(directory: Path, agent: NoiseAgent, cfg: DSRLConfig) -> None:
    """The actor (model.safetensors) and what rebuilds it (config.json), each written atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in agent.actor_net.state_dict().items()}, str(tmp))
    tmp.replace(directory / "model.safetensors")
    config = {"sac": asdict(cfg.sac), "noise_shape": list(agent.policy.noise_shape), "latent_dim": agent.policy.latent_dim,
              "checkpoint": cfg.checkpoint, "base_sha256": weights_sha256(agent.policy),
              "gamma_chunk": agent.gamma_chunk}  # fmt: skip
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(directory / "config.json")
