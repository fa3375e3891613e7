"""`vla-rl quickstart`: record -> train -> eval on the embedded default task, end to end."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from vla_rl import stages
from vla_rl.stages import EvalConfig, RecordConfig, TrainConfig


@dataclass
class QuickstartConfig:
    """Record scripted demos, train a diffusion policy on them, and evaluate it: the whole loop on one CPU."""

    output_dir: str = "outputs/quickstart"  # everything goes under here: dataset/, train/, eval/
    record: RecordConfig = field(default_factory=RecordConfig)  # its output_dir is replaced by <output_dir>/dataset
    train: TrainConfig = field(default_factory=TrainConfig)  # its dataset.root and output_dir are replaced likewise
    eval: EvalConfig = field(default_factory=EvalConfig)  # its checkpoint and output_dir are replaced likewise
    fresh: bool = False  # delete earlier quickstart results first instead of reusing a finished dataset


def quickstart(cfg: QuickstartConfig, log=print) -> dict:
    """Each stage reuses its finished output, so a re-run after an interruption continues where it stopped."""
    root = Path(cfg.output_dir)
    if cfg.fresh:
        shutil.rmtree(root, ignore_errors=True)
    cfg.record.output_dir = str(root / "dataset")
    cfg.train.dataset.root = cfg.record.output_dir
    cfg.train.output_dir = str(root / "train")
    cfg.eval.checkpoint = cfg.train.output_dir
    cfg.eval.output_dir = str(root / "eval")
    cfg.eval.overwrite = True  # every quickstart run evaluates the policy it ends with

    if (root / "dataset" / "meta" / "info.json").is_file():
        log(f"[1/3] reusing the dataset at {cfg.record.output_dir}")
    else:
        log(f"[1/3] recording {cfg.record.num_episodes} scripted episodes -> {cfg.record.output_dir}")
        rec = stages.record(cfg.record)
        log(f"      {rec['episodes']} episodes, {rec['frames']} frames in {rec['seconds']} s")

    summary_file = Path(cfg.train.output_dir) / "train_summary.json"
    done = summary_file.is_file() and json.loads(summary_file.read_text())["steps"] >= cfg.train.steps
    if done:
        log(f"[2/3] reusing the trained policy in {cfg.train.output_dir}")
    else:
        cfg.train.resume = (Path(cfg.train.output_dir) / "checkpoints" / "last").exists()
        log(
            f"[2/3] training for {cfg.train.steps} steps -> {cfg.train.output_dir}"
            + (" (resuming)" if cfg.train.resume else "")
        )
        tr = stages.train(cfg.train)
        log(f"      final loss {tr['final_loss']:.4f} in {tr['seconds_this_run']} s")

    log(f"[3/3] evaluating {cfg.eval.num_episodes} episodes -> {cfg.eval.output_dir}")
    result = stages.evaluate(cfg.eval)
    lo, hi = result["success_ci95"]
    log(
        f"\nsuccess rate {result['success_rate']:.1%} ({result['successes']}/{result['episodes']}), "
        f"95% CI [{lo:.1%}, {hi:.1%}], eval seed {result['seed']}\n"
        f"results: {cfg.eval.output_dir}/eval.json, summary.md, rollouts.mp4; "
        f"loss curve: {cfg.train.output_dir}/loss.png"
    )
    return result
