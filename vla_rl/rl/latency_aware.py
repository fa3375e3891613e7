"""Making a fine-tuning run's policy latency-aware (ARLI, `policies.latency_head`): the fast head added for
the run's delays and, with ``--latency_warmup.steps``, fitted on demonstrations before RL
(`vla_rl.latency_warmup`). `warm_up_fast_part` also fits a low-latency part (`vla_rl.low_latency_warmup`)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from vla_rl.checkpoint import load_policy


def make_latency_aware(cfg, policy, max_delay: int, out: Path, control_dt: float, processes) -> Path | None:
    """Give ``policy`` its fast head for delays up to ``max_delay`` (unless a resumed checkpoint has it);
    returns the warmed-up checkpoint the run then starts from, or None when there is no warm-up."""
    pcfg = policy.config
    if cfg.resume and cfg.latency_aware and not pcfg.latency_aware:
        raise ValueError(
            f"the run in {out} is not latency-aware; resume it without --latency_aware, or start the "
            f"latency-aware run in a new --output_dir"
        )
    if pcfg.latency_aware and not cfg.latency_aware:  # its head would act and train all the same
        raise ValueError("the checkpoint is latency-aware (it has a fast head); fine-tune it with --latency_aware=true")
    if pcfg.latency_aware and cfg.mid_fraction != pcfg.mid_fraction:
        raise ValueError(
            f"--mid_fraction={cfg.mid_fraction} does nothing: the checkpoint's fast head takes its mid observation at "
            f"mid_fraction={pcfg.mid_fraction}; drop --mid_fraction (or set it to {pcfg.mid_fraction})"
        )
    if not cfg.latency_aware or pcfg.latency_aware:  # a resumed run's checkpoint has its head already
        return None
    policy.add_latency_head(max_delay, cfg.mid_fraction, list(cfg.env.cameras))
    if not cfg.latency_warmup.steps:
        return None
    from vla_rl.latency_warmup import warm_up_latency_head

    fit = lambda demos: warm_up_latency_head(policy, demos, cfg.delay, control_dt, cfg.latency_warmup, cfg.seed,
                                             cfg.chunking.lead_steps)  # fmt: skip
    return warm_up_fast_part(cfg, policy, out, control_dt, processes, fit)


def warm_up_fast_part(cfg, policy, out: Path, control_dt: float, processes, fit) -> Path:
    """Fit the fresh fast part (a latency head, or a low-latency part) on ``cfg.latency_warmup.dataset`` with
    ``fit(demos) -> losses`` in the main process, saved as ``out/latency_warmup`` (an evaluable checkpoint, the
    run's starting point and its KL reference); the other processes then load it, so every process starts from
    the same weights whatever its device does. Returns that checkpoint's directory."""
    from vla_core.data import ChunkedDemos, open_dataset
    from vla_rl.checkpoint import save_checkpoint

    warm, saved = cfg.latency_warmup, (out / "latency_warmup").resolve()
    dataset = open_dataset(warm.dataset)  # every process checks, so none waits on a refused run
    if abs(dataset.meta.fps * control_dt - 1.0) > 1e-6:
        raise ValueError(
            f"--latency_warmup.dataset={warm.dataset} was recorded at {dataset.meta.fps} fps but the env steps every "
            f"{control_dt} s, so its delays would be counted in other steps; record the dataset at the env's rate"
        )
    if processes.index == 0:
        demos = ChunkedDemos(dataset, list(policy.config.cameras))
        losses = fit(demos)
        window = max(1, len(losses) // 10)
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        meta = {"latency_warmup": {**asdict(warm), "first_loss": round(first, 6), "last_loss": round(last, 6),
                                   "from": cfg.checkpoint}}  # fmt: skip
        save_checkpoint(saved, warm.steps, policy, meta, keep_last=1)
        print(f"fast part fitted on {warm.dataset}: loss {first:.4f} -> {last:.4f} over {warm.steps} steps (first and "
              f"last tenth)", file=sys.stderr)  # fmt: skip
    if processes.count > 1:
        processes.accelerator.wait_for_everyone()
        if processes.index != 0:
            policy.load_state_dict(load_policy(saved, device=policy.device)[0].state_dict())
    return saved
