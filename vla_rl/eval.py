"""`vla-rl eval`: batched closed-loop rollouts of a checkpoint.

Chunks from the policy are executed through `vla_core.runtime.delayed_env.DelayedChunkEnv` and so through the
latency model of `vla_core.runtime` (request schedule, delay estimate, augmentation, chunk queue), the
one the robot bridge drives; ``--chunking.*`` sets the steps executed per chunk and the merge mode
(``rtc`` also guides a flow policy toward the queued actions, as ``vla-rl serve`` does),
``--delay.*`` evaluates under inference delay (none by default), drawn or replayed from latencies a
served robot measured (``--delay.kind=histogram --delay.latencies_file=...``, or ``--delay.kind=trace``:
request k of episode e gets the robot's latency of its request k of episode e), announced to the
policy by the oracle or by the robot's own estimate (``--delay.estimate=measured``). Each world
runs one episode per round; round r resets with seed ``seed + r``, so the same seed always
evaluates the same initial states; the plan numbers the episodes r * N + w (world w of N), as a trace
and ``--noise_seed`` (each request's sampler noise keyed by episode and request) look them up. On LIBERO a named protocol (``--protocol``, `sim.libero_protocol`)
fixes the episodes of each task, their initial states, settle steps and step limits instead.

Writes ``eval.json`` (per-episode results, success rate with a 95% Wilson interval, a row per task,
the provenance a re-run needs), ``episodes.jsonl`` (each episode as it ends), ``summary.md`` and
``rollouts.mp4`` (a grid of the first few episodes). A stopped evaluation goes on with ``--resume=true``;
``--rerun=<eval.json>`` runs a record again (`vla_rl.eval_record`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import draccus
import numpy as np
import torch
from tqdm import tqdm

from sim.config import EnvConfig
from sim.libero_protocol import with_libero_cameras
from vla_core import crash_log, interrupt
from vla_core.files import temporary_beside, write_text_atomic
from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec, noise_shape, request_noise
from vla_core.runtime.transition import Reaction, SwitchReactions, reaction_quartiles
from vla_core.types import TASK, ActionChunk, SteerMode, world_indices
from vla_rl.checkpoint import load_policy
from vla_rl.config_json import chunking_made_with
from vla_rl.eval_record import (
    EpisodePlan,
    EvalRecord,
    best_of_draws,
    compare_episodes,
    load_random_state,
    occupied,
    per_task_table,
    provenance,
    random_state,
    rates,
    read_record,
    suite_of,
)
from vla_rl.statistics import wilson_interval

DEFAULT_EPISODES = 50  # episodes of an evaluation off LIBERO when --num_episodes is not given


@dataclass
class SteerEvalConfig:
    dir: str = ""  # a `vla-rl steer` output's steering/ (RL²) or a `vla-rl dsrl` output's dsrl/; "" = unsteered
    mode: SteerMode = "gated"  # gated: where the failure predictor expects a failure; always: every chunk
    weight: float = 0.0  # w in v = v_base + w (v_RL - v_base); 0 = the weight `vla-rl steer` chose
    best_of: int = 0  # candidates the critic chooses among in a steered chunk (1: none); 0 = the N `vla-rl steer` chose


@dataclass
class EvalConfig:
    """Evaluate a policy checkpoint in closed loop in the batched simulator."""

    checkpoint: str = "outputs/quickstart/train"  # checkpoint dir, or a training output dir (uses its last)
    # A LeRobot VLA checkpoint's tokenizer, in a local folder (pi0/pi05: PaliGemma's; SmolVLA: its VLM's,
    # with config.json); "": the checkpoint's tokenizer/ folder, else the Hugging Face cache.
    tokenizer_dir: str = ""
    env: EnvConfig = field(
        default_factory=lambda: EnvConfig(num_envs=50)
    )  # simulated task; num_envs worlds per round (default here: 50)
    num_episodes: int = 0  # episodes in total; 0 = 50, or under a LIBERO protocol episodes_per_task per task
    # > 1: every initial state is run this many times, each with its own policy noise (num_episodes / draws
    # states), and eval.json's best_of_draws says what the best of them reaches: the headroom any choice among
    # the policy's own samples (steering, best-of-N, RL that re-weights) could add
    draws_per_state: int = 1
    seed: int = 1000  # seed of the evaluation initial states (kept apart from the recording seed)
    # LIBERO's evaluation protocol (`sim.libero_protocol`: openpi, lerobot, rlinf, simplevla): episodes per
    # task, initial states, settle steps, step limits. "" = openpi on a LIBERO task; refused on other tasks.
    protocol: str = ""
    episodes_per_task: int = 0  # under a protocol: episodes of each task (0 = the protocol's, 50 for openpi)
    resume: bool = False  # go on with the interrupted evaluation in output_dir (its episodes.jsonl)
    # An eval.json to evaluate again, with its own config (its checkpoint, which must hold the weights it
    # measured, tasks, seeds, protocol, delays) into output_dir; every episode's outcome is compared.
    rerun: str = ""
    overwrite: bool = False  # evaluate again into an output_dir that holds an evaluation
    # Several tasks or LIBERO suites in one run (each in its place of --env.task, into output_dir/<task>,
    # each resumable), with one eval.json over all of them; e.g. '[libero_spatial,libero_object]'.
    tasks: list[str] = field(default_factory=list)
    # steps executed per chunk (0 = the policy's n_action_steps), merge mode, ensemble weight
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)  # inference delay in control steps (0 = none)
    # >= 0: the sampler's initial noise of request k of the plan's episode e is drawn from (noise_seed, e, k)
    # (`vla_core.runtime.noise`), as `vla-rl serve --noise_seed` draws it on the robot; -1: from torch's stream.
    noise_seed: int = -1
    # The sampler's initial noise times this (a flow policy; 1 = as trained): the sigma probe that bounds the noise
    # DSRL may steer in (`vla_rl.steering.NoiseScaledPolicy`).
    noise_scale: float = 1.0
    # Latent steering (RL²) of the frozen policy by a `vla-rl steer` output (`vla_rl.steering`): none by default.
    steer: SteerEvalConfig = field(default_factory=lambda: SteerEvalConfig())
    video_episodes: int = 4  # episodes shown in rollouts.mp4 (0 = no video)
    video_size: int = 192  # pixels per episode tile in the video
    output_dir: str = "outputs/quickstart/eval"  # eval.json, episodes.jsonl, summary.md and rollouts.mp4 go here
    device: str = "cpu"  # torch device of the policy (cpu, cuda, cuda:1, ...)

    def libero_protocol(self):
        """The `sim.libero_protocol.LiberoProtocol` this evaluation runs (None off LIBERO), its flags checked."""
        from sim.libero_protocol import DEFAULT_PROTOCOL, INITIAL_STATES_PER_TASK, is_libero_task, protocol

        if not is_libero_task(self.env.task):
            if self.protocol or self.episodes_per_task:
                raise ValueError(
                    f"--protocol and --episodes_per_task are LIBERO's evaluation protocols; {self.env.task!r} is "
                    "not a LIBERO task: drop them (--num_episodes sets how many episodes run)"
                )
            return None
        chosen = protocol(self.protocol or DEFAULT_PROTOCOL)
        fixed = {"--num_episodes": self.num_episodes, "--env.max_episode_steps": self.env.max_episode_steps,
                 "--env.settle_steps": self.env.settle_steps + 1}  # fmt: skip
        if any(fixed.values()):
            raise ValueError(
                f"the LIBERO protocol {chosen.name!r} fixes the episodes, step limits and settle steps: drop "
                f"{', '.join(k for k, v in fixed.items() if v)} (--episodes_per_task sets episodes per task; "
                f"--protocol chooses another protocol)"
            )
        if not 0 <= self.episodes_per_task <= INITIAL_STATES_PER_TASK:
            raise ValueError(
                f"--episodes_per_task must be in [0, {INITIAL_STATES_PER_TASK}] (LIBERO's initial states per task; "
                f"0 = the protocol's), got {self.episodes_per_task}"
            )
        return chosen


def evaluate(cfg: EvalConfig, policy=None, expected_weights: str | None = None) -> dict:
    """Evaluate ``cfg.checkpoint``; or, given ``policy`` (in eval mode), that policy as it is in memory,
    with ``cfg.checkpoint`` naming where it is saved (``vla-rl finetune``'s periodic evaluation).
    ``expected_weights``: the sha256 the weights must have (`eval_record.weights_sha256`)."""
    if cfg.resume and cfg.overwrite:
        raise ValueError(
            "--resume=true goes on with the evaluation in output_dir, --overwrite=true replaces it: pass one"
        )
    if cfg.rerun:
        return rerun(cfg)
    check_draws(cfg)
    if cfg.tasks:
        return evaluate_tasks(cfg, policy, expected_weights)
    from sim.factory import make_env
    from vla_core.runtime.delayed_env import DelayedChunkEnv, step_policy_of

    libero = cfg.libero_protocol()
    env_cfg = cfg.env
    if libero is not None:
        env_cfg = replace(with_libero_cameras(cfg.env), max_episode_steps=libero.limit(suite_of(cfg.env.task)),
                          settle_steps=libero.settle_steps)  # fmt: skip
    if policy is None:
        policy, ckpt = load_policy(cfg.checkpoint, device=cfg.device, tokenizer_dir=cfg.tokenizer_dir)
    else:
        ckpt = cfg.checkpoint
    policy = composed(policy, cfg)
    origin = provenance(policy)
    if cfg.steer.dir:  # the steering's files as they were evaluated (a finished part is checked against them)
        origin["steering_sha256"] = files_sha256(Path(cfg.steer.dir))
    if expected_weights is not None and origin["weights_sha256"] != expected_weights:
        raise ValueError(
            f"{ckpt} does not hold the weights the record measured (sha256 {origin['weights_sha256'][:12]}... "
            f"against {expected_weights[:12]}...): point the record's checkpoint at them"
        )
    torch.manual_seed(cfg.seed)  # diffusion sampling noise: the same seed gives the same rollouts
    pcfg = policy.config
    if env_cfg.image_size != pcfg.image_size or list(env_cfg.cameras) != list(pcfg.cameras):
        raise ValueError(
            f"the policy expects cameras {pcfg.cameras} at {pcfg.image_size}px but the env renders "
            f"{env_cfg.cameras} at {env_cfg.image_size}px; set --env.cameras='[{','.join(pcfg.cameras)}]' "
            f"--env.image_size={pcfg.image_size}"
        )
    out = Path(cfg.output_dir)
    delays_seen: dict[int, int] = {}  # delay in control steps -> chunks that got it
    start = time.time()
    with make_env(env_cfg) as env:
        delay = DelayModel(cfg.delay, control_dt=env.control_dt)
        n = env.num_envs
        plan = episode_plan(cfg, env, libero)
        delay.check_episodes(plan.num_episodes)  # a trace too short for the plan is refused before any step
        recorder = FrameRecorder(env, min(cfg.video_episodes, n, plan.num_episodes), cfg.video_size)
        # Chunks run through the same latency model as RL and the robot bridge; with the default
        # zero delay this is plain chunked execution. A delay the policy cannot take is refused here,
        # before any rollout and before any output.
        delayed = DelayedChunkEnv(recorder, LatencySpec.of(policy), cfg.chunking, delay,
                                  step_policy=step_policy_of(policy))  # fmt: skip
        execute_steps, guided = delayed.execute_steps, delayed.protocol.sends_guidance
        record = EvalRecord(out, identity(cfg, origin["weights_sha256"]), cfg.resume, cfg.overwrite)
        record.check_rounds(plan)
        if record.saved_state is not None:
            load_random_state(record.saved_state, delay, delayed.protocol, delays_seen, str(record.progress_path))
        bar = tqdm(total=plan.num_episodes, initial=len(record.episodes), desc="eval", unit="ep")
        # A stop signal ends the evaluation between env steps (vla_core.interrupt); the rounds done are
        # kept (episodes.jsonl, eval_progress.pt) and --resume=true goes on from there. eval.json is
        # written only once every episode has run.
        with interrupt.deferred(), crash_log.into(out):
            _run_rounds(plan, record, delayed, recorder, policy, delays_seen, bar, cfg.noise_seed)
        bar.close()
    episodes = sorted(record.episodes, key=lambda e: (e["round"], e["world"]))
    protocol_record = None
    if libero is not None:
        protocol_record = {"name": libero.name, "source": libero.source, "settle_steps": libero.settle_steps,
                           "episodes_per_task": cfg.episodes_per_task or libero.episodes_per_task,
                           "max_episode_steps": env_cfg.max_episode_steps}  # fmt: skip
    successes = sum(e["success"] for e in episodes)
    lo, hi = wilson_interval(successes, len(episodes))
    lengths = [e["length"] for e in episodes]
    result = {
        "checkpoint": str(ckpt),
        "task": cfg.env.task,
        "protocol": protocol_record,
        "episodes": len(episodes),
        "successes": successes,
        "success_rate": successes / len(episodes),
        "success_ci95": [lo, hi],
        "mean_episode_length": float(np.mean(lengths)),
        "mean_success_length": float(np.mean([e["length"] for e in episodes if e["success"]] or [0])),
        "per_task": per_task_table(episodes, env.task_names),
        "best_of_draws": best_of_draws(episodes) if cfg.draws_per_state > 1 else None,
        "switch": switch_summary(episodes),  # an instruction that changed mid-episode (None: none did)
        "seed": cfg.seed,
        "execute_steps": execute_steps,
        "merge": cfg.chunking.merge,
        "rtc_guidance": guided,
        "delay": asdict(cfg.delay),
        "delay_max_steps": delay.max_steps,
        "delay_histogram": {str(d): delays_seen[d] for d in sorted(delays_seen)},  # chunks per delay (steps)
        "seconds": round(time.time() - start, 1),
        "per_episode": episodes,
        "config": asdict(cfg),
        "provenance": origin,
    }
    # Each file is whole or absent: a stop signal while writing is acted on once all three are written.
    with interrupt.deferred():
        if recorder.frames:
            _write_video(out / "rollouts.mp4", recorder.frames, fps=round(1 / env.control_dt))
            result["video"] = str(out / "rollouts.mp4")
        write_text_atomic(out / "eval.json", json.dumps(result, indent=2))
        write_text_atomic(out / "summary.md", _summary_md(result))
        record.finished()
    return result


def episode_plan(cfg: EvalConfig, env, libero) -> EpisodePlan:
    """The evaluation's rounds (`vla_rl.eval_record`): a LIBERO protocol's initial states per task, each state's
    ``draws_per_state`` draws, or batch-seeded rounds."""
    if libero is not None:
        return EpisodePlan.per_task(env.world_tasks.tolist(), env.task_names,
                                    cfg.episodes_per_task or libero.episodes_per_task)  # fmt: skip
    if cfg.draws_per_state > 1:
        return EpisodePlan.repeated(cfg.num_episodes // cfg.draws_per_state, cfg.draws_per_state, env.num_envs,
                                    cfg.seed)  # fmt: skip
    return EpisodePlan.seeded(cfg.num_episodes or DEFAULT_EPISODES, env.num_envs, cfg.seed)


def check_draws(cfg: EvalConfig) -> None:
    """``--draws_per_state`` in one line: >= 1, and above 1 a number of episodes it divides, off LIBERO's protocols."""
    d = cfg.draws_per_state
    if d < 1:
        raise ValueError(f"--draws_per_state must be >= 1 (1: every episode its own initial state), got {d}")
    if d > 1 and (cfg.tasks or cfg.libero_protocol() is not None):
        raise ValueError("--draws_per_state repeats the seeded initial states; LIBERO's protocols and --tasks fix "
                         "their own episodes: drop it there")  # fmt: skip
    if d > 1 and (cfg.num_episodes <= 0 or cfg.num_episodes % d):
        raise ValueError(f"--draws_per_state={d} needs --num_episodes a multiple of it (states x draws), got "
                         f"{cfg.num_episodes}")  # fmt: skip


def composed(policy, cfg: EvalConfig):
    """``policy`` as the evaluation runs it: its noise scaled (``--noise_scale``) or steered (``--steer.dir``, RL² or
    DSRL), never both; the steering flags without a steering are refused in one line."""
    if not cfg.steer.dir and asdict(cfg.steer) != asdict(SteerEvalConfig()):
        raise ValueError("--steer.mode, --steer.weight and --steer.best_of steer nothing without --steer.dir (a "
                         "`vla-rl steer` output's steering/ folder): pass it, or drop them")  # fmt: skip
    if cfg.noise_scale != 1.0 and cfg.steer.dir:
        raise ValueError("--noise_scale probes the base's own noise and --steer.dir steers it: pass one")
    if cfg.noise_scale != 1.0:
        from vla_rl.steering import NoiseScaledPolicy

        return NoiseScaledPolicy(policy, cfg.noise_scale)  # refuses a scale <= 0 or a policy without flow noise
    if cfg.steer.dir:
        from vla_rl.steering import load_steered

        return load_steered(policy, cfg.steer.dir, cfg.steer.mode, cfg.steer.weight or None, cfg.steer.best_of or None)
    return policy


def identity(cfg: EvalConfig, weights_sha256: str, steering_sha256: str | None = None) -> dict:
    """What must match for a record to be resumed or reused: the config without what does not change the
    episodes, the weights, and a steering's files (``steering_sha256`` as a record saved it; None: as the
    folder holds them now)."""
    skip = ("resume", "overwrite", "rerun", "output_dir", "video_episodes", "video_size", "tokenizer_dir")
    # Fields added since, at the value that changes nothing: left out, as a record from before them holds none.
    if cfg.draws_per_state == 1:
        skip += ("draws_per_state",)
    if cfg.noise_scale == 1.0:
        skip += ("noise_scale",)
    if not cfg.steer.dir:  # unsteered: the steer mode and weight (whose defaults changed) change nothing
        skip += ("steer",)
    if steering_sha256 is None and cfg.steer.dir:
        steering_sha256 = files_sha256(Path(cfg.steer.dir))
    steered = {"steering_sha256": steering_sha256} if cfg.steer.dir else {}
    kept = {k: v for k, v in asdict(cfg).items() if k not in skip}
    kept["chunking"] = chunking_made_with(cfg.chunking, cfg.tasks or [cfg.env.task])
    return {**kept, "weights_sha256": weights_sha256, **steered}


def files_sha256(directory: Path) -> str:
    """sha256 over the files of a steering folder (names and bytes, in name order): a steering trained again in the
    same folder is another steering, so its records are not resumed as this one's."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _run_rounds(plan: EpisodePlan, record: EvalRecord, delayed, recorder, policy, delays_seen: dict, bar,
                noise_seed: int = -1) -> None:  # fmt: skip
    """Run the rounds of ``plan`` the record has not done, appending each episode as it ends and saving the
    progress after each round (see `vla_rl.eval_record`)."""
    env, n = recorder.env, delayed.num_envs
    reactions = SwitchReactions(n)  # an instruction that changes mid-episode: when it changed, how fast it was met
    for r in range(record.rounds_done, len(plan.rounds)):
        this = plan.rounds[r]
        recorder.enabled = r == 0
        obs, need = delayed.reset(seed=this.seed, episodes=plan.episode_numbers(r))
        reactions.restart()
        # A world's counted episode of the round is the one this reset began: its variation (`--env.variation`).
        varied = getattr(env, "variation_record", None)
        variations = [varied(i) if varied is not None else {} for i in range(n)]
        finished = np.array([e is None for e in this.episodes])  # uncounted worlds run but are not kept
        length = np.zeros(n, dtype=np.int64)
        while not finished.all():
            noise = _request_noise(policy, delayed, need, noise_seed) if noise_seed >= 0 else None
            obs, _, terminated, truncated, info, need = delayed.step(
                _predict(policy, obs, need, delayed.obs_step, delayed.guidance, noise)
            )
            length += np.where(finished, 0, info["steps"].cpu().numpy())
            met: dict[int, Reaction] = {}
            for reaction in reactions.add(info["trace"]):
                met.setdefault(reaction.world, reaction)  # a world's first end in the call is its counted one
            for d in info["delay_steps"][info["delay_steps"] >= 0].tolist():
                delays_seen[d] = delays_seen.get(d, 0) + 1
            done = (terminated | truncated).cpu().numpy() & ~finished
            for i in np.flatnonzero(done):
                task = env.task_names[int(info["task_id"][i])]
                record.append({"round": r, "world": int(i), "task": task, **this.episodes[i],
                               "success": bool(info["success"][i]), "length": int(length[i]),
                               "requests": int(info["requests"][i]),
                               **({"variation": variations[i]} if variations[i] else {}),
                               **switch_fields(met.get(int(i)))})  # fmt: skip
                bar.update(1)
            finished |= done
            interrupt.raise_if_stopped()
        record.round_done(r + 1, random_state(delayed.delay, delayed.protocol, delays_seen))


def switch_fields(reaction: Reaction | None) -> dict[str, int]:
    """An episode record's ``switch_step`` and ``reaction_steps`` (`SwitchReactions`), where its instruction
    switched; nothing otherwise."""
    if reaction is None or reaction.switch_step < 0:
        return {}
    return {"switch_step": reaction.switch_step, "reaction_steps": reaction.reaction_steps}


def switch_summary(episodes: list[dict]) -> dict[str, Any] | None:
    """Over the episodes whose instruction switched: how many, their success, how many met the switch (a row of a
    chunk planned on the new instruction ran) and the reaction times' median and quartiles; None when none did."""
    switched = [e for e in episodes if "switch_step" in e]
    if not switched:
        return None
    met = [e["reaction_steps"] for e in switched if e["reaction_steps"] >= 0]
    quartiles = reaction_quartiles(met)
    return {"episodes": len(switched), "successes": sum(e["success"] for e in switched), "reacted": len(met),
            "reaction_steps_quartiles": quartiles, "median_reaction_steps": quartiles[1] if quartiles else None,
            "unswitched_successes": sum(e["success"] for e in episodes if "switch_step" not in e),
            "unswitched_episodes": len(episodes) - len(switched)}  # fmt: skip


def evaluate_tasks(cfg: EvalConfig, policy=None, expected_weights: str | None = None) -> dict:
    """``cfg.tasks`` one after the other, each into ``output_dir/<task>`` (a finished one is reused on
    --resume=true), then one result over all: ``per_task`` and ``per_episode`` of every task, ``per_suite``,
    the overall rate. Each task's own eval.json stays where it ran."""
    if cfg.env.task != EnvConfig().task and cfg.env.task not in cfg.tasks:
        raise ValueError(f"--env.task={cfg.env.task} and --tasks both name what to evaluate: keep --tasks only")
    if len(set(cfg.tasks)) != len(cfg.tasks):
        raise ValueError(f"--tasks names a task twice ({cfg.tasks}): name each once")
    out = Path(cfg.output_dir)
    if (out / "eval.json").exists() and not (cfg.resume or cfg.overwrite):
        raise occupied(out)
    parts, weights = [], None
    for task in cfg.tasks:
        folder = out / task.replace("/", "_")
        one = replace(cfg, env=replace(cfg.env, task=task), tasks=[], output_dir=str(folder))
        done = folder / "eval.json"
        if cfg.resume and done.exists() and not (folder / "eval_progress.pt").exists():  # finished before the stop
            part = json.loads(done.read_text())
            ran = draccus.decode(EvalConfig, part["config"])
            weights = weights or ran_weights(one, policy)  # every part evaluates the same weights: hashed once
            saved = part["provenance"]
            if identity(ran, saved["weights_sha256"], saved.get("steering_sha256", "")) != identity(one, weights):
                raise ValueError(
                    f"{folder} holds an evaluation of {task} under another config or other weights; resume with "
                    "the run's own flags, or pass --overwrite=true"
                )
            parts.append(part)
        else:
            parts.append(evaluate(one, policy, expected_weights))
    episodes = [e for part in parts for e in part["per_episode"]]
    successes = sum(e["success"] for e in episodes)
    result = {
        "checkpoint": parts[0]["checkpoint"], "tasks": list(cfg.tasks), "protocol": parts[0]["protocol"],
        "episodes": len(episodes), "successes": successes, "success_rate": successes / len(episodes),
        "success_ci95": list(wilson_interval(successes, len(episodes))),
        "mean_episode_length": float(np.mean([e["length"] for e in episodes])),
        "per_suite": [{"suite": name, **row} for name, row in rates(episodes, lambda e: suite_of(e["task"])).items()],
        "per_task": [row for part in parts for row in part["per_task"]],
        "parts": {task: str(out / task.replace("/", "_") / "eval.json") for task in cfg.tasks},
        "per_episode": episodes, "config": asdict(cfg), "provenance": parts[0]["provenance"],
    }  # fmt: skip
    write_text_atomic(out / "eval.json", json.dumps(result, indent=2))
    lines = [f"# Evaluation: {', '.join(cfg.tasks)}", "", f"- checkpoint: `{result['checkpoint']}`",
             (f"- success: **{result['success_rate']:.1%}** ({successes}/{len(episodes)}), 95% CI "
             f"[{result['success_ci95'][0]:.1%}, {result['success_ci95'][1]:.1%}]"), "",
             "| suite | successes | rate | 95% CI |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {s['suite']} | {s['successes']}/{s['episodes']} | {s['success_rate']:.1%} | "
              f"[{s['success_ci95'][0]:.1%}, {s['success_ci95'][1]:.1%}] |" for s in result["per_suite"]]  # fmt: skip
    write_text_atomic(out / "summary.md", "\n".join(lines) + "\n")
    return result


def ran_weights(cfg: EvalConfig, policy=None) -> str:
    """The sha256 of the weights ``cfg`` evaluates (``policy``'s when given, else its checkpoint's)."""
    from vla_rl.eval_record import weights_sha256

    if policy is None:
        policy = load_policy(cfg.checkpoint, device="cpu", tokenizer_dir=cfg.tokenizer_dir)[0]
    return weights_sha256(policy)


def rerun(cfg: EvalConfig) -> dict:
    """Evaluate again what the record ``cfg.rerun`` ran, into ``cfg.output_dir``; the result adds ``rerun``:
    the record, whether every episode's outcome and length came out the same, and those that did not."""
    record = read_record(Path(cfg.rerun))
    again_cfg = draccus.decode(EvalConfig, {**record["config"], "output_dir": cfg.output_dir, "rerun": "",
                                            "overwrite": cfg.overwrite, "resume": cfg.resume})  # fmt: skip
    result = evaluate(again_cfg, expected_weights=record["provenance"]["weights_sha256"])
    differing = compare_episodes(record["per_episode"], result["per_episode"])
    result["rerun"] = {"record": str(cfg.rerun), "same_outcomes": not differing, "differing": differing,
                       "versions_differ": {k: [v, result["provenance"]["versions"].get(k)]
                                           for k, v in record["provenance"]["versions"].items()
                                           if v != result["provenance"]["versions"].get(k)}}  # fmt: skip
    write_text_atomic(Path(cfg.output_dir) / "eval.json", json.dumps(result, indent=2))
    return result


def _request_noise(policy, delayed, need: torch.Tensor, noise_seed: int) -> torch.Tensor:
    """(N, *noise_shape) the sampler noise of each asked world's request (the policy's ``noise_shape``, else
    (horizon, action_dim)): request k of the plan's episode e gets ``request_noise(noise_seed, e, k)``, the
    robot's for its request k of episode e; a world running an uncounted episode draws from torch's stream
    (its rows are never compared). Other rows are zero."""
    shape = noise_shape(policy)
    noise = torch.zeros(len(need), *shape)
    episodes, requests = delayed.episode, delayed.request_index
    for w in torch.nonzero(need.cpu()).flatten().tolist():
        e, k = int(episodes[w]), int(requests[w])
        noise[w] = request_noise(noise_seed, e, k, *shape)[0] if e >= 0 else torch.randn(shape)
    return noise


def _predict(
    policy,
    obs: dict,
    need: torch.Tensor,
    obs_step: torch.Tensor,
    guidance: tuple[torch.Tensor, torch.Tensor] | None,
    noise: torch.Tensor | None = None,
) -> ActionChunk:
    """Run the policy on the requesting worlds only; other rows of the (N, H, A) chunk stay zero.

    guidance: RTC's (target (N, H, A), weights (N, H)) for a flow policy, or None. noise: (N, H, A) each
    world's sampler start (`_request_noise`), or None: drawn by the policy.
    """
    rows = torch.nonzero(need.cpu()).flatten()
    if len(rows) == 0:  # no world asks yet (a latency-aware policy waits for its mid-inference observation)
        cfg = policy.config
        return ActionChunk(torch.zeros(len(need), cfg.horizon, cfg.action_dim, device=policy.device), obs_step)
    sub = {
        k: [v[i] for i in rows.tolist()] if k == TASK else v[rows.to(v.device)]
        for k, v in obs.items()
        if k == TASK or torch.is_tensor(v)
    }
    given = {} if noise is None else {"noise": noise[rows]}
    if guidance is not None:
        inpaint = tuple(g[rows.to(g.device)] for g in guidance)
        chunk = policy.predict_chunk(sub, obs_step[rows.to(obs_step.device)], inpaint=inpaint, **given)
    else:
        chunk = policy.predict_chunk(sub, obs_step[rows.to(obs_step.device)], **given)
    # On the policy's device: the delay shell moves it to the env's (none of it to the host).
    actions = chunk.actions.new_zeros(len(need), *chunk.actions.shape[1:])
    actions[rows.to(actions.device)] = chunk.actions
    return ActionChunk(actions, obs_step)


class FrameRecorder:
    """Wraps a batched env and renders the first ``count`` worlds side by side after every step.

    A world's tile is greyed out once its first episode has ended. Recording happens only while
    ``enabled``; everything else is passed through to the wrapped env.
    """

    def __init__(self, env, count: int, size: int):
        self.env, self.count, self.size = env, count, size
        self.enabled = False
        self.frames: list[np.ndarray] = []
        self._ended = np.zeros(env.num_envs, dtype=bool)

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, seed=None, *, worlds=None):
        obs = self.env.reset(seed=seed, worlds=worlds)
        self._ended[world_indices(worlds, self.env.num_envs)] = False
        self._record()
        return obs

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.env.step(actions)
        self._ended |= (terminated | truncated).cpu().numpy()
        self._record()
        return obs, reward, terminated, truncated, info

    def _record(self) -> None:
        if self.enabled and self.count > 0:
            tiles = [self.env.render(i, size=self.size) for i in range(self.count)]
            self.frames.append(np.concatenate([t // 3 if self._ended[i] else t for i, t in enumerate(tiles)], axis=1))


def _write_video(path: Path, frames: list[np.ndarray], fps: int) -> None:
    import imageio.v2 as imageio

    tmp = temporary_beside(path)
    with imageio.get_writer(tmp, fps=fps, codec="libx264", quality=7, macro_block_size=1) as writer:
        for f in frames:
            writer.append_data(f)
    os.replace(tmp, path)


def _summary_md(r: dict) -> str:
    lo, hi = r["success_ci95"]
    return (
        f"# Evaluation: {r['task']}\n\n"
        f"- checkpoint: `{r['checkpoint']}`\n"
        f"- success: **{r['success_rate']:.1%}** ({r['successes']}/{r['episodes']}), 95% CI [{lo:.1%}, {hi:.1%}]\n"
        f"- mean episode length: {r['mean_episode_length']:.1f} steps "
        f"(successful: {r['mean_success_length']:.1f})\n"
        f"- seed {r['seed']}, {r['execute_steps']} steps executed per chunk, merge `{r['merge']}`\n"
        + (f"- protocol `{r['protocol']['name']}` ({r['protocol']['source']}): {r['protocol']['episodes_per_task']} "
           f"episodes per task, {r['protocol']['settle_steps']} settle steps, at most "
           f"{r['protocol']['max_episode_steps']} steps\n" if r["protocol"] else "")
        + (f"- best of {b['draws']} draws per initial state: **{b['best_of_draws']:.1%}** of {b['states']} states "
           f"(mean {b['mean']:.1%}, headroom {b['headroom_points']:+.1f} points; {b['states_never']} states never "
           f"succeed)\n" if (b := r.get("best_of_draws")) else "")
        + f"- time: {r['seconds']} s\n"
        + "\n| task | successes | rate | 95% CI | mean length |\n|---|---|---|---|---|\n"
        + "".join(f"| {t['task']} | {t['successes']}/{t['episodes']} | {t['success_rate']:.1%} | "
                  f"[{t['success_ci95'][0]:.1%}, {t['success_ci95'][1]:.1%}] | {t['mean_episode_length']:.1f} |\n"
                  for t in r["per_task"])
    )  # fmt: skip
