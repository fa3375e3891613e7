"""The `vla-rl` command line: one entry point, one draccus dataclass config per command.

    vla-rl <command> [--config_path=configs/<file>.yaml] [--dotted.key=value ...]
    vla-rl bench <benchmark> [--key=value ...]

Values come from the dataclass defaults, then the YAML file, then the command line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Headless rendering works out of the box with EGL (Mesa on CPU, the driver on a GPU machine).
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])


@dataclass
class Command:
    summary: str
    # "module:ConfigClass", imported only when the command runs, so `vla-rl --help` stays fast;
    # empty for a command that only groups subcommands.
    config_path: str
    run: Callable[[Any], Any] | None
    subcommands: dict[str, Command] = field(default_factory=dict)  # `vla-rl <command> <sub>`

    def config(self) -> type:
        """The command's config dataclass."""
        import importlib

        module, _, name = self.config_path.partition(":")
        return getattr(importlib.import_module(module), name)


def _policy_from_checkpoint(path: str, device: str, tokenizer_dir: str = "", steer_dir: str = "",
                            steer_mode: str = "gated", steer_weight: float = 0.0, steer_best_of: int = 0):  # fmt: skip
    """The serve node's policy loader; runs inside its inference worker, so a bad checkpoint is reported there.
    With ``steer_dir`` the policy is steered there too, RL² or DSRL (`vla_rl.steering.load_steered`)."""
    from vla_rl.checkpoint import load_policy

    policy = load_policy(path, device=device, tokenizer_dir=tokenizer_dir)[0]
    if steer_dir:
        from vla_rl.steering import load_steered

        policy = load_steered(policy, steer_dir, steer_mode, steer_weight or None, steer_best_of or None)
    return policy


def _loader(cfg):
    """`_policy_from_checkpoint` bound to a serve or policy-server config."""
    from functools import partial

    return partial(_policy_from_checkpoint, cfg.checkpoint, cfg.device, cfg.tokenizer_dir, cfg.steer_dir,
                   cfg.steer_mode, cfg.steer_weight, cfg.steer_best_of)  # fmt: skip


def _run_serve(cfg):
    import json

    from robot_bridge.node import serve

    # `--ros-args ...` (ROS parameter overrides) was kept out of the config parse; rclpy reads it here.
    ros_args = sys.argv[sys.argv.index("--ros-args") :] if "--ros-args" in sys.argv else None
    summary = serve(cfg, _loader(cfg), ros_args)
    print(json.dumps(summary, indent=2))


def _run_policy_server(cfg):
    from robot_bridge.policy_server import run_policy_server

    run_policy_server(cfg, _loader(cfg))


def _run_bench_bridge(cfg):
    from robot_bridge.bench import bench_bridge, format_summary

    print(format_summary(bench_bridge(cfg)))


def _run_record(cfg):
    import json

    from vla_rl.record import record

    summary = record(cfg)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))


def _run_train(cfg):
    from vla_rl.train import train

    summary = train(cfg)
    print(
        f"trained {summary['steps']} steps, final loss {summary['final_loss']:.4f}; checkpoint {summary['checkpoint']}"
    )


def _run_eval(cfg):
    from pathlib import Path

    from vla_rl.eval import evaluate

    result = evaluate(cfg)
    print((Path(cfg.output_dir) / "summary.md").read_text())
    if "rerun" in result:
        again = result["rerun"]
        same = len(result["per_episode"]) - len(again["differing"])
        print(f"rerun of {again['record']}: {same} of {len(result['per_episode'])} episodes with the same outcome and "
              f"length; packages that differ: {again['versions_differ'] or 'none'}")  # fmt: skip


def _run_report(cfg):
    from pathlib import Path

    from vla_rl.eval_report import report

    report(cfg)
    print((Path(cfg.output_dir) / "report.md").read_text())


def _run_finetune(cfg):
    from vla_rl.finetune import finetune

    summary = finetune(cfg)
    before, after = summary["initial_success"], summary["final_success"]
    change = (
        ""
        if before is None
        else f"; success {before:.2f} -> {after:.2f} on {summary['evals'][-1]['episodes']} episodes"
    )
    print(
        f"{summary['algo']}: {summary['iterations']} iterations, {summary['env_steps']} env steps{change}; peak "
        f"memory {summary['peak_memory']['gib']:.2f} GiB; {cfg.output_dir}/finetune_summary.json"
    )


def _run_steer(cfg):
    from vla_rl.steer import run_steer

    summary = run_steer(cfg)
    gate = summary["gate"]
    print(
        f"steer: {summary['episodes']} episodes ({summary['episode_success_rate']:.0%} successful), "
        f"{summary['requests']} requests ({summary['request_success_rate']:.0%} in successful episodes); gate "
        f"threshold {gate['threshold']:.3f} (held out: AUC {gate['auc']}, failures caught {gate['tpr']}, successes "
        f"steered {gate['fpr']}); flow loss {summary['flow_loss']['first']} -> {summary['flow_loss']['last']}; "
        f"weight {summary['weights']['chosen']}, best of {summary['weights']['best_of']} (gated success by pair: "
        f"{summary['weights']['success']}); "
        f"{cfg.output_dir}/steering\n"
        f"evaluate: vla-rl eval --checkpoint={cfg.checkpoint} --steer.dir={cfg.output_dir}/steering --steer.mode=gated"
    )


def _run_dsrl(cfg):
    from vla_rl.dsrl import run_dsrl

    summary = run_dsrl(cfg)
    rates = summary["eval"]
    print(
        f"dsrl: {cfg.iterations} iterations; held out ({cfg.eval_episodes} episodes each): frozen "
        f"{rates['base']['success_rate']:.3f} {rates['base']['ci95']}, DSRL {rates['dsrl']['success_rate']:.3f} "
        f"{rates['dsrl']['ci95']}; gain {summary['gain_points']:+.1f} points; {cfg.output_dir}/dsrl_summary.json"
    )


def _run_pretrain_encoder(cfg):
    from vla_rl.pretrain_encoder import pretrain_encoder

    summary = pretrain_encoder(cfg)
    probe = summary["probe_error_cm"]
    print(
        f"pretrained towers in {cfg.output_dir} ({summary['frames']} frames, {summary['seconds']} s); probe of the "
        f"task object's position on {summary['held_out']} held-out frames: {probe['pretrained']} cm (random towers "
        f"{probe['random_towers']} cm; per task "
        + ", ".join(f"{task} {cm}" for task, cm in probe.get("pretrained_per_task", {}).items())
        + f"); use --policy.pretrained_encoder={cfg.output_dir}"
    )


def _run_probe_localization(cfg):
    from vla_rl.probe_localization import final_line, probe_localization

    report = probe_localization(cfg)
    for name, row in {**report["encoders"], "mean_baseline": report["mean_baseline"]}.items():
        print(f"{name}: median {row['median_cm']} cm, mean {row['mean_cm']} cm, RMSE per axis {row['rmse_cm']} cm")
    print(f"{report['frames']['held_out']} held-out frames; {cfg.output_dir}/localization.json")
    print(final_line(report))


def _run_train_prm(cfg):
    from vla_rl.train_prm import train_prm

    summary = train_prm(cfg)
    held = summary["held_out"]
    measured = (
        f"; held out {len(held['episodes'])} episodes: Spearman's rank correlation of progress with time "
        f"{held['spearman_mean']} (min {held['spearman_min']}), last frame above first in "
        f"{held['last_above_first']}/{held['successful']}"
        if held and held["successful"]
        else ""
    )
    print(f"process reward model trained on {len(summary['train']['episodes'])} episodes, final loss "
          f"{summary['train']['final_loss']:.4f}{measured}; {cfg.output_dir} (use it with vla-rl finetune "
          f"--reward.process_model={cfg.output_dir})")  # fmt: skip


def _run_quickstart(cfg):
    from vla_rl.quickstart import quickstart

    quickstart(cfg)


def _run_bench_delay(cfg):
    from vla_rl.bench_delay import bench_delay, format_summary

    print(format_summary(bench_delay(cfg)))


def _run_bench_switch(cfg):
    from vla_rl.bench_switch import bench_switch, format_summary

    print(format_summary(bench_switch(cfg)))


def _run_bench_rl(cfg):
    from vla_rl.bench_rl import bench_rl, format_summary

    print(format_summary(bench_rl(cfg)))


def _run_bench_steering(cfg):
    from vla_rl.bench_steering import bench_steering, final_line

    report = bench_steering(cfg)
    if cfg.seeds:  # each seed's line, then the pooled cells and line
        for seed, seed_report in report["seeds"].items():
            print(f"seed {seed}: {final_line(seed_report)}")
        for name, h in report["headroom"].items():
            print(f"headroom {name}: base {h['mean']:.2f} ({h['headroom_points']:+.1f} points, mean of the seeds), "
                  f"kept on seeds {h['kept_on']}")  # fmt: skip
        for cell, arms in report.get("cells", {}).items():
            print(f"{cell} (pooled): " + ", ".join(f"{arm} {r['success_rate']:.3f} [{r['success_ci95'][0]:.3f}, "
                                                   f"{r['success_ci95'][1]:.3f}]" for arm, r in arms.items()))  # fmt: skip
        print(f"{final_line(report)} seeds={','.join(str(s) for s in cfg.seeds)}")
        return
    for name, h in report["headroom"].items():
        print(f"headroom {name}: base {h['mean']:.2f}, best of {h['draws']} {h['best_of_draws']:.2f} "
              f"({h['headroom_points']:+.1f} points, {h['states_never']}/{h['states']} states never succeed)"
              + (" kept" if h["kept"] else ""))  # fmt: skip
    if not report["steering_ran"]:
        why = "--headroom_only" if cfg.headroom_only else "fewer than 2 variations passed the headroom gate"
        folder = Path(cfg.output_dir) / "quick" if cfg.quick else Path(cfg.output_dir)
        print(f"no steering arm ran ({why}); the table is in {folder / 'steering.json'}")
        print(final_line(report))
        return
    for cell, arms in report["cells"].items():
        rates = ", ".join(f"{arm} {r['success_rate']:.2f} [{r['success_ci95'][0]:.2f}, {r['success_ci95'][1]:.2f}]"
                          for arm, r in arms.items())  # fmt: skip
        print(f"{cell}: {rates}")
    timing = report["timing"]
    print(f"base in distribution {report['base_in_distribution']:.2f} (floor 0.70 {'met' if report['base_floor_met'] else 'NOT met'}); "
          f"per-chunk inference {timing['base_ms']} ms, gated x{timing['gated_over_base']}, always "
          f"x{timing['always_over_base']}, DSRL x{timing.get('dsrl_over_base')}; {report['minutes']} min")  # fmt: skip
    if cfg.quick:
        print("quick run: toy sizes, the numbers say nothing about steering")
    print(final_line(report))


def _run_bench_latency_rl(cfg):
    from vla_rl.bench_latency_rl import bench_latency_rl, format_summary

    print(format_summary(bench_latency_rl(cfg)))


def _run_bench_robot_parity(cfg):
    from vla_rl.bench_robot_parity import bench_robot_parity, format_summary

    print(format_summary(bench_robot_parity(cfg)))


def _run_bench_delay_beyond(cfg):
    from vla_rl.bench_delay_beyond import bench_delay_beyond, format_summary

    print(format_summary(bench_delay_beyond(cfg)))


def _run_bench_delay_calibration(cfg):
    from vla_rl.bench_delay_calibration import bench_delay_calibration, format_summary

    print(format_summary(bench_delay_calibration(cfg)))


def _run_bench_render_soak(cfg):
    from vla_rl.bench_render_soak import bench_render_soak, format_summary

    print(format_summary(bench_render_soak(cfg)))


def _run_bench_ray(cfg):
    from vla_rl.bench_ray import bench_ray, format_summary

    print(format_summary(bench_ray(cfg)))


def _run_bench_libero(cfg):
    from vla_rl.bench_libero import bench_libero, format_summary

    print(format_summary(bench_libero(cfg)))


def _run_bench_ar_decoding(cfg):
    from vla_rl.bench_ar_decoding import bench_ar_decoding, format_summary

    print(format_summary(bench_ar_decoding(cfg)))


def _run_bench_sim(cfg):
    from vla_rl.bench import bench_sim, format_summary

    print(format_summary(bench_sim(cfg)))


def _run_sim_robot(cfg):
    import json

    from vla_rl.sim_robot import run_sim_robot

    summary = run_sim_robot(cfg)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    print(f"sim robot: {summary['episodes_done']} episodes, {summary['successes']} successes, "
          f"{summary['steps']} steps at {summary['realtime_factor']}x real time")  # fmt: skip


def _run_record_ros(cfg):
    import json

    from robot_bridge.record import record_ros

    summary = record_ros(cfg)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    print(
        f"recorded {summary['messages']} messages on {len(summary['topics'])} topics in {summary['seconds']} s: {summary['output']}"
    )


def _run_convert(cfg):
    import json

    from robot_bridge.convert import convert

    summary = convert(cfg)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    print(f"converted {summary['frames']} frames in {summary['episodes']} episodes into {summary['dataset']}")


COMMANDS: dict[str, Command] = {
    "record": Command(
        "roll out the scripted expert and write a LeRobotDataset (v3)", "vla_rl.record:RecordConfig", _run_record
    ),
    "train": Command(
        "train a diffusion policy by imitation on a LeRobotDataset", "vla_rl.train:TrainConfig", _run_train
    ),
    "finetune": Command(
        "improve an imitation checkpoint with RL (PPO or GRPO) in the batched simulator",
        "vla_rl.finetune:FinetuneConfig",
        _run_finetune,
    ),
    "eval": Command("closed-loop success rate, video and JSON of a checkpoint", "vla_rl.eval:EvalConfig", _run_eval),
    "report": Command(
        "evaluation records side by side per suite and task, beside published LIBERO figures; two compared paired",
        "vla_rl.eval_report:ReportConfig",
        _run_report,
    ),
    "quickstart": Command(
        "record -> train -> eval on the default lift task", "vla_rl.quickstart:QuickstartConfig", _run_quickstart
    ),
    "train-prm": Command(
        "train a process reward model (progress in [0, 1]) on a LeRobotDataset, for finetune --reward.process_model",
        "vla_rl.train_prm:TrainPRMConfig",
        _run_train_prm,
    ),
    "steer": Command(
        "latent steering (RL²) of a frozen flow policy: collect its rollouts, train the critic, the RL flow policy and "
        "the failure predictor offline, choose the weight and best-of-N; evaluate with eval --steer.dir",
        "vla_rl.steer:SteerConfig",
        _run_steer,
    ),
    "dsrl": Command(
        "DSRL: soft actor-critic over the initial noise of a frozen flow policy, then both evaluated",
        "vla_rl.dsrl:DSRLConfig",
        _run_dsrl,
    ),
    "probe-localization": Command(
        "can a policy's vision front end find the task's object? a linear head on each policy type's readout regresses "
        "the object relative to the end effector on expert frames: the held-out error, against predicting the mean",
        "vla_rl.probe_localization:ProbeLocalizationConfig",
        _run_probe_localization,
    ),
    "pretrain-encoder": Command(
        "pretrain SigLIP-style towers on the suite's scenes (object positions, task identity), saved as "
        "--policy.pretrained_encoder loads them",
        "vla_rl.pretrain_encoder:PretrainEncoderConfig",
        _run_pretrain_encoder,
    ),
    "sim-robot": Command(
        "a MuJoCo-simulated arm as a ROS 2 node (joint states, images, commands or joint trajectories)",
        "vla_rl.sim_robot:SimRobotConfig",
        _run_sim_robot,
    ),
    "record-ros": Command(
        "record ROS 2 topics into an MCAP file", "robot_bridge.record:RecordRosConfig", _run_record_ros
    ),
    "convert": Command(
        "convert an MCAP recording of the robot into a LeRobotDataset (v3)",
        "robot_bridge.convert:ConvertConfig",
        _run_convert,
    ),
    "serve": Command(
        "run a checkpoint as a ROS 2 node: sensors in, safe commands out at the control rate (or a trajectory a chunk)",
        "robot_bridge.config:ServeConfig",
        _run_serve,
    ),
    "policy-server": Command(
        "serve a checkpoint's inference to a robot on another machine (`serve --inference=remote`) over gRPC",
        "robot_bridge.policy_server:PolicyServerConfig",
        _run_policy_server,
    ),
    "bench": Command(
        "benchmarks: `bench sim` (env-steps/s), `bench bridge` (ROS 2 latency), `bench delay` (success under "
        "delay), `bench rl` (RL fine-tuning gains), `bench latency-rl` (ARLI), `bench delay-calibration` (their task and delay), `bench robot-parity` (the "
        "latency model against a served robot), `bench delay-beyond` (a robot slower than the policy was trained for), `bench ray` (asynchronous Ray rollouts), `bench render-soak` (native crashes of the renderer), "
        "`bench libero` (LIBERO against LeRobot's evaluator), `bench ar-decoding` (token decoding speed), `bench switch` (instructions that change mid-task)",
        "",
        None,
        {
            "sim": Command(
                "env-steps/s of each sim backend vs raw mujoco.rollout and gymnasium AsyncVectorEnv",
                "vla_rl.bench:BenchSimConfig",
                _run_bench_sim,
            ),
            "bridge": Command(
                "ROS 2 bridge: deadline misses, jitter and added latency vs raw rclpy ping-pong",
                "robot_bridge.bench:BenchBridgeConfig",
                _run_bench_bridge,
            ),
            "delay": Command(
                "success under inference delay: a policy trained with the delay augmentation vs a plain one",
                "vla_rl.bench_delay:BenchDelayConfig",
                _run_bench_delay,
            ),
            "rl": Command(
                "RL fine-tuning: PPO and GRPO gains over an imitation checkpoint on one env-step budget",
                "vla_rl.bench_rl:BenchRLConfig",
                _run_bench_rl,
            ),
            "steering": Command(
                "steering a frozen flow policy out of distribution: RL² (gated, always) and DSRL against the base",
                "vla_rl.bench_steering:BenchSteeringConfig",
                _run_bench_steering,
            ),
            "switch": Command(
                "instructions that change mid-task (SwitchVLA): replanning through the latency protocol vs the next chunk",
                "vla_rl.bench_switch:BenchSwitchConfig",
                _run_bench_switch,
            ),
            "delay-calibration": Command(
                "the latency benchmarks' task and delay, chosen from their baseline arms by the fixed protocol",
                "vla_rl.bench_delay_calibration:BenchDelayCalibrationConfig",
                _run_bench_delay_calibration,
            ),
            "latency-rl": Command(
                "latency-aware RL (ARLI) vs naive RL under inference delay, no-delay RL and training-time RTC",
                "vla_rl.bench_latency_rl:BenchLatencyRLConfig",
                _run_bench_latency_rl,
            ),
            "robot-parity": Command(
                "one checkpoint served to the sim robot over ROS 2 and evaluated under its latency trace, paired",
                "vla_rl.bench_robot_parity:BenchRobotParityConfig",
                _run_bench_robot_parity,
            ),
            "delay-beyond": Command(
                "a robot 1.5x slower than its policy was trained for: what serve's delay clamp costs on the sim robot",
                "vla_rl.bench_delay_beyond:BenchDelayBeyondConfig",
                _run_bench_delay_beyond,
            ),
            "render-soak": Command(
                "the camera renderer for hours as fine-tuning with periodic evaluations uses it: native crashes",
                "vla_rl.bench_render_soak:BenchRenderSoakConfig",
                _run_bench_render_soak,
            ),
            "ray": Command(
                "Ray on a two-node local cluster: asynchronous over synchronous rollouts, a worker killed mid-run",
                "vla_rl.bench_ray:BenchRayConfig",
                _run_bench_ray,
            ),
            "libero": Command(
                "vla-rl eval against LeRobot's evaluator on LIBERO, step by step: agreement and throughput",
                "vla_rl.bench_libero:BenchLiberoConfig",
                _run_bench_libero,
            ),
            "ar-decoding": Command(
                "the autoregressive VLA's decoding: batched with a key-value cache vs sequential without one",
                "vla_rl.bench_ar_decoding:BenchARDecodingConfig",
                _run_bench_ar_decoding,
            ),
        },
    ),
}

OVERVIEW = """usage: vla-rl <command> [--config_path=FILE.yaml] [--key=value ...] [--help]

Fine-tune vision-language-action policies in simulation and deploy them to robots.

commands:
{commands}

configuration:
  Every command reads a typed config. Defaults come from the code, then an optional YAML file
  (--config_path=configs/train.yaml), then dotted overrides (--policy.horizon=16 --env.num_envs=8).
  `vla-rl <command> --help` lists every field with its meaning and default.

examples:
  vla-rl quickstart
  vla-rl record --num_episodes=200 --output_dir=outputs/lift_demos
  vla-rl train --dataset.root=outputs/lift_demos --output_dir=outputs/lift_policy --steps=8000
  vla-rl train --output_dir=outputs/lift_policy --resume=true
  vla-rl eval --checkpoint=outputs/lift_policy --num_episodes=100 --chunking.merge=ensemble
  vla-rl finetune --checkpoint=outputs/lift_policy --algo=grpo --output_dir=outputs/lift_grpo
  vla-rl train-prm --dataset.root=outputs/lift_demos --output_dir=outputs/lift_prm
  vla-rl finetune --checkpoint=outputs/lift_policy --reward.process_model=outputs/lift_prm
  vla-rl bench sim --num_envs=[1,16] --steps=50
"""


def _overview() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    return OVERVIEW.format(commands="\n".join(lines))


def _command(name: str) -> Command:
    """The command called ``name``: one word, or ``"<command> <subcommand>"``."""
    first, *rest = name.split()
    cmd = COMMANDS[first]
    return cmd.subcommands[rest[0]] if rest else cmd


def parse_config(name: str, args: list[str]):
    """Parse ``args`` into the command's config; bad keys or values stop with one line of error.

    name: a command (``"train"``) or a command and subcommand (``"bench sim"``).

    Layers, each over the one before: the command's own defaults, the YAML file of
    ``--config_path``, the dotted overrides. Overriding one nested field keeps its siblings (see
    :func:`_with_defaults`).
    """
    import tempfile

    import draccus
    import yaml

    config_cls = _command(name).config()
    if any(a in ("-h", "--help") for a in args):
        from draccus.argparsing import ArgumentParser

        ArgumentParser(config_class=config_cls, prog=f"vla-rl {name}", preferred_help="inline",
                       formatter_class=_plain_text_help()).parse_args(["--help"])  # fmt: skip
    try:
        args, config_path = _split_config_path(args)
        args = _renamed_args(config_cls, args, name)
        base = _with_defaults(config_cls, config_path, args, name)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="vla-rl-defaults-") as layered:
            yaml.safe_dump(base, layered)
            layered.flush()
            return draccus.parse(config_cls, config_path=layered.name, args=args, prog=f"vla-rl {name}",
                                 exit_on_error=False)  # fmt: skip
    except BaseException as err:  # draccus raises argparse errors, DecodingError and SystemExit
        if isinstance(err, KeyboardInterrupt):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        raise SystemExit(f"vla-rl {name}: error: {message}. See `vla-rl {name} --help` for the valid fields.")


def _cli_pairs(args: list[str]) -> list[tuple[str, str]]:
    """(dotted key, value) of each override, written ``--key=value`` or ``--key value``."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            key, _, value = arg[2:].partition("=")
            pairs.append((key, value))
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((arg[2:], args[i + 1]))
            i += 1
        i += 1
    return pairs


def _split_config_path(args: list[str]) -> tuple[list[str], str | None]:
    """(args without ``--config_path``, its value or None)."""
    rest, path = [], None
    it = iter(args)
    for arg in it:
        if arg.startswith("--config_path="):
            path = arg.split("=", 1)[1]
        elif arg == "--config_path":
            path = next(it, None)
            if path is None or path.startswith("--"):
                raise ValueError("--config_path needs a YAML file: --config_path=configs/<command>.yaml")
        else:
            rest.append(arg)
    return rest, path


def _has_field(config: Any, dotted: str) -> bool:
    """Whether the config (an instance) has the dotted field ``dotted``."""
    import dataclasses

    for part in dotted.split("."):
        if not dataclasses.is_dataclass(config) or part not in {f.name for f in dataclasses.fields(config)}:
            return False
        config = getattr(config, part)
    return True


def _notice(name: str):
    return lambda line: print(f"vla-rl {name}: {line}", file=sys.stderr)


def _renamed_args(config_cls: type, args: list[str], name: str) -> list[str]:
    """``args`` with the old name of a renamed field (`vla_core.renamed`) written as its new one. An old name
    whose new field this command lacks (it never read it) is dropped, with a notice, for the same release."""
    from vla_core.renamed import RENAMED, ignored_line, renamed_line

    defaults, out, i = config_cls(), [], 0
    while i < len(args):
        arg, i = args[i], i + 1
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if key not in RENAMED or _has_field(defaults, key):
            out.append(arg)
            continue
        new, until = RENAMED[key]
        if any(a == f"--{new}" or a.startswith(f"--{new}=") for a in args):  # given under its new name: that wins
            _notice(name)(f"{key} is ignored: {new} is given too")
            i += "=" not in arg and i < len(args) and not args[i].startswith("--")
        elif _has_field(defaults, new):
            _notice(name)(renamed_line(key, new, until))
            out.append(f"--{new}" + (arg[arg.index("=") :] if "=" in arg else ""))
        elif _has_field(defaults, key.rpartition(".")[0] or key):
            _notice(name)(ignored_line(key, new, until))
            i += "=" not in arg and i < len(args) and not args[i].startswith("--")  # its value, too
        else:
            out.append(arg)
    return out


def _with_defaults(config_cls: type, config_path: str | None, args: list[str], name: str = "") -> dict:
    """The command's defaults with the YAML file over them, as one nested dict for draccus to start from.

    draccus decodes a nested config from the keys it was given alone: ``--env.task=reach`` alone
    would rebuild ``env`` from ``EnvConfig``'s class defaults, silently dropping the command's own
    (``vla-rl eval`` has 50 worlds, not 16). Starting from every default avoids that. Where a
    choice field changes its ``type`` (``--policy.type=diffusion_vla``), that subtree starts from
    the new type's defaults instead, since the old type's fields would not fit it. A mapping given
    on the command line (``--safety.state_bounds={}``) replaces the file's whole, as it would the default.
    """
    import draccus
    import yaml

    defaults = config_cls()
    base = _nested_configs_only(defaults, draccus.encode(defaults))
    if config_path is not None:
        from vla_core.renamed import rename_tree

        with open(config_path, encoding="utf-8") as f:
            tree = rename_tree(yaml.safe_load(f) or {}, lambda f: _has_field(defaults, f), _notice(name))
        base = _layer(base, tree)
    for key, value in _cli_pairs(args):
        *path, leaf = key.split(".")
        node = base
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        if leaf == "type" and path and value:  # --a.b.type=X switches the subtree a.b to type X
            parent = base
            for part in path[:-1]:
                parent = parent[part]
            if node.get("type") != value:
                parent[path[-1]] = {"type": value}
        elif isinstance(node.get(leaf), dict) and value.lstrip().startswith("{"):
            del node[leaf]  # draccus would merge the command line's mapping into the file's
    return base


def _nested_configs_only(config: Any, encoded: dict) -> dict:
    """``encoded`` without its dict-valued fields that are values, not nested configs.

    A dict value (``safety.state_bounds``, say) is replaced whole by whatever sets it; merged with
    its default it could never be emptied or lose a key. Left out here, it keeps its field's default
    unless the YAML file or the command line sets it.
    """
    import dataclasses

    out = {}
    for key, value in encoded.items():
        field_value = getattr(config, key, None)
        if dataclasses.is_dataclass(field_value) and isinstance(value, dict):
            out[key] = _nested_configs_only(field_value, value)
        elif not isinstance(value, dict):
            out[key] = value
    return out


def _layer(base: dict, top: dict) -> dict:
    """``top`` over ``base``, nested dicts merged key by key; a subtree whose ``type`` changes is replaced."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        if (
            isinstance(value, dict)
            and isinstance(below, dict)
            and value.get("type", below.get("type")) == below.get("type")
        ):
            out[key] = _layer(below, value)
        else:
            out[key] = value
    return out


def _plain_text_help():
    """draccus's help formatter reading field comments as plain text: argparse %-formats every help string, so a
    comment's "%" (``5%``, ``p99 %``) would crash ``--help``; here it is a percent sign."""
    import copy

    from draccus.help_formatter import SimpleHelpFormatter

    class PlainTextHelp(SimpleHelpFormatter):
        def _get_help_string(self, action):
            literal = copy.copy(action)
            literal.help = (action.help or "").replace("%", "%%")
            return super()._get_help_string(literal)

    return PlainTextHelp


def main(argv: list[str] | None = None) -> int:
    from vla_core.lifetime import exit_with_parent_from_environ

    exit_with_parent_from_environ()  # a command another vla-rl process started ends with it (vla_core.lifetime)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_overview())
        return 0
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vla-rl: error: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    subcommands = COMMANDS[name].subcommands
    if subcommands:
        if args and args[0] in ("-h", "--help", "help"):
            print(f"usage: vla-rl {name} <{'|'.join(subcommands)}> [--key=value ...] [--help]\n")
            print("\n".join(f"  {sub}  {cmd.summary}" for sub, cmd in subcommands.items()))
            return 0
        if not args or args[0] not in subcommands:
            problem = f"unknown subcommand {args[0]!r}" if args else "missing subcommand"
            print(f"vla-rl {name}: error: {problem}; choose one of: {', '.join(subcommands)}", file=sys.stderr)
            return 2
        name, args = f"{name} {args[0]}", args[1:]
    if "--ros-args" in args:  # ROS's own arguments (parameter overrides) are for rclpy, not the config
        args = args[: args.index("--ros-args")]
    try:
        cfg = parse_config(name, args)
    except SystemExit as stop:
        if not isinstance(stop.code, str):  # --help, which exits 0
            raise
        print(stop.code, file=sys.stderr)
        return 2  # a usage error, as for an unknown command
    from vla_core import crash_log, interrupt

    # A native crash (a segfault in a renderer, say) prints every thread's Python stack on the process's
    # stderr instead of nothing but the shell's "Segmentation fault"; while a run writes into its output
    # directory, into native_crash.log there (vla_core.crash_log).
    crash_log.on_stderr()
    # SIGINT and SIGTERM end every command the same way, however the process was started (a
    # background job inherits SIGINT as ignored; schedulers send SIGTERM): see vla_core.interrupt.
    with interrupt.handlers():
        try:
            with _crash_log(name, cfg, crash_log):
                _command(name).run(cfg)
        except KeyboardInterrupt as err:
            signum = getattr(err, "signum", None) or interrupt.received() or signal.SIGINT
            print(f"\nvla-rl {name}: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
            return 128 + signum
        except (ValueError, FileNotFoundError, FileExistsError, FloatingPointError) as err:
            print(f"vla-rl {name}: error: {err}", file=sys.stderr)
            return 2
        # A command whose normal end is a stop signal (serve, sim-robot, record-ros) returns its
        # summary; the exit code still says the run was stopped, and by which signal.
        signum = interrupt.received()
    return 128 + signum if signum else 0


def _crash_log(name: str, cfg, crash_log):
    """A benchmark's or the quickstart's native crash stacks go to its output directory (the stages it runs,
    eval, train and finetune, send them to their own folders while they run)."""
    if (name == "quickstart" or name.startswith("bench ")) and getattr(cfg, "output_dir", ""):
        return crash_log.into(Path(cfg.output_dir))
    return contextlib.nullcontext()


def console_main() -> int:
    """The `vla-rl` console script: a long command runs in a supervised child (`vla_rl.supervise`), so a native
    crash ends in one line naming it and the resume command; every other command runs here, as `main`."""
    from vla_rl.supervise import supervise, supervises

    argv = sys.argv[1:]
    return supervise(argv) if supervises(argv) else main(argv)


if __name__ == "__main__":
    sys.exit(main())
