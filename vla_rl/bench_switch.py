"""`vla-rl bench switch`: instructions that change mid-task (SwitchVLA), met through the latency protocol
(``--chunking.on_new_instruction=replan``) against the earlier rule (``next_chunk``: the plan and the request in
flight run out, the next request on schedule carries the new instruction).

The protocol is ``benchmarks/switch_2026-12-07.md`` (committed on its own before this file; its amendments are
dated there). Per training seed, in ``<output_dir>/seed<s>`` with ``--seeds``:

1. ``demos`` scripted demonstrations of ``reach_switch`` (every frame carries the instruction in force);
2. ``diffusion_vla`` policies trained on them for each length of ``train_lengths`` in turn (each from scratch, its
   own folder ``imitation_<steps>``) until one succeeds ``pilot_threshold`` or more at delay 0 on
   ``pilot_episodes`` episodes from ``pilot_seed``: that length's policy is the one both arms run;
3. the arms: ``vla-rl eval`` of that policy at a fixed delay of ``delay`` steps, ``eval_episodes`` episodes from
   ``eval_seed``, under each rule, with the switch and reaction time of every episode (`vla_rl.eval`);
4. the bound: the task's scripted expert planning each chunk (open loop, from its arm's position and the
   instruction of the request's observation) through the same shell, delay and episodes, under each rule (the
   protocol's amendment of 2026-12-07; it reads no training seed, so a pooled report gives it once).

Final line: ``replan_success=<x> next_chunk_success=<y> replan_over_next_chunk=<r> median_reaction_replan=<m>
median_reaction_next_chunk=<n> episodes=<k>``; pooled over ``--seeds`` (successes summed, reactions of every
episode), `` seeds=<s,...>`` appended. Every stage is resumable: a killed run goes on with the same command.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from vla_core.files import write_text_atomic

RULES = ("replan", "next_chunk")
PROTOCOL = Path(__file__).resolve().parents[1] / "benchmarks" / "switch_2026-12-07.md"


@dataclass
class BenchSwitchConfig:
    """Instructions that change mid-task: replanning through the latency protocol against the next-chunk rule."""

    task: str = "reach_switch"  # a task whose instruction switches mid-episode
    demos: int = 200  # scripted demonstration episodes per training seed
    policy_type: str = "diffusion_vla"  # reads the instruction with its text tower
    horizon: int = 16  # chunk length (a delay of `delay` needs more rows than that)
    n_action_steps: int = 8  # steps executed per chunk
    batch_size: int = 64
    # Training lengths tried in turn, each from scratch, until the policy succeeds pilot_threshold at delay 0.
    train_lengths: list[int] = field(default_factory=lambda: [4000, 8000, 12000])
    pilot_episodes: int = 100  # episodes of the delay-0 pilot of each length
    pilot_seed: int = 8000  # its initial states (not the evaluation's)
    pilot_threshold: float = 0.70
    delay: int = 8  # fixed inference delay of both arms, control steps (the calibrated 400 ms)
    eval_episodes: int = 200  # per arm
    eval_seed: int = 9000
    num_envs: int = 50  # worlds stepped together in recording, the pilot, the arms and the bound
    seed: int = 0  # demonstrations and training
    # Several training seeds, each its own resumable run in <output_dir>/seed<s> (a finished one is read back),
    # then pooled in <output_dir>/pooled.json. Empty: one run in output_dir.
    seeds: list[int] = field(default_factory=list)
    num_threads: int = 0  # torch CPU threads; 0 = all cores
    output_dir: str = "outputs/bench/switch"
    quick: bool = False  # toy sizes in <output_dir>/quick: checks every stage runs; says nothing about the claim

    def apply_quick(self) -> None:
        if self.quick:
            self.demos, self.batch_size, self.train_lengths, self.num_envs = 4, 8, [10], 4
            self.pilot_episodes, self.eval_episodes, self.pilot_threshold = 4, 4, 0.0

    def validate(self) -> None:
        if not 0 <= self.delay < self.horizon:
            raise ValueError(f"--delay must be in [0, horizon={self.horizon}), got {self.delay}")
        if not self.train_lengths or min(self.train_lengths) < 1 or sorted(self.train_lengths) != self.train_lengths:
            raise ValueError(f"--train_lengths must be increasing step counts >= 1, got {self.train_lengths}")
        if min(self.demos, self.pilot_episodes, self.eval_episodes, self.num_envs) < 1:
            raise ValueError("--demos, --pilot_episodes, --eval_episodes and --num_envs must be >= 1")


def bench_switch(cfg: BenchSwitchConfig) -> dict[str, Any]:
    """Run the protocol (module docstring); returns the report (``switch.json``, or ``pooled.json`` with seeds)."""
    from vla_rl.bench_stages import seed_runs

    cfg.apply_quick()
    cfg.validate()
    if not PROTOCOL.is_file():
        raise FileNotFoundError(f"the protocol {PROTOCOL} is missing; restore it from the repository")
    out = Path(cfg.output_dir) / "quick" if cfg.quick else Path(cfg.output_dir)
    if not cfg.seeds:
        return _one_seed(cfg, out)
    reports = seed_runs(cfg, lambda seed: out / f"seed{seed}", "switch.json", _one_seed)
    arms = {rule: _pool([r["arms"][rule] for r in reports.values()]) for rule in RULES}
    # The bound reads no training seed (the expert, the evaluation episodes, the delay): every seed's is the same
    # 200 episodes, so it is reported once, not pooled.
    bound = next(iter(reports.values()))["bound"]
    if any(r["bound"] != bound for r in reports.values()):
        raise ValueError("the seeds' expert bounds differ, though none reads its seed: their runs had other settings")
    pooled = {"config": asdict(cfg), "arms": arms, "bound": bound, "summary": summarize(arms),
              "seeds": {str(seed): report for seed, report in reports.items()}}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "pooled.json", json.dumps(pooled, indent=2))
    return pooled


def _one_seed(cfg: BenchSwitchConfig, out: Path) -> dict[str, Any]:
    """The protocol for ``cfg.seed`` in ``out``; the report is also written as ``out / "switch.json"``."""
    from vla_rl.bench_stages import RunClock, record_demos, train_imitation

    clock = RunClock(out / "run_clock.json")
    record_demos(cfg, out / "dataset")
    pilots = []
    for steps in cfg.train_lengths:  # the length is chosen on the shared policy alone, before either arm runs
        policy_dir = out / f"imitation_{steps}"
        train_imitation(SimpleNamespace(**asdict(cfg), train_steps=steps), out / "dataset", policy_dir)
        # at delay 0 under the default rule, with the evaluation's own noise (a finished pilot is read back)
        pilot = _evaluation(cfg, policy_dir, out / "pilot" / f"steps{steps}", rule="replan", delay=0,
                            episodes=cfg.pilot_episodes, seed=cfg.pilot_seed, noise_seed=-1)  # fmt: skip
        pilot = {k: pilot[k] for k in ("episodes", "successes", "success_rate", "success_ci95", "mean_episode_length")}
        pilots.append({"train_steps": steps, **pilot})
        if pilot["success_rate"] >= cfg.pilot_threshold:
            break
    arms = {rule: _arm(cfg, policy_dir, rule, out / "eval" / rule) for rule in RULES}
    bound = expert_bound(cfg, out / "bound.json")
    report = {"config": asdict(cfg), "protocol": PROTOCOL.name, "pilots": pilots, "train_steps": pilots[-1]["train_steps"],
              "pilot_reached_threshold": pilots[-1]["success_rate"] >= cfg.pilot_threshold,
              "arms": arms, "bound": bound, "summary": summarize(arms), "minutes": clock.stop()}  # fmt: skip
    write_text_atomic(out / "switch.json", json.dumps(report, indent=2))
    return report


def _arm(cfg: BenchSwitchConfig, checkpoint: Path, rule: str, output_dir: Path) -> dict[str, Any]:
    """An arm's cell: ``checkpoint`` at the fixed delay under ``rule``, with every episode's switch."""
    result = _evaluation(cfg, checkpoint, output_dir, rule=rule, delay=cfg.delay, episodes=cfg.eval_episodes,
                         seed=cfg.eval_seed, noise_seed=cfg.eval_seed)  # fmt: skip
    return _cell([(e["success"], e.get("switch_step", -1), e.get("reaction_steps", -1)) for e in result["per_episode"]])


def _evaluation(cfg: BenchSwitchConfig, checkpoint: Path, output_dir: Path, *, rule: str, delay: int, episodes: int,
                seed: int, noise_seed: int) -> dict[str, Any]:  # fmt: skip
    """`vla-rl eval` of ``checkpoint`` into ``output_dir``: read back when finished there under these settings (refused
    under others), resumed when stopped part-way, else run."""
    from vla_rl.stages import ChunkingConfig, DelayConfig, EnvConfig, EvalConfig, evaluate

    done, num_envs = output_dir / "eval.json", min(cfg.num_envs, episodes)
    if done.is_file() and not (output_dir / "eval_progress.pt").exists():
        result = json.loads(done.read_text())
        c = result["config"]
        ran = {"checkpoint": Path(result["checkpoint"]).resolve().is_relative_to(checkpoint.resolve()),
               "delay": c["delay"]["steps"], "num_episodes": c["num_episodes"], "seed": c["seed"],
               "noise_seed": c["noise_seed"], "rule": c["chunking"].get("on_new_instruction", "replan"),
               "num_envs": c["env"]["num_envs"]}  # fmt: skip
        wanted = {"checkpoint": True, "delay": delay, "num_episodes": episodes, "seed": seed, "noise_seed": noise_seed,
                  "rule": rule, "num_envs": num_envs}  # fmt: skip
        if ran != wanted:
            raise ValueError(f"{output_dir} holds an evaluation of another setting ({ran} against {wanted}): pass "
                             "another --output_dir (one per seed and setting)")  # fmt: skip
        return result
    stopped = (output_dir / "eval_progress.pt").exists()
    return evaluate(EvalConfig(
        checkpoint=str(checkpoint), env=EnvConfig(task=cfg.task, num_envs=num_envs), num_episodes=episodes, seed=seed,
        video_episodes=0, noise_seed=noise_seed, chunking=ChunkingConfig(on_new_instruction=rule),
        delay=DelayConfig(kind="fixed", steps=delay), output_dir=str(output_dir), resume=stopped, overwrite=not stopped,
    ))  # fmt: skip


def _cell(episodes: list[tuple[bool, int, int]]) -> dict[str, Any]:
    """An arm's cell from its episodes' (success, switch step or -1, reaction steps or -1)."""
    switched = [(s, r) for s, at, r in episodes if at >= 0]
    return _counts(len(episodes), sum(s for s, _, _ in episodes), len(switched), sum(s for s, _ in switched),
                   sorted(r for _, r in switched if r >= 0))  # fmt: skip


def _pool(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Cells of several seeds as one: counts summed, reactions together."""
    total = {k: sum(c[k] for c in cells) for k in ("episodes", "successes", "switched", "switched_successes")}
    return _counts(*total.values(), sorted(r for c in cells for r in c["reactions"]))


def _counts(episodes: int, wins: int, switched: int, switched_wins: int, reactions: list[int]) -> dict[str, Any]:
    from vla_core.runtime.transition import reaction_quartiles
    from vla_rl.stages import wilson_interval

    quartiles = reaction_quartiles(reactions)
    return {"episodes": episodes, "successes": wins, "success_rate": wins / episodes,
            "success_ci95": list(wilson_interval(wins, episodes)), "switched": switched,
            "switched_successes": switched_wins, "reacted": len(reactions), "reaction_steps_quartiles": quartiles,
            "median_reaction_steps": quartiles[1] if quartiles else None, "reactions": reactions}  # fmt: skip


def summarize(arms: dict[str, dict]) -> dict[str, Any]:
    replan, later = arms["replan"]["success_rate"], arms["next_chunk"]["success_rate"]
    return {"replan_success": replan, "next_chunk_success": later,
            "replan_over_next_chunk": replan / later if later > 0 else math.inf,
            "median_reaction_replan": arms["replan"]["median_reaction_steps"],
            "median_reaction_next_chunk": arms["next_chunk"]["median_reaction_steps"],
            "episodes": arms["replan"]["episodes"]}  # fmt: skip


def expert_bound(cfg: BenchSwitchConfig, path: Path) -> dict[str, Any]:
    """The task's scripted expert planning every chunk open loop (`_expert_chunks`), through the latency shell at
    the arms' delay, chunking and episodes, under each rule: what each rule leaves a policy that perceives
    perfectly. Written to ``path``; read back if there."""
    setting = {"task": cfg.task, "delay": cfg.delay, "horizon": cfg.horizon, "n_action_steps": cfg.n_action_steps,
               "eval_episodes": cfg.eval_episodes, "eval_seed": cfg.eval_seed, "num_envs": cfg.num_envs}  # fmt: skip
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("setting") != setting:
            raise ValueError(f"{path} holds the bound of another setting ({saved.get('setting')} against {setting}): "
                             "pass another --output_dir (one per seed and setting)")  # fmt: skip
        return saved["rules"]
    from sim.config import EnvConfig
    from sim.factory import make_env
    from sim.tasks import EXPERTS
    from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
    from vla_core.runtime.delayed_env import DelayedChunkEnv
    from vla_core.runtime.transition import SwitchReactions
    from vla_core.types import ActionChunk
    from vla_rl.stages import EpisodePlan

    spec = LatencySpec(horizon=cfg.horizon, n_action_steps=cfg.n_action_steps)
    n = min(cfg.num_envs, cfg.eval_episodes)
    plan = EpisodePlan.seeded(cfg.eval_episodes, n, cfg.eval_seed)  # the arms' initial states
    bound = {}
    with make_env(EnvConfig(task=cfg.task, num_envs=n, cameras=[])) as env:
        expert = EXPERTS[cfg.task](n)
        for rule in RULES:
            shell = DelayedChunkEnv(env, spec, ChunkingConfig(on_new_instruction=rule),
                                    DelayModel(DelayConfig(kind="fixed", steps=cfg.delay), env.control_dt))  # fmt: skip
            reactions, episodes = SwitchReactions(n), []
            for round_ in plan.rounds:
                _, need = shell.reset(seed=round_.seed)
                reactions.restart()
                finished = np.array([e is None for e in round_.episodes])
                while not finished.all():
                    chunk = _expert_chunks(expert, env, cfg.horizon, need)
                    *_, terminated, truncated, info, need = shell.step(ActionChunk(chunk, shell.obs_step))
                    met = {}
                    for reaction in reactions.add(info["trace"]):
                        met.setdefault(reaction.world, reaction)
                    done = (terminated | truncated).numpy() & ~finished
                    for i in np.flatnonzero(done):
                        episodes.append((bool(info["success"][i]), met[i].switch_step, met[i].reaction_steps))
                    finished |= done
            bound[rule] = _cell(episodes)
    write_text_atomic(path, json.dumps({"setting": setting, "rules": bound}, indent=2))
    return bound


def _expert_chunks(expert, env, horizon: int, need) -> Any:
    """(N, H, A) chunks: for the asked worlds, the expert's actions stepped open loop from the arm's position now
    (each row's target taken as reached) toward the ball the instruction of now names; zeros elsewhere."""
    import torch

    privileged, position = env.privileged_state(), env.ee_positions()
    rows = []
    for _ in range(horizon):
        action = expert.act(position, privileged)
        rows.append(action)
        position = action[:, :3]
    chunk = torch.as_tensor(np.stack(rows, axis=1), dtype=torch.float32)
    return torch.where(need[:, None, None], chunk, torch.zeros_like(chunk))


def format_summary(report: dict[str, Any]) -> str:
    """Each seed's final line, the arms and the bound, then the final line."""
    lines = [f"seed {seed}: {_final_line(r['summary'])}" for seed, r in report.get("seeds", {}).items()]
    for name in ("arms", "bound"):
        for rule, c in report[name].items():
            lo, hi = c["success_ci95"]
            lines.append(f"{name[:-1] if name == 'arms' else 'expert bound'} {rule:<10} success {c['success_rate']:.3f} "
                         f"[{lo:.2f}, {hi:.2f}] switched {c['switched']} (won {c['switched_successes']}) "
                         f"reaction quartiles {c['reaction_steps_quartiles']}")  # fmt: skip
    for p in report.get("pilots", []):
        lines.append(f"pilot at delay 0, {p['train_steps']} steps: success {p['success_rate']:.3f}")
    seeds = "" if "seeds" not in report else " seeds=" + ",".join(report["seeds"])
    return "\n".join([*lines, _final_line(report["summary"]) + seeds])


def _final_line(s: dict[str, Any]) -> str:
    return (f"replan_success={s['replan_success']:.3f} next_chunk_success={s['next_chunk_success']:.3f} "
            f"replan_over_next_chunk={s['replan_over_next_chunk']:.3f} "
            f"median_reaction_replan={s['median_reaction_replan']} "
            f"median_reaction_next_chunk={s['median_reaction_next_chunk']} episodes={s['episodes']}")  # fmt: skip
