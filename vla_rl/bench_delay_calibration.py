"""`vla-rl bench delay-calibration` (also ``benchmarks/delay_calibration.py``): choose the task and the
delay of the latency benchmarks from their baseline arms alone.

It runs the protocol of ``benchmarks/delay_calibration_2026-12-02.md`` (with its amendments), every
setting fixed there and nothing else changeable:

1. For each task in order (``TASKS``), for both training seeds (``SEEDS``): `bench delay`'s plain policy,
   evaluated with ``latest`` merging at d = 0 and at every candidate delay (``CANDIDATE_DELAYS``).
   Pooled over the seeds (successes over both seeds' episodes), a task whose plain(0) is below
   ``MIN_PLAIN`` stops here.
2. A task where no delay passes the imitation rule plain(0) - plain(d) >= ``IMITATION_LOSS`` stops here
   (the 2026-12-05 amendment: the RL stage could not change its outcome). Otherwise both seeds' `bench
   latency-rl` ``standard`` runs (PPO with no delay), evaluated at d = 0.
3. In increasing order over the delays that passed it, both seeds' ``naive`` runs at d; the first d
   with pooled naive(d) <= ``RL_RATIO`` x standard(0) is D, and the calibration ends.

Each stage is the benchmarks' own (`vla_rl.bench_stages`) with the benchmarks' configs, in the folders
the arms' runs then resume: ``<output_dir>/<task>/seed<s>/delay`` (`bench delay`) and
``.../latency_rl`` (`bench latency-rl`). A killed calibration resumes its finished stages and keeps
its evaluated cells (``calibration.json``, written after each), also after an amendment has been appended
to the protocol (any other change of its text refuses to resume). The result records the protocol file's
SHA-256 (and in ``protocol_history`` those of the texts its cells were measured under); the arms take
``--calibration=<output_dir>/calibration.json`` and `vla_rl.bench_stages.check_calibration` refuses them
if the file changed since, or if their settings differ from the calibration's. The final line:
``task=<t> delay=<D> plain_loss_points=<x> naive_over_standard=<y>`` (``none`` for what was not chosen or
not measured).

``--quick`` runs every stage once at toy sizes, under a rule every delay passes: it checks the
plumbing, and says nothing about which task or delay qualifies.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from vla_core.files import write_text_atomic

TASKS = ("track_reverse", "push_impulse", "track_jump")  # in order; the third by the second 2026-12-05 amendment
CANDIDATE_DELAYS = (2, 4, 6, 8, 10)  # control steps of 50 ms
SEEDS = (0, 1)
EPISODES = 200  # per cell and seed
EVAL_SEED = 9000
ENV_STEPS = 36_000  # rollout control steps of every PPO run
MIN_PLAIN = Fraction(3, 10)
IMITATION_LOSS = Fraction(1, 5)
RL_RATIO = Fraction(3, 5)


@dataclass
class BenchDelayCalibrationConfig:
    """The baseline arms of `bench delay` and `bench latency-rl` on the surprise tasks, by the fixed protocol."""

    num_threads: int = 0  # torch CPU threads; 0 = all cores
    # <task>/seed<s>/{delay,latency_rl} (the arms' runs resume these) and calibration.json; a quick run
    # goes to <output_dir>/quick
    output_dir: str = "outputs/bench/delay_calibration"
    quick: bool = False  # toy sizes and a rule every delay passes: each stage runs once; says nothing


def benchmark_configs(task: str, seed: int, out: Path, quick: bool, num_threads: int = 0):
    """The (`BenchDelayConfig`, `BenchLatencyRLConfig`) of one task and seed, as the protocol fixes them."""
    from vla_rl.bench_delay import BenchDelayConfig
    from vla_rl.bench_latency_rl import BenchLatencyRLConfig

    folder = out / task / f"seed{seed}"
    delay = BenchDelayConfig(task=task, seed=seed, episodes=EPISODES, eval_seed=EVAL_SEED, merges=["latest"],
                             num_threads=num_threads, output_dir=str(folder / "delay"))  # fmt: skip
    latency = BenchLatencyRLConfig(task=task, seed=seed, eval_episodes=EPISODES, eval_seed=EVAL_SEED,
                                   env_steps=ENV_STEPS, num_threads=num_threads,
                                   output_dir=str(folder / "latency_rl"))  # fmt: skip
    if quick:
        for c in (delay, latency):
            c.demos, c.train_steps, c.batch_size, c.num_envs = 4, 20, 16, 4
        delay.episodes = latency.eval_episodes = 4
        latency.env_steps = 150
    return delay, latency


def pooled(cells: dict[str, dict], task: str, arm: str, d: int) -> Fraction | None:
    """The success rate of ``arm`` at delay ``d`` pooled over the seeds (None until every seed's cell exists)."""
    found = [cells.get(cell_key(task, seed, arm, d)) for seed in SEEDS]
    if any(c is None for c in found):
        return None
    return Fraction(sum(c["successes"] for c in found), sum(c["episodes"] for c in found))


def cell_key(task: str, seed: int, arm: str, d: int) -> str:
    return f"{task}/seed{seed}/{arm}/d{d}"


def imitation_qualifies(plain_zero: Fraction, plain_d: Fraction, quick: bool = False) -> bool:
    return quick or plain_zero - plain_d >= IMITATION_LOSS


def rl_qualifies(naive_d: Fraction, standard_zero: Fraction, quick: bool = False) -> bool:
    return quick or naive_d <= RL_RATIO * standard_zero


def bench_delay_calibration(cfg: BenchDelayCalibrationConfig) -> dict[str, Any]:
    """Run the protocol of the module docstring; returns (and writes as ``calibration.json``) every cell
    and the choice. Every key of the report is a string (seeds and delays too), as in the file."""
    from vla_rl import bench_stages
    from vla_rl.bench_stages import (
        delay_cell,
        latency_rl_cell,
        ppo_run,
        protocol_extends,
        protocol_sha256,
        record_demos,
        train_imitation,
    )
    from vla_rl.stages import DelayConfig

    out = (Path(cfg.output_dir) / "quick" if cfg.quick else Path(cfg.output_dir)).resolve()
    result_file = out / "calibration.json"
    sha = protocol_sha256()
    state = json.loads(result_file.read_text()) if result_file.is_file() else {}
    history: list[str] = state.get("protocol_history", [state["protocol_sha256"]] if state else [])
    if state and state["protocol_sha256"] != sha and not protocol_extends(state["protocol_sha256"]):
        raise ValueError(
            f"{bench_stages.PROTOCOL.name} changed since this calibration began in {out}, other than by an "
            "amendment appended at its end; its cells were measured under the old text. Restore the text above "
            "the amendments, or calibrate into a new --output_dir"
        )
    if sha not in history:
        history.append(sha)  # the texts the cells were measured under, in order; the last one is today's
    cells: dict[str, dict] = state.get("cells", {})
    start = time.time()
    report: dict[str, Any] = {"file": str(result_file), "protocol": bench_stages.PROTOCOL.name, "protocol_sha256": sha,
                              "protocol_history": history, "quick": cfg.quick, "finished": False, "cells": cells,
                              "tasks": {}, "chosen": None, "configs": {}}  # fmt: skip

    def save(finished: bool = False) -> dict[str, Any]:
        report["finished"] = finished
        report["minutes"] = round(state.get("minutes", 0) + (time.time() - start) / 60, 2)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(result_file, json.dumps(report, indent=2))
        return report

    def cell(key: str, evaluate, *args) -> None:
        """Evaluate the cell ``key`` once (``evaluate(*args)`` -> its result); a resumed run keeps it."""
        if key not in cells:
            cells[key] = evaluate(*args)
            save()

    def rl_cell(task: str, seed: int, latency_cfg, arm: str, d: int) -> None:
        """`bench latency-rl`'s PPO run ``<arm>_d<d>`` (unless its cell is done) and its cell."""
        folder, name = Path(latency_cfg.output_dir), f"{arm}_d{d}"
        if cell_key(task, seed, arm, d) not in cells:
            ppo_run(latency_cfg, folder, name, d, latency_aware=False)
        cell(cell_key(task, seed, arm, d), latency_rl_cell, latency_cfg, folder, arm, d, folder / "runs" / name)

    for task in TASKS:
        configs = {seed: benchmark_configs(task, seed, out, cfg.quick, cfg.num_threads) for seed in SEEDS}
        fixed = {str(s): {"delay": asdict(a), "latency_rl": asdict(b)} for s, (a, b) in configs.items()}
        earlier = state.get("configs", {}).get(task)
        if earlier is not None and earlier != json.loads(json.dumps(fixed)):
            raise ValueError(
                f"the benchmarks' settings for {task} changed since this calibration began in {out} (a default of "
                "bench delay or bench latency-rl differs): its cells cannot be pooled with new ones; calibrate into "
                "a new --output_dir"
            )
        report["configs"][task] = fixed
        decision: dict[str, Any] = {}
        report["tasks"][task] = decision
        for seed, (delay_cfg, _) in configs.items():  # 1: the plain policy at every delay
            folder = Path(delay_cfg.output_dir)
            record_demos(delay_cfg, folder / "dataset")
            train_imitation(delay_cfg, folder / "dataset", folder / "plain", DelayConfig())
            for d in (0, *CANDIDATE_DELAYS):
                cell(cell_key(task, seed, "plain", d), delay_cell, delay_cfg, folder, "plain", "latest", d)
        plain = {d: pooled(cells, task, "plain", d) for d in (0, *CANDIDATE_DELAYS)}
        decision["plain_zero"] = float(plain[0])
        if plain[0] < MIN_PLAIN and not cfg.quick:
            decision["outcome"] = f"plain(0) = {float(plain[0]):.3f} < {float(MIN_PLAIN)}: too little room"
            save()
            continue
        decision["plain_loss"] = {str(d): float(plain[0] - plain[d]) for d in CANDIDATE_DELAYS}
        qualifying = [d for d in CANDIDATE_DELAYS if imitation_qualifies(plain[0], plain[d], cfg.quick)]
        decision["imitation_qualifying"] = qualifying
        if not qualifying:  # the 2026-12-05 amendment: standard(0) could not change the choice, so it is not run
            decision["outcome"] = f"no candidate delay costs the plain policy {float(IMITATION_LOSS):.2f}"
            save()
            continue
        for seed, (_, latency_cfg) in configs.items():  # 2: no-delay RL
            folder = Path(latency_cfg.output_dir)
            record_demos(latency_cfg, folder / "dataset")
            train_imitation(latency_cfg, folder / "dataset", folder / "imitation", DelayConfig())
            rl_cell(task, seed, latency_cfg, "standard", 0)
        standard_zero = pooled(cells, task, "standard", 0)
        decision["standard_zero"] = float(standard_zero)
        decision["naive_over_standard"] = {}
        for d in qualifying:  # 3: naive RL, in increasing delay, until one fails
            for seed, (_, latency_cfg) in configs.items():
                rl_cell(task, seed, latency_cfg, "naive", d)
            naive_d = pooled(cells, task, "naive", d)
            decision["naive_over_standard"][str(d)] = float(naive_d / standard_zero) if standard_zero else None
            if rl_qualifies(naive_d, standard_zero, cfg.quick):
                report["chosen"] = {"task": task, "delay": d, "seeds": list(SEEDS), "episodes": EPISODES,
                                    "eval_seed": EVAL_SEED}  # fmt: skip
                decision["outcome"] = f"chosen: delay {d}"
                return save(finished=True)
        decision["outcome"] = "no delay passing the imitation rule leaves naive RL at or below the RL rule"
        save()
    return save(finished=True)


def arm_commands(report: dict[str, Any], calibration_file: str) -> list[str]:
    """The arms' runs the calibration's choice asks for, one per benchmark and seed, every fixed setting spelled out."""
    from vla_rl.bench_stages import flag

    chosen = report["chosen"]
    if not chosen:
        return []
    commands = []
    for seed in chosen["seeds"]:
        configs = report["configs"][chosen["task"]][str(seed)]
        for bench, name, episodes in (("delay", "delay", "episodes"), ("latency_rl", "latency-rl", "eval_episodes")):
            c = configs[bench]
            commands.append(
                f"vla-rl bench {name} --task={c['task']} --seed={seed} --delays={flag([0, chosen['delay']])} "
                f"--{episodes}={c[episodes]} --eval_seed={c['eval_seed']} --output_dir={c['output_dir']} "
                f"--calibration={calibration_file}"
            )
    return commands


def format_summary(report: dict[str, Any]) -> str:
    """Every cell (per seed and pooled), each task's outcome, then the final line."""
    from vla_rl.stages import wilson_interval

    lines = [f"{'task':<14} {'arm':<9} {'delay':>5} {'seed 0':>7} {'seed 1':>7} {'pooled':>7}  95% interval"]
    groups = {}  # (task, arm, delay) -> {seed: cell}, in the order measured
    for key, c in report["cells"].items():
        task, seed, arm, d = key.split("/")
        groups.setdefault((task, arm, int(d[1:])), {})[int(seed.removeprefix("seed"))] = c
    for (task, arm, d), by_seed in groups.items():
        rates = [f"{by_seed[s]['success_rate']:>7.3f}" if s in by_seed else f"{'-':>7}" for s in SEEDS]
        k, n = sum(c["successes"] for c in by_seed.values()), sum(c["episodes"] for c in by_seed.values())
        lo, hi = wilson_interval(k, n)
        lines.append(f"{task:<14} {arm:<9} {d:>5} {' '.join(rates)} {k / n:>7.3f}  [{lo:.2f}, {hi:.2f}]")
    for task, decision in report["tasks"].items():
        lines.append(f"{task}: {decision.get('outcome', 'not finished')}")
    if report["quick"]:
        lines.append("quick run: toy sizes and a rule every delay passes; the choice below means nothing")
    chosen = report["chosen"]
    if chosen and not report["quick"]:
        lines.append("the arms, each seed its own resumable run:")
        lines.extend(f"  {command}" for command in arm_commands(report, report["file"]))
    if chosen:
        decision = report["tasks"][chosen["task"]]
        loss = f"{100 * decision['plain_loss'][str(chosen['delay'])]:.1f}"
        ratio = decision["naive_over_standard"][str(chosen["delay"])]
        lines.append(f"task={chosen['task']} delay={chosen['delay']} plain_loss_points={loss} "
                     f"naive_over_standard={'none' if ratio is None else f'{ratio:.3f}'}")  # fmt: skip
    else:
        lines.append("task=none delay=none plain_loss_points=none naive_over_standard=none")
    return "\n".join(lines)
