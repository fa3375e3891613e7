"""Level-2 minibatching (Mini-Diffuser) against conventional batching, same model and data.

    python benchmarks/l2_minibatching.py              # the full run on CPU (see --help for sizes)
    python benchmarks/l2_minibatching.py --quick      # every stage at toy sizes, a few minutes
    python benchmarks/l2_minibatching.py --scale-grid # per step at real VLA scale (So400m towers, pi0-wide expert)
    python benchmarks/l2_minibatching.py --encoder small --towers trained --steps 3000 --episodes 600
                                                      # towers trained with the action expert

Both arms draw the same number of denoising samples per step, ``--batch`` (B):
conventional = B frames x 1 copy; Level-2 = B/K frames x K noised copies, each frame encoded once.

1. Per-step cost: median step time and peak memory of one training step, each configuration in
   a fresh process. Memory is a step's working memory (activations, gradients): the peak over
   the steady-state steps above the footprint after the warmup steps (peak RSS on CPU, peak
   allocated memory on a GPU), so the ~1 GB of libraries, and the optimizer state and kernel
   caches the first steps create in both arms alike, do not hide the difference (the JSON also
   keeps the warmup steps' peak). Measured over a grid of K and encoder sizes to show how the
   ratios move.
2. Time to quality: the conventional arm trains for ``--steps``; the mean of its last 3 validation
   denoising losses (held-out episodes, fixed noise and timesteps, EMA weights) is the target. The
   Level-2 arm trains with the same hyperparameters until 2 consecutive validations reach that loss,
   for at most ``--l2-max-steps`` steps; it validates every K x ``--val-every`` steps (the same
   interval in frames seen). Both use a constant learning rate after warmup, so the Level-2 arm
   may run past ``--steps`` without a schedule that has already decayed. Training seconds
   exclude validation.
3. Success: both final policies run closed loop on the task with the same evaluation seeds.

Results go to ``<--out>/l2_minibatching.json`` (``outputs/bench/l2_minibatching/l2_minibatching.json``; inside the
run's own folder since 2026-12-07, so two comparisons never overwrite each other); the last line reads
``time_ratio=<x> memory_ratio=<y> success_ratio=<z>``.

Protocol history (runs as README.md reports them):

- 2026-11-29: the first version: K = 8 and the ``large`` encoder (6 layers, 256 wide) by default,
  grid small/base/large, towers frozen; memory was the rise over the footprint just before the
  first step. One run (README.md, 2026-11-30), with K = 16: 0.27x the training time, 0.15x the
  peak memory, 0.14x per step; 1 of 50 episodes in each arm.
- 2026-11-30, chosen after that run was published: the ``xlarge`` encoder (8 layers, 384 wide) as
  the main comparison and K = 16 by default; the grid gained ``xlarge``. Runs: the default run
  (0.18x time, 0.16x memory, 0.11x per step; 2 of 50 each) and ``--steps 3000``
  (``time_ratio=0.192 memory_ratio=0.148``; 3 of 50 against 2 of 50).
- 2026-11-30: ``--towers trained`` added; the default, ``frozen``, keeps the protocol. Runs with
  trained towers on 150 demonstrations: ``--encoder base --steps 2000``
  (``time_ratio=0.438 memory_ratio=0.061``), ``--encoder small --steps 3000``
  (``time_ratio=0.531 memory_ratio=0.132``), and two more small-encoder runs (25-29% success
  trained on all 150 episodes, 2-4% with 15 held out), dropped from README.md later that day.
- 2026-11-30, an amendment after those runs were published (the old memory figure read low for
  Level-2): memory is a step's working memory, as above, measured with a fixed mmap threshold and
  ``malloc_trim``; every memory ratio above is of the old measure. Runs: the default run (0.17x
  time, 85 s against 488 s; per step 0.09x time, 0.23x memory) and
  ``--encoder small --towers trained --steps 3000 --episodes 600 --eval-episodes 200``
  (success: 30% conventional, 4% Level-2).
- 2026-12-02: no protocol change (the script now calls `vla_rl.stages`).
- 2026-12-04, an amendment before any run of it (from the issue's review of the method): the target is the
  mean of the conventional arm's last 3 validations, not its last; an arm reaches it at the first of 2
  consecutive validations at or below it (`vla-rl train --stop_consecutive`); Level-2 validates every K x
  ``--val-every`` steps, so both arms validate at the same interval in frames seen; ``success_ratio`` is
  nan when the conventional arm succeeds below 50%; the JSON adds the ratio of the processes' whole peak
  RSS (``total_memory_ratio``) beside the working-memory one; ``--seeds=0,1,2`` runs each training seed in
  its own folder (a finished one read back) and the final line gives the medians over them (nan if any
  seed's success ratio is), every seed in the JSON; ``--pretrained-encoder`` takes the towers from `vla-rl
  pretrain-encoder`'s output. One run of it (seed 0, the default pretrained towers, frozen):
  ``time_ratio=0.349 memory_ratio=0.238 success_ratio=nan`` (both arms 7 of 50: below the floor).
- 2026-12-05: ``--scale-grid`` added (the per-step grid at real VLA scale, its own JSON and last line; the
  comparison's protocol unchanged). One run, on a loaded machine: ``scale_time_ratio=0.131
  scale_memory_ratio=0.432 copies=16`` (K = 8: 0.184 and 0.469).
- 2026-12-05, before any run of it: ``--eval-episodes`` 200 by default (was 50); each arm's success counts and the
  success ratio's 95% interval (Katz) in the JSON, and over the seeds' pooled episodes; ``--conventional-only``
  runs the baseline arm alone, to choose the training length from it. The protocol of the pretrained-encoder
  comparison, and how its training length is chosen, is ``l2_minibatching_2026-12-05.md`` beside this file.
  Pilots on the 64 px encoder (seed 0): 25.5%, 23.5%, 22.5% conventional success at 800, 2,000, 4,000 steps.
- 2026-12-05, its amendment: with ``--pretrained-encoder`` the sim renders (and the policy expects) the encoder's own
  input size, not 64 px. Pilots on the 128 px encoder: 30.0%, 31.0%, 25.0% at 800, 2,000, 4,000 steps.
- 2026-12-06, its second amendment (before its results): the task moves to lift on the 64 px encoder. Pilot: 62.5%
  at 800 steps, the setting. Three seeds: ``time_ratio=0.472 memory_ratio=0.253 success_ratio=1.034`` (pooled
  success ratio 1.030 [0.944, 1.123]). The JSON adds ``trained_time_ratio``, the training time of the two
  checkpoints whose success is compared (0.633 here: Level-2 is credited at its first validation below the target,
  step 1,600, and trains on to the second, here the step cap of 2,400). Post hoc, ``--val-every 25``:
  ``time_ratio=0.355 memory_ratio=0.216 success_ratio=0.816``. Reach's Level-2 arm at S = 4,000 (64 px):
  ``time_ratio=0.505 memory_ratio=0.275 success_ratio=nan`` (14.0% against 22.5%).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering for the closed-loop evaluation
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

# Encoder sizes of the grid; the DiT is the same in all of them (Mini-Diffuser's setting: the
# condition is high-dimensional and expensive, the action expert small). By default the towers are
# frozen, as when a VLA is fine-tuned on top of a pretrained vision-language encoder; with random
# weights they cannot localize reach's 2-pixel ball, so success is then near zero in both arms.
# ``--towers trained`` trains them with the action expert: slower, and the conventional policy can
# succeed, but a tower that sees only B/K frames per step learns more slowly under Level-2.
ENCODERS = {
    "small": {"vision_width": 128, "vision_layers": 2, "text_width": 64, "text_layers": 1},
    "base": {"vision_width": 192, "vision_layers": 4, "text_width": 96, "text_layers": 2},
    "large": {"vision_width": 256, "vision_layers": 6, "text_width": 128, "text_layers": 2},
    "xlarge": {"vision_width": 384, "vision_layers": 8, "text_width": 192, "text_layers": 2},
}
DIT = {
    "dim": 64,
    "depth": 2,
    "heads": 4,
    "horizon": 16,
    "n_action_steps": 8,
    "objective": "flow",
}
# Level-2 at real VLA scale (``--scale-grid``, per step only; random weights: only cost is measured). The
# towers are SigLIP-So400m-shaped (1152 wide, 27 layers, 16 heads, patch 14, 224 px, frozen); their MLPs are
# 4 x width (4608) where So400m's are 4304, so the vision tower has 431M parameters against So400m's ~412M
# without its pooling head. The action expert has pi0's width (1024, 16 heads of 64, MLP 4 x width) and 6
# blocks where pi0's Gemma-300M expert has 18: at 18 the optimizer state alone (~6 GB) and the K = 1 steps
# of this grid would not fit the measurement into our 24 GiB and its time on 2 cores.
SCALE_ENCODER = {"vision_width": 1152, "vision_layers": 27, "patch_size": 14, "image_size": 224, "text_width": 1152,
                 "text_layers": 27}  # fmt: skip
SCALE_DIT = DIT | {"dim": 1024, "depth": 6, "heads": 16}
ENCODERS["so400m"] = SCALE_ENCODER


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="reach", help="sim task for data and closed-loop success (default: reach)")
    p.add_argument("--episodes", type=int, default=150, help="demonstrations recorded (default: 150)")
    p.add_argument("--batch", type=int, default=64, help="denoising samples per step, B (default: 64)")
    p.add_argument("--copies", type=int, default=16, help="K of the Level-2 arm (default: 16)")
    p.add_argument("--encoder", default="xlarge", choices=ENCODERS, help="encoder size of the main comparison")
    p.add_argument(
        "--towers",
        default="frozen",
        choices=("frozen", "trained"),
        help="frozen: only the towers' projections train (default); trained: the SigLIP towers train too",
    )
    p.add_argument("--steps", type=int, default=800, help="training steps of the conventional arm (default: 800)")
    p.add_argument("--val-every", type=int, default=100, help="validation period in steps (default: 100)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of both arms after warmup (default: 1e-3)")
    p.add_argument("--l2-max-steps", type=int, default=0, help="step cap of the Level-2 arm; 0 = 3 x --steps")
    p.add_argument("--eval-episodes", type=int, default=200, help="closed-loop episodes per arm (default: 200)")
    p.add_argument("--grid-copies", default="1,8,16", help="K values of the per-step grid (1 = conventional)")
    p.add_argument("--grid-encoders", default="small,base,large,xlarge", help="encoder sizes of the per-step grid")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu", help="torch device (default: cuda if present)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = all cores")
    p.add_argument("--out", default="outputs/bench/l2_minibatching", help="work and result directory")
    p.add_argument("--quick", action="store_true", help="toy sizes, to check every stage end to end")
    p.add_argument(
        "--pretrained-encoder",
        default="",
        help="towers from a local SigLIP folder (`vla-rl pretrain-encoder`'s output), loaded as a real SigLIP is; "
        "'' = random towers of --encoder's size (the mode of the runs in the history)",
    )
    p.add_argument("--seed", type=int, default=0, help="training seed of both arms (default: 0)")
    p.add_argument(
        "--seeds",
        default="",
        help="training seeds, e.g. 0,1,2: each its own run in <out>/seed<s> (a finished one is read back), then "
        "the medians over them on the final line and every seed in the JSON",
    )
    p.add_argument(
        "--reuse-conventional",
        action="store_true",
        help="keep a finished conventional arm of the same settings from an earlier run (e.g. to try another K)",
    )
    p.add_argument(
        "--conventional-only",
        action="store_true",
        help="the baseline arm alone (demonstrations, training, its success), to choose a setting from the baseline "
        "only; a later run with --reuse-conventional and the same settings keeps it (with --seeds 0,1 give the "
        "pilot --seed 0 --out <out>/seed0)",
    )
    p.add_argument(
        "--scale-grid",
        action="store_true",
        help="only the per-step grid at real VLA scale: So400m-shaped towers (frozen) under an action expert of "
        "pi0's width (see SCALE_ENCODER), K = --grid-copies, B = --scale-batch; writes l2_scale.json",
    )
    p.add_argument("--scale-batch", type=int, default=16, help="B of the real-scale grid (default: 16)")
    p.add_argument("--measure-step", help=argparse.SUPPRESS)  # internal: one per-step measurement (JSON spec)
    args = p.parse_args(argv)
    if args.quick:
        args.episodes, args.steps, args.val_every, args.eval_episodes = 8, 20, 10, 4
        args.grid_copies, args.grid_encoders, args.encoder, args.copies = "1,4", "small", "small", 4
        args.l2_max_steps = 160  # Level-2 validates every K x 10 = 40 steps: room for a few
    if args.pretrained_encoder:  # one encoder, its own size: the grid and the main comparison run it alone
        args.encoder = args.grid_encoders = "pretrained"
    if args.batch % args.copies:
        p.error(f"--copies={args.copies} must divide --batch={args.batch}")
    return args


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def policy_config(args, encoder: str):
    from vla_rl.stages import DiffusionVLAConfig

    if args.pretrained_encoder:  # its towers' sizes are its own (the grid's encoder sizes do not apply)
        return DiffusionVLAConfig(
            **DIT,
            pretrained_encoder=args.pretrained_encoder,
            freeze_towers=args.towers == "frozen",
            image_size=camera_size(args),
        )
    dit = SCALE_DIT if encoder == "so400m" else DIT
    return DiffusionVLAConfig(**dit, **ENCODERS[encoder], freeze_towers=args.towers == "frozen")


def train_config(args, encoder: str, copies: int, output_dir: Path, stop_at: float = 0.0, steps: int = 0):
    from vla_rl.stages import DatasetConfig, TrainConfig

    return TrainConfig(
        dataset=DatasetConfig(root=str(Path(args.out) / "dataset")), policy=policy_config(args, encoder),
        output_dir=str(output_dir), steps=steps or args.steps, batch_size=args.batch, l2_copies=copies, lr=args.lr,
        lr_schedule="constant_with_warmup", warmup_steps=min(100, args.steps // 10), save_every=10**9,
        log_every=25, seed=args.seed, log_with="none",
        num_threads=args.threads, val_episodes=max(2, args.episodes // 10),
        # Both arms validate at the same interval in frames seen: Level-2 sees B/K frames a step, so K times
        # fewer validations per step.
        val_every=args.val_every * copies, stop_at_val_loss=stop_at, stop_consecutive=CONSECUTIVE,
    )  # fmt: skip


# -- 1. per-step cost ----------------------------------------------------------------------------


def measure_step(spec: dict) -> dict:
    """One configuration in this (fresh) process: median step seconds and peak memory increase."""
    import torch

    from vla_core.data import ChunkedDemos, open_dataset
    from vla_rl.stages import build_policy

    args = argparse.Namespace(**spec["args"])
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    cfg = train_config(args, spec["encoder"], spec["copies"], Path(args.out) / "unused")
    dataset = open_dataset(cfg.dataset.root)
    demos = ChunkedDemos(dataset)
    torch.manual_seed(0)
    device = torch.device(args.device)
    policy = build_policy(cfg, demos, dataset).to(device).train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    frames = args.batch // spec["copies"]

    def step():
        idx = torch.randint(0, len(demos), (frames,), generator=generator)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in demos.batch(idx, DIT["horizon"]).items()}
        loss = policy(batch, generator, copies=spec["copies"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    before_first = _memory_now(device)
    for _ in range(spec["warmup"]):
        step()
    first_steps_mb = (_memory_peak(device) - before_first) / 2**20
    before_steady = _memory_now(device)  # optimizer state and kernel caches now exist in both arms alike
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = _memory_peak(device)
    return {
        "step_seconds": sorted(times)[len(times) // 2],
        "peak_mb": (peak - before_steady) / 2**20,  # a step's working memory
        "total_peak_mb": peak / 2**20,  # the process's whole peak (libraries, data, model, optimizer state)
        "first_steps_peak_mb": first_steps_mb,
    }


def _memory_now(device) -> float:
    """Bytes in use now; also resets the peak so that _memory_peak measures from here."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    # Hand freed heap back to the OS first: a step that reuses memory freed while loading the data
    # would not raise the RSS, and its peak would read too low.
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
    return _proc_status("VmRSS")


def _memory_peak(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return _proc_status("VmHWM")


def _proc_status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def per_step_grid(args) -> list[dict]:
    rows = []
    for encoder in args.grid_encoders.split(","):
        for copies in [int(k) for k in args.grid_copies.split(",")]:
            # A So400m step takes minutes on CPU: one warmup step and three timed ones.
            warmup, repeats = (1, 3) if encoder == "so400m" else (2, 3 if args.quick else 7)
            spec = {"args": vars(args) | {"measure_step": None}, "encoder": encoder, "copies": copies,
                    "warmup": warmup, "repeats": repeats}  # fmt: skip
            out = subprocess.run(
                [sys.executable, __file__, "--measure-step", json.dumps(spec)],
                # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed and
                # serves later tensors from the heap it keeps, which the RSS no longer shows.
                env=os.environ | {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:
                raise RuntimeError(f"per-step measurement {encoder} K={copies} failed:\n{out.stderr[-3000:]}")
            row = {
                "encoder": encoder,
                "copies": copies,
                "frames": args.batch // copies,
                **json.loads(out.stdout.splitlines()[-1]),
            }
            rows.append(row)
            print(f"  encoder={encoder:5s} K={copies:2d} frames={row['frames']:3d}: "
                  f"{row['step_seconds'] * 1000:7.1f} ms/step, +{row['peak_mb']:7.1f} MB peak", flush=True)  # fmt: skip
    for row in rows:  # ratios against the conventional row (K=1) of the same encoder
        base = next((r for r in rows if r["encoder"] == row["encoder"] and r["copies"] == 1), None)
        if base:
            row["time_ratio"] = row["step_seconds"] / base["step_seconds"]
            row["memory_ratio"] = row["peak_mb"] / max(base["peak_mb"], 1e-9)
            row["total_memory_ratio"] = row["total_peak_mb"] / max(base["total_peak_mb"], 1e-9)
    return rows


# -- 2. and 3. time to quality and success ------------------------------------------------------


def time_to_quality(args) -> dict:
    from vla_rl.stages import train

    out = Path(args.out)
    conventional = _reuse(args, out / "conventional") or train(
        train_config(args, args.encoder, 1, out / "conventional")
    )
    target = target_loss(conventional["val_curve"])
    # Its own target at the latest at its last validation (a mean of the last 3 can sit between two of them).
    conv_seconds = _seconds_to(conventional["val_curve"], target) or conventional["val_curve"][-1][1]
    max_steps = args.l2_max_steps or 3 * args.steps
    l2 = train(train_config(args, args.encoder, args.copies, out / "level2", stop_at=target, steps=max_steps))
    l2_seconds = _seconds_to(l2["val_curve"], target)
    return {
        "target_val_loss": target,
        "conventional": {"seconds_to_target": conv_seconds, "steps": conventional["steps"],
                         "seconds_trained": conventional["train_seconds"], "val_curve": conventional["val_curve"]},
        "level2": {
            "seconds_to_target": l2_seconds, "reached": l2_seconds is not None, "steps": l2["steps"],
            "seconds_trained": l2["train_seconds"], "val_curve": l2["val_curve"],
        },
    }  # fmt: skip


def _reuse(args, arm_dir: Path) -> dict | None:
    """The summary of a finished conventional arm trained with the same settings, if asked for and present."""
    from vla_rl.stages import config_dict

    summary, saved = arm_dir / "train_summary.json", arm_dir / "train_config.json"
    if not (args.reuse_conventional and summary.exists() and saved.exists()):
        return None
    wanted = json.loads(json.dumps(config_dict(train_config(args, args.encoder, 1, arm_dir))))
    if json.loads(saved.read_text()) != wanted:
        print("  the earlier conventional arm used other settings; training it again", flush=True)
        return None
    print(f"  reusing the conventional arm in {arm_dir}", flush=True)
    return json.loads(summary.read_text())


SUCCESS_FLOOR = 0.5  # the conventional arm's success below which success_ratio is nan
TARGET_VALIDATIONS, CONSECUTIVE = 3, 2  # the target: the mean of the last 3; reached: the first of 2 in a row


def target_loss(curve: list) -> float:
    """The conventional arm's target: the mean of its last ``TARGET_VALIDATIONS`` validation losses (its last one
    alone moves with the validation's noise)."""
    last = [loss for _, _, loss in curve[-TARGET_VALIDATIONS:]]
    return sum(last) / len(last)


def _seconds_to(curve: list, target: float) -> float | None:
    """Training seconds at the first of ``CONSECUTIVE`` validations in a row at or below target (the rule `vla-rl
    train --stop_consecutive` stops by); None if never reached."""
    from vla_rl.stages import reached_target

    index = reached_target(curve, target, CONSECUTIVE)
    return None if index is None else curve[index][1]


def success(args, arm: str) -> dict:
    from vla_rl.stages import EnvConfig, EvalConfig, evaluate

    out = Path(args.out)
    result = evaluate(EvalConfig(
        checkpoint=str(out / arm), env=EnvConfig(task=args.task, num_envs=min(50, args.eval_episodes), image_size=camera_size(args)),
        num_episodes=args.eval_episodes, seed=1000, video_episodes=0, output_dir=str(out / f"eval_{arm}"),
        device=args.device, overwrite=True,
    ))  # fmt: skip
    return {"success_rate": result["success_rate"], "ci95": result["success_ci95"],
            "successes": result["successes"], "episodes": result["episodes"]}  # fmt: skip


def camera_size(args) -> int:
    """The side of the rendered images: a pretrained encoder's own input size (rendering smaller and letting the
    encoder upsample would hide the detail it was pretrained to see), else the sim's default."""
    from vla_rl.stages import EnvConfig, check_siglip_folder

    if not args.pretrained_encoder:
        return EnvConfig.image_size
    check_siglip_folder(Path(args.pretrained_encoder))  # a bad folder: one line naming what is missing
    config = json.loads((Path(args.pretrained_encoder) / "config.json").read_text())
    return int(config["vision_config"]["image_size"])


def record_dataset(args) -> None:
    from vla_rl.stages import EnvConfig, RecordConfig, record

    root = Path(args.out) / "dataset"
    info = root / "meta" / "vla_rl_record.json"
    if info.exists():
        recorded = json.loads(info.read_text())
        env = recorded["config"]["env"]
        if (recorded["episodes"], env["task"], env["image_size"]) == (args.episodes, args.task, camera_size(args)):
            return  # the same demonstrations: another task or image size is recorded again
    record(RecordConfig(env=EnvConfig(task=args.task, num_envs=16, image_size=camera_size(args)), num_episodes=args.episodes,
                        output_dir=str(root), repo_id=f"local/{args.task}", overwrite=True))  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.measure_step:
        print(json.dumps(measure_step(json.loads(args.measure_step))))
        return
    if args.scale_grid:
        scale_grid(args)
        return
    if args.pretrained_encoder:
        try:
            camera_size(args)
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    if args.conventional_only:
        if args.seeds:  # one arm of one seed: a pilot chooses a setting from seed 0 alone
            raise SystemExit("--conventional-only trains one seed: drop --seeds, give --seed and --out <out>/seed<N>")
        conventional_pilot(args)
        return
    if not args.seeds:
        result = run_one(args)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".l2_minibatching.json.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, out / "l2_minibatching.json")
        print(f"time_ratio={result['time_ratio']:.3f} memory_ratio={result['memory_ratio']:.3f} "
              f"success_ratio={result['success_ratio']:.3f}")  # fmt: skip
        return
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        run = argparse.Namespace(
            **{**vars(args), "seed": seed, "seeds": "", "out": str(Path(args.out) / f"seed{seed}")}
        )
        done = Path(run.out) / "result.json"
        if done.exists():  # a finished seed is read back: the figure can span sessions
            print(f"seed {seed}: finished earlier, read from {done}", flush=True)
            result = json.loads(done.read_text())
        else:
            result = run_one(run)
            tmp = done.with_name(".result.json.tmp")
            tmp.write_text(json.dumps(result, indent=2))
            os.replace(tmp, done)
        results.append(result)
        print(f"seed {seed}: time_ratio={result['time_ratio']:.3f} memory_ratio={result['memory_ratio']:.3f} "
              f"success_ratio={result['success_ratio']:.3f}", flush=True)  # fmt: skip
    pooled = pool_seeds(results)
    if "success_pooled" in pooled:
        both = pooled["success_pooled"]
        print("success over the seeds' episodes: " + ", ".join(
            f"{arm} {both[arm]['successes']}/{both[arm]['episodes']} [{both[arm]['success_ci95'][0]:.3f}, "
            f"{both[arm]['success_ci95'][1]:.3f}]" for arm in ("conventional", "level2"))
            + f"; ratio {both['ratio']:.3f} [{both['ratio_ci95'][0]:.3f}, {both['ratio_ci95'][1]:.3f}]", flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".l2_minibatching.json.tmp"
    tmp.write_text(json.dumps(pooled, indent=2))
    os.replace(tmp, out / "l2_minibatching.json")
    print(f"time_ratio={pooled['time_ratio']:.3f} memory_ratio={pooled['memory_ratio']:.3f} "
          f"success_ratio={pooled['success_ratio']:.3f}")  # fmt: skip


def scale_grid(args) -> dict:
    """The per-step grid at real VLA scale (``--scale-grid``): So400m-shaped towers, frozen, under an action expert
    of pi0's width, at B = ``--scale-batch``; written to ``<--out>/l2_scale.json``."""
    import torch

    ignored = [flag for flag, given in (("--towers trained", args.towers != "frozen"), ("--pretrained-encoder",
               bool(args.pretrained_encoder)), ("--seeds", bool(args.seeds))) if given]  # fmt: skip
    if ignored:  # the grid measures random frozen So400m towers, one process per row: these would not apply
        raise SystemExit(f"--scale-grid measures frozen random So400m-shaped towers once: drop {', '.join(ignored)}")
    run = argparse.Namespace(**{**vars(args), "batch": args.scale_batch, "grid_encoders": "so400m",
                                "towers": "frozen", "pretrained_encoder": ""})  # fmt: skip
    bad = [k for k in run.grid_copies.split(",") if run.batch % int(k)]
    if bad:
        raise SystemExit(f"--scale-batch={run.batch} is not a multiple of K={','.join(bad)}: pass a multiple of all")
    started = time.time()
    print(f"[1/2] demonstrations: {args.episodes} episodes of {args.task}", flush=True)
    record_dataset(run)
    print(f"[2/2] per-step cost at real VLA scale, B={run.batch} denoising samples per step", flush=True)
    rows = per_step_grid(run)
    result = {"encoder": SCALE_ENCODER, "dit": SCALE_DIT, "towers": "frozen", "batch_denoising_samples": run.batch,
              "device": args.device, "torch_threads": args.threads or os.cpu_count(), "torch": torch.__version__,
              "per_step": rows, "minutes": round((time.time() - started) / 60, 1)}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".l2_scale.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "l2_scale.json")
    top = max(rows, key=lambda r: r["copies"])
    print(
        f"scale_time_ratio={top['time_ratio']:.3f} scale_memory_ratio={top['memory_ratio']:.3f} copies={top['copies']}"
    )
    return result


def conventional_pilot(args) -> dict:
    """The conventional arm alone (``--conventional-only``): trained (or kept, with ``--reuse-conventional``) and
    evaluated; written to ``<out>/conventional_pilot.json``. A setting chosen from this looks at no Level-2 result."""
    from vla_rl.stages import train

    out = Path(args.out)
    print(f"[1/3] demonstrations: {args.episodes} episodes of {args.task}", flush=True)
    record_dataset(args)
    encoder = args.pretrained_encoder or args.encoder
    print(f"[2/3] the conventional arm: encoder={encoder}, B={args.batch}, {args.steps} steps", flush=True)
    if not args.reuse_conventional and (out / "conventional").exists():
        import shutil

        shutil.rmtree(out / "conventional")
    trained = _reuse(args, out / "conventional") or train(train_config(args, args.encoder, 1, out / "conventional"))
    print("[3/3] its closed-loop success", flush=True)
    rate = success(args, "conventional")
    result = {"task": args.task, "steps": args.steps, "seed": args.seed, "eval_episodes": args.eval_episodes,
              "target_val_loss": target_loss(trained["val_curve"]), "val_curve": trained["val_curve"],
              "success": rate, "args": {k: v for k, v in vars(args).items() if k != "measure_step"}}  # fmt: skip
    tmp = out / ".conventional_pilot.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "conventional_pilot.json")
    low, high = rate["ci95"]
    print(f"conventional_success={rate['success_rate']:.3f} ci95=[{low:.3f},{high:.3f}] "
          f"target_val_loss={result['target_val_loss']:.4f} steps={args.steps}")  # fmt: skip
    return result


def pool_seeds(results: list[dict]) -> dict:
    """The medians over seeds of each ratio (nan when any seed's is nan: a seed below the success floor), and
    every seed's result."""
    import math
    import statistics

    def median(key: str) -> float:
        values = [r[key] for r in results]
        return float("nan") if any(math.isnan(v) for v in values) else statistics.median(values)

    keys = ("time_ratio", "memory_ratio", "total_memory_ratio", "success_ratio", "per_step_time_ratio")
    pooled = {**{key: median(key) for key in keys}, "trained_time_ratio": statistics.median(map(trained_time_ratio, results)),
              "seeds": [r["seed"] for r in results], "per_seed": results}  # fmt: skip
    if all("successes" in r.get("success", {}).get("level2", {}) for r in results):  # results from 2026-12-05 on
        from vla_rl.stages import pooled_rate, rate_ratio_interval

        arms = {arm: pooled_rate([{"successes": r["success"][arm]["successes"],
                                   "episodes": r["success"][arm]["episodes"]} for r in results])
                for arm in ("conventional", "level2")}  # fmt: skip
        conv, l2 = arms["conventional"], arms["level2"]
        above_floor = conv["success_rate"] >= SUCCESS_FLOOR  # below it the ratio says nothing, as per seed
        ratio = l2["success_rate"] / conv["success_rate"] if above_floor else float("nan")
        interval = (rate_ratio_interval(l2["successes"], l2["episodes"], conv["successes"], conv["episodes"])
                    if above_floor else (float("nan"), float("nan")))  # fmt: skip
        pooled["success_pooled"] = {**arms, "ratio": ratio, "ratio_ci95": list(interval)}
    return pooled


def trained_time_ratio(result: dict) -> float:
    """Level-2's training seconds over the conventional arm's, each to the checkpoint whose success is measured (its
    last step). ``time_ratio`` credits an arm at the first of two validations at or below the target, but training
    stops at the second (or at the step cap), so the checkpoints compared for success trained this much longer."""
    quality = result["time_to_quality"]
    conventional = quality["conventional"]
    # Results written before 2026-12-06 lack the conventional arm's seconds_trained: its run ends on a validation.
    seconds = conventional["seconds_trained"] if "seconds_trained" in conventional else conventional["val_curve"][-1][1]
    return quality["level2"]["seconds_trained"] / seconds


def run_one(args) -> dict:
    """Every stage for one training seed in ``args.out``: the result (written by the caller)."""
    import torch

    from vla_rl.stages import rate_ratio_interval

    out = Path(args.out)
    for arm in ("level2",) if args.reuse_conventional else ("conventional", "level2"):  # a rerun starts afresh
        if (out / arm).exists():
            import shutil

            shutil.rmtree(out / arm)
    started = time.time()
    print(f"[1/4] demonstrations: {args.episodes} episodes of {args.task}", flush=True)
    record_dataset(args)
    print(f"[2/4] per-step cost at B={args.batch} denoising samples per step", flush=True)
    grid = per_step_grid(args)
    print(
        f"[3/4] time to quality: encoder={args.encoder}, B={args.batch}, K={args.copies}, {args.steps} steps",
        flush=True,
    )
    quality = time_to_quality(args)
    print("[4/4] closed-loop success", flush=True)
    success_conv, success_l2 = success(args, "conventional"), success(args, "level2")

    main_row = next(r for r in grid if r["encoder"] == args.encoder and r["copies"] == args.copies)
    l2_seconds = quality["level2"]["seconds_to_target"]
    time_ratio = (l2_seconds if l2_seconds is not None else float("inf")) / quality["conventional"]["seconds_to_target"]
    conv_rate = success_conv["success_rate"]
    # Below the floor the ratio says nothing about parity (both arms fail): printed as nan, both rates in the JSON.
    success_ratio = success_l2["success_rate"] / conv_rate if conv_rate >= SUCCESS_FLOOR else float("nan")
    ratio_ci95 = rate_ratio_interval(success_l2["successes"], success_l2["episodes"], success_conv["successes"],
                                     success_conv["episodes"])  # fmt: skip
    result = {
        "task": args.task, "device": args.device, "batch_denoising_samples": args.batch, "copies": args.copies,
        "encoder": {"name": args.encoder, "towers": args.towers,
                    **ENCODERS.get(args.encoder, {"pretrained_encoder": args.pretrained_encoder})}, "dit": DIT, "steps": args.steps,
        "torch_threads": args.threads or os.cpu_count(), "torch": torch.__version__,
        "per_step": grid, "time_to_quality": quality,
        "success": {"conventional": success_conv, "level2": success_l2, "eval_episodes": args.eval_episodes, "seed": 1000},
        "time_ratio": time_ratio, "memory_ratio": main_row["memory_ratio"], "success_ratio": success_ratio,
        "success_ratio_ci95": list(ratio_ci95) if conv_rate >= SUCCESS_FLOOR else [float("nan")] * 2,
        "total_memory_ratio": main_row["total_memory_ratio"],
        "per_step_time_ratio": main_row["time_ratio"], "minutes": round((time.time() - started) / 60, 1),
        "args": {k: v for k, v in vars(args).items() if k != "measure_step"}, "seed": args.seed,
    }  # fmt: skip
    result["trained_time_ratio"] = trained_time_ratio(result)
    print(f"target validation loss {quality['target_val_loss']:.4f}: conventional "
          f"{quality['conventional']['seconds_to_target']:.0f} s, level-2 "
          f"{'not reached' if l2_seconds is None else f'{l2_seconds:.0f} s'}; success "
          f"{conv_rate:.0%} vs {success_l2['success_rate']:.0%}, success ratio 95% interval "
          f"[{result['success_ratio_ci95'][0]:.3f}, {result['success_ratio_ci95'][1]:.3f}]; the evaluated "
          f"checkpoints trained {quality['conventional']['seconds_trained']:.0f} s and "
          f"{quality['level2']['seconds_trained']:.0f} s")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
