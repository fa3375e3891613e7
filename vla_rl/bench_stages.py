"""The stages the learning benchmarks share (`bench delay`, `bench rl`, `bench latency-rl`, `bench
delay-calibration`): scripted demonstrations, an imitation policy trained on them, one held-out
evaluation cell, `bench latency-rl`'s PPO arm, the check a calibrated arm run passes
(`check_calibration`, against `bench delay-calibration`'s result and its protocol file), and several
training seeds as separate runs with their cells pooled (`seed_runs`, `pool_cells`), and the minutes of a
resumable benchmark over all its processes (`RunClock`). The first two are skipped or resumed when a killed
run left them finished or part-done in the output folder. Each runs through the stages API (`vla_rl.stages`).

``cfg`` is the benchmark's config; it names task, demos, num_envs, seed, train_steps, batch_size,
horizon, n_action_steps and num_threads. A finished or part-done stage is reused only if it was made
with this run's seed and sizes; anything else is refused, naming the setting.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from vla_core.files import write_text_atomic

# The calibration protocol of the latency benchmarks (`bench delay-calibration`), beside the benchmarks.
PROTOCOL = Path(__file__).resolve().parents[1] / "benchmarks" / "delay_calibration_2026-12-02.md"
# The settings of an arm that may differ from the calibration's: its merges and how fast it runs.
FREE_FIELDS = ("merges", "calibration", "num_threads", "seeds")


def record_demos(cfg, dataset: Path) -> None:
    """``cfg.demos`` scripted episodes of ``cfg.task`` into ``dataset``, unless it holds them already."""
    from vla_rl.stages import EnvConfig, RecordConfig, record

    wanted = {"seed": cfg.seed, "num_episodes": cfg.demos, "task": cfg.task, "num_envs": min(cfg.num_envs, cfg.demos)}
    variety = getattr(cfg, "variety", None)  # the expert varied per episode (`bench steering`); None: as written
    if variety is not None:
        wanted["variety"] = asdict(variety)
    # the task's true state beside each frame: the labels of the token VLA's localization objective (`bench rl`)
    true_state = getattr(cfg, "environment_state_weight", 0) > 0
    if true_state:
        wanted["environment_state"] = True
    summary = dataset / "meta" / "vla_rl_record.json"
    if summary.is_file():  # reused: it must be this run's recording
        c = json.loads(summary.read_text())["config"]
        _refuse_another_run(dataset, "demonstrations", {**c, "task": c["env"]["task"], "num_envs": c["env"]["num_envs"]},
                            wanted)  # fmt: skip
    if not (dataset / "meta" / "info.json").is_file():
        record(RecordConfig(
            env=EnvConfig(task=cfg.task, num_envs=min(cfg.num_envs, cfg.demos)), num_episodes=cfg.demos,
            output_dir=str(dataset), seed=cfg.seed, repo_id=f"local/vla_rl_{cfg.task}", overwrite=True,
            **({"variety": variety} if variety is not None else {}), environment_state=true_state,
        ))  # fmt: skip


# The imitation settings added since the first runs, at the value those runs had.
IMITATION_DEFAULTS = {"action_frame": "absolute", "environment_state_weight": 0.0}


def train_imitation(cfg, dataset: Path, output_dir: Path, delay=None) -> None:
    """A policy of ``cfg.policy_type`` (``diffusion`` when the benchmark has no such field) trained on
    ``dataset`` for ``cfg.train_steps`` steps into ``output_dir`` (resumed when it has checkpoints); ``delay``:
    the delay augmentation (training-time RTC), None = none."""
    from vla_rl.stages import (
        AutoregressiveVLAConfig,
        DatasetConfig,
        DelayConfig,
        DiffusionConfig,
        DiffusionVLAConfig,
        TrainConfig,
        train,
    )

    policy_type = getattr(cfg, "policy_type", "diffusion")
    policy = {"horizon": cfg.horizon, "n_action_steps": cfg.n_action_steps}
    if policy_type == "autoregressive_vla":  # the benchmark's action tokenizer, frame and objective (`bench rl`)
        policy["action_tokenizer"] = cfg.action_tokenizer
        policy["action_frame"] = getattr(cfg, "action_frame", "absolute")
        policy["environment_state_weight"] = getattr(cfg, "environment_state_weight", 0.0)
    if getattr(cfg, "objective", ""):  # a flow base policy (`bench steering`)
        policy["objective"] = cfg.objective
    if getattr(cfg, "action_bounds", None):  # its chunks clamped to these bounds (`bench steering`: the robot's)
        policy["action_bounds"] = cfg.action_bounds
    policy_configs = {"diffusion": DiffusionConfig, "diffusion_vla": DiffusionVLAConfig,
                      "autoregressive_vla": AutoregressiveVLAConfig}  # fmt: skip
    delay = delay or DelayConfig()
    steps = getattr(cfg, "imitation_steps", None) or cfg.train_steps  # `bench rl` resolves a policy type's default
    saved = output_dir / "train_config.json"
    if (output_dir / "checkpoints").is_dir() and saved.is_file():  # resumed: it must be this run's policy
        c = json.loads(saved.read_text())
        # a field a run from before it lacks was at its default then
        recorded = {**c, "policy_type": c["policy"]["type"],
                    **{k: c["policy"].get(k, IMITATION_DEFAULTS.get(k)) for k in policy}}  # fmt: skip
        _refuse_another_run(output_dir, "an imitation policy", recorded, {
            "seed": cfg.seed, "steps": steps, "batch_size": cfg.batch_size, "delay": asdict(delay),
            "policy_type": policy_type, **policy,
        })  # fmt: skip
    train(TrainConfig(
        dataset=DatasetConfig(root=str(dataset)), output_dir=str(output_dir), steps=steps,
        # A checkpoint every 1,000 steps: a killed imitation stage (12,000 steps of the AR VLA take hours) resumes.
        batch_size=cfg.batch_size, seed=cfg.seed, log_with="none", save_every=min(steps, 1000),
        num_threads=cfg.num_threads, delay=delay, resume=(output_dir / "checkpoints").is_dir(),
        policy=policy_configs[policy_type](**policy),
    ))  # fmt: skip


def _refuse_another_run(folder: Path, what: str, recorded: dict, wanted: dict) -> None:
    """A benchmark's folder holds one setting: resuming it under another (a second seed, another size)
    would reuse stages of the first and report them as the second's."""
    for name, value in wanted.items():
        if recorded.get(name) != value:
            raise ValueError(
                f"{folder} holds {what} made with {name}={recorded.get(name)}, but this run asks for {name}={value}: "
                "pass another --output_dir (one per seed and setting)"
            )


def held_out(
    cfg, checkpoint: Path, episodes: int, seed: int, output_dir: Path, num_envs: int, delay_steps: int = 0,
    merge: str = "latest",
) -> dict:  # fmt: skip
    """`vla-rl eval` of ``checkpoint`` on ``episodes`` held-out episodes of ``cfg.task`` from ``seed``,
    under a fixed delay of ``delay_steps`` and chunk merge ``merge``: its episodes, successes,
    success_rate, success_ci95 (Wilson) and mean_episode_length."""
    from vla_rl.stages import ChunkingConfig, DelayConfig, EnvConfig, EvalConfig, evaluate

    result = evaluate(EvalConfig(
        checkpoint=str(checkpoint), env=EnvConfig(task=cfg.task, num_envs=num_envs), num_episodes=episodes,
        seed=seed, video_episodes=0, chunking=ChunkingConfig(merge=merge),
        delay=DelayConfig(kind="fixed", steps=delay_steps), output_dir=str(output_dir), overwrite=True,
    ))  # fmt: skip
    return {k: result[k] for k in ("episodes", "successes", "success_rate", "success_ci95", "mean_episode_length")}


def delay_cell(cfg, out: Path, policy: str, merge: str, d: int) -> dict:
    """`bench delay`'s cell (``cfg`` its config): the policy in ``out / policy`` under a fixed delay ``d``
    with chunk merge ``merge``, evaluated into ``out / "eval" / policy / merge / "d<d>"``."""
    return held_out(cfg, out / policy, cfg.episodes, cfg.eval_seed, out / "eval" / policy / merge / f"d{d}",
                    num_envs=min(cfg.num_envs, cfg.episodes), delay_steps=d, merge=merge)  # fmt: skip


def latency_rl_cell(cfg, out: Path, arm: str, d: int, checkpoint: Path) -> dict:
    """`bench latency-rl`'s cell (``cfg`` its config): ``checkpoint`` under a fixed delay ``d``, evaluated
    into ``out / "eval" / arm / "d<d>"``."""
    return held_out(cfg, checkpoint, cfg.eval_episodes, cfg.eval_seed, out / "eval" / arm / f"d{d}",
                    num_envs=min(50, cfg.eval_episodes), delay_steps=d)  # fmt: skip


def ppo_run(cfg, out: Path, name: str, d: int, latency_aware: bool, low_latency: bool = False) -> tuple[Path, dict]:
    """`bench latency-rl`'s PPO arm (``cfg`` its config) into ``out / "runs" / name`` (resumed when it has
    checkpoints) from ``out / "imitation"``, under a fixed delay ``d``: plain, latency-aware (the fast head and
    the mid-inference observation) or with a low-latency part (``low_latency``: trained alone per control step),
    either fast part fitted on the demonstrations first for ``cfg.latency_warmup_steps``. Returns its folder and
    what the report keeps of it. `bench delay-calibration` runs the baseline arms through it too."""

    from vla_rl.stages import DelayConfig, EnvConfig, FinetuneConfig, LatencyWarmupConfig, finetune

    run_dir = out / "runs" / name
    clock = RunClock(out / "run_clocks" / f"{name}.json")  # the run's minutes over every process of a resumed run
    fast = latency_aware or low_latency
    warmup = LatencyWarmupConfig(steps=cfg.latency_warmup_steps if fast else 0, dataset=str(out / "dataset"),
                                 batch_size=cfg.batch_size)  # fmt: skip
    summary = finetune(FinetuneConfig(
        checkpoint=str(out / "imitation"), algo="ppo", env=EnvConfig(task=cfg.task, num_envs=cfg.num_envs),
        iterations=10**6, max_env_steps=cfg.budget(d), seed=cfg.seed, output_dir=str(run_dir),
        eval_every=0, delay=DelayConfig(kind="fixed", steps=d), latency_aware=latency_aware, mid_fraction=cfg.mid_fraction,
        low_latency=low_latency, latency_warmup=warmup, num_threads=cfg.num_threads, log_with="none",
        resume=(run_dir / "checkpoints" / "last").exists(),
    ))  # fmt: skip
    return run_dir, {
        "delay": d, "latency_aware": latency_aware, "low_latency": low_latency,
        "minutes": clock.stop(),
        "env_steps": summary["env_steps"], "iterations": summary["iterations"],
        "rollout_env_steps_per_s": summary["rollout_env_steps_per_s"], "skipped_updates": summary["skipped_updates"],
        "rollout_success": [h["rollout_success"] for h in summary["history"]],
    }  # fmt: skip


def protocol_sha256() -> str:
    if not PROTOCOL.is_file():
        raise FileNotFoundError(f"the calibration protocol {PROTOCOL} is missing; restore it from the repository")
    return hashlib.sha256(PROTOCOL.read_bytes()).hexdigest()


def protocol_extends(earlier_sha: str) -> bool:
    """Whether today's protocol is the text of SHA-256 ``earlier_sha`` with dated amendments appended after it
    (each a ``### `` heading at the end), the only change the protocol allows: cells measured under the earlier
    text were measured under every word that is still above the amendments."""
    text = PROTOCOL.read_bytes()
    if hashlib.sha256(text).hexdigest() == earlier_sha:
        return True
    starts = [i for i in range(len(text)) if text.startswith(b"### ", i) and (i == 0 or text[i - 1 : i] == b"\n")]
    for start in starts:
        head = text[:start]
        # The earlier text ended after its last line; the amendment's blank line before its heading is new.
        if earlier_sha in {hashlib.sha256(h).hexdigest() for h in (head, head.rstrip(b"\n") + b"\n")}:
            return True
    return False


def check_calibration(path: str, bench: str, bench_cfg) -> dict[str, str]:
    """Refuse an arm run (`bench delay` or `bench latency-rl`, config ``bench_cfg``) that the calibration at
    ``path`` did not choose, or whose protocol changed since; returns what its results record."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--calibration={path} not found; run `vla-rl bench delay-calibration` first")
    calibration = json.loads(file.read_text())
    sha = protocol_sha256()
    if calibration["protocol_sha256"] != sha:
        raise ValueError(
            f"{PROTOCOL.name} changed after the calibration in {path} (SHA-256 {calibration['protocol_sha256'][:12]} "
            f"then, {sha[:12]} now): record the change as a dated amendment and calibrate again into a new "
            "--output_dir of `vla-rl bench delay-calibration`"
        )
    if calibration.get("quick"):
        raise ValueError(f"{path} is a --quick calibration (toy sizes; its choice means nothing): pass a full run's")
    if not calibration.get("finished"):
        raise ValueError(
            f"the calibration in {path} has not finished; rerun `vla-rl bench delay-calibration "
            f"--output_dir={file.parent}` to resume it"
        )
    chosen = calibration.get("chosen")
    if not chosen:
        raise ValueError(f"the calibration in {path} chose no task and delay: no augmented or latency-aware arm runs")
    if bench_cfg.seed not in chosen["seeds"]:
        raise ValueError(f"--seed={bench_cfg.seed} is not a calibrated seed; use one of {chosen['seeds']}")
    if bench_cfg.quick:
        raise ValueError("--calibration does not take --quick: a quick run's toy sizes are not the calibrated arms")
    wanted = {**calibration["configs"][chosen["task"]][str(bench_cfg.seed)][bench], "delays": [0, chosen["delay"]]}
    for name, value in asdict(bench_cfg).items():
        if name in FREE_FIELDS or name not in wanted:
            continue
        same = Path(value).resolve() == Path(wanted[name]).resolve() if name == "output_dir" else value == wanted[name]
        if not same:
            raise ValueError(
                f"--{name}={flag(value)} differs from the calibration in {path}, which fixed it for seed "
                f"{bench_cfg.seed}: run the arms with --{name}={flag(wanted[name])}"
            )
    existing = Path(bench_cfg.output_dir) / {"delay": "delay.json", "latency_rl": "latency_rl.json"}[bench]
    if existing.is_file():
        earlier = (json.loads(existing.read_text()).get("calibration") or {}).get("protocol_sha256")
        if earlier and earlier != sha:
            raise ValueError(
                f"{existing} was measured under another text of {PROTOCOL.name} ({earlier[:12]}): report that "
                "run as it was, and run the amended protocol into a new --output_dir"
            )
    return {"file": str(file.resolve()), "protocol_sha256": sha, "task": chosen["task"], "delay": chosen["delay"]}


def seed_runs(
    cfg, folder: Callable[[int], Path], result_file: str, run_one: Callable[[object, Path], dict]
) -> dict[int, dict]:  # fmt: skip
    """Each of ``cfg.seeds`` as its own run: ``cfg`` with that seed (its ``output_dir`` the seed's ``folder``)
    given to ``run_one(seed_cfg, folder)``, unless that folder's ``result_file`` holds a run that finished under
    the same settings (its threads aside), which is read back. A killed seed resumes its stages, so a claim
    over several seeds can span interruptions. Returns each seed's report, by seed."""
    if cfg.seed != 0 or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ValueError(f"--seeds={cfg.seeds} runs each seed once and sets --seed itself: drop --seed={cfg.seed} "
                         "and repeat no seed")  # fmt: skip
    reports = {}
    for seed in cfg.seeds:
        out = folder(seed)
        seed_cfg = replace(cfg, seed=seed, seeds=[], output_dir=str(out))
        reports[seed] = _finished(seed_cfg, out / result_file) or run_one(seed_cfg, out)
    return reports


def calibrated_folder(path: str, bench: str) -> Callable[[int], Path]:
    """The folder `bench delay-calibration` (its ``calibration.json`` at ``path``) fixed for each seed's run of
    ``bench`` (``delay`` or ``latency_rl``); each run still passes `check_calibration` itself."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--calibration={path} not found; run `vla-rl bench delay-calibration` first")
    calibration = json.loads(file.read_text())
    chosen = calibration.get("chosen")
    if not chosen:
        raise ValueError(f"the calibration in {path} chose no task and delay: no augmented or latency-aware arm runs")

    def folder(seed: int) -> Path:
        if seed not in chosen["seeds"]:
            raise ValueError(f"--seeds holds {seed}, which is not a calibrated seed; use seeds of {chosen['seeds']}")
        return Path(calibration["configs"][chosen["task"]][str(seed)][bench]["output_dir"])

    return folder


def _finished(cfg, path: Path) -> dict | None:
    """The report at ``path`` if it is of a run made under ``cfg`` (threads aside), else None."""
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    recorded, wanted = dict(report["config"]), asdict(cfg)
    recorded.pop("num_threads", None), wanted.pop("num_threads")
    return report if recorded == wanted else None


def pool_cells(cell_lists: list[list[dict]], keys: tuple[str, ...]) -> list[dict]:
    """Several seeds' cells (each a list of dicts with ``keys`` and success counts) pooled: one cell per value
    of ``keys``, its successes and episodes summed over the seeds, with their rate and Wilson interval. Every
    seed must have every cell."""
    from vla_rl.stages import pooled_rate

    by_key: dict[tuple, list[dict]] = {}
    for cells in cell_lists:
        for cell in cells:
            by_key.setdefault(tuple(cell[k] for k in keys), []).append(cell)
    missing = [key for key, cells in by_key.items() if len(cells) != len(cell_lists)]
    if missing:
        raise ValueError(f"the seeds' runs do not share the cells {missing}: pool runs of one setting only")
    return [{**dict(zip(keys, key, strict=True)), **pooled_rate(cells)} for key, cells in by_key.items()]


def flag(value) -> str:
    """A value as a command line takes it whole: lists without spaces, quoted (``'[0,6]'``)."""
    return f"'{json.dumps(value, separators=(',', ':'))}'" if isinstance(value, list) else str(value)


# -- a served robot run (`bench robot-parity`'s robot stage, shared with `bench delay-beyond`; ``cfg`` a
# `BenchRobotParityConfig`) ------------------------------------

CONTROL_HZ = 20.0  # the tabletop tasks' control rate (25 physics steps of 2 ms), which serve runs at
SERVE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve.yaml"  # serve's settings for the sim robot
EPISODE_TOPIC = "/sim_robot/episode"  # where the sim robot announces its episodes (`robot_bridge.topics.EPISODE`)


def policy_settings(checkpoint: Path) -> dict[str, Any]:
    """What both sides must be set up with from the checkpoint's config: latency-aware or not, its image size
    and cameras (the robot renders what the policy reads), and its `LatencySpec` (the delays it fits)."""
    from vla_core.runtime import LatencySpec
    from vla_rl.stages import resolve_policy_dir

    config = json.loads((resolve_policy_dir(checkpoint) / "config.json").read_text())
    spec = LatencySpec(
        horizon=config["horizon"], committed_rows=config.get("max_delay_steps") or 0,
        latency_aware=bool(config.get("latency_aware")), latency_max_delay=config.get("latency_max_delay") or 0,
    )  # fmt: skip
    return {"latency_aware": spec.latency_aware, "image_size": int(config["image_size"]),
            "cameras": list(config["cameras"]), "spec": spec}  # fmt: skip


def robot_identity(cfg, checkpoint: Path) -> dict[str, Any]:
    """What a finished robot stage must have been run with to be reused: the settings, and the weights file's
    SHA-256 (a checkpoint trained again in the same folder is another policy)."""
    import hashlib

    from vla_rl.stages import resolve_policy_dir

    keys = ("task", "episodes", "num_envs", "seed", "noise_seed", "added_latency_s", "execute_steps",
            "max_episode_steps", "episode_gap_s")  # fmt: skip
    digest = hashlib.sha256()
    with open(resolve_policy_dir(checkpoint) / "model.safetensors", "rb") as weights:
        for block in iter(lambda: weights.read(1 << 24), b""):
            digest.update(block)
    return {"checkpoint": str(checkpoint.resolve()), "weights_sha256": digest.hexdigest(),
            **{k: getattr(cfg, k) for k in keys}}  # fmt: skip


def run_robot(cfg, checkpoint: Path, policy: dict, folder: Path) -> tuple[dict, bool]:
    """The served robot's run into ``folder`` (latencies.jsonl, episodes.jsonl, the processes' logs, robot.json);
    a finished one with the same settings is reused. Returns (robot.json's content, whether it ran now)."""
    from vla_rl.stages import last_json, start_command, stop_command

    done = folder / "robot.json"
    identity = robot_identity(cfg, checkpoint)
    if done.is_file() and json.loads(done.read_text())["identity"] == identity:
        return json.loads(done.read_text()), False
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    serve = start_command(serve_args(cfg, checkpoint, policy, folder), cfg.domain_id, folder, "serve")
    robot = None
    try:
        wait_until_ready(serve, folder / "serve.err", cfg.start_timeout_s)
        robot = start_command(robot_args(cfg, policy, folder), cfg.domain_id, folder, "robot")
        limit = cfg.max_episode_steps or 500  # steps, for the timeout only
        timeout = cfg.episodes * (3 * limit / CONTROL_HZ + cfg.episode_gap_s) + 300
        try:
            robot.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the sim robot did not finish {cfg.episodes} episodes in {timeout:.0f} s; see "
                               f"{folder}/robot.err") from None  # fmt: skip
        time.sleep(cfg.added_latency_s + 2.0)  # the last episode's inference is answered and logged
        if serve.poll() is not None:
            raise RuntimeError(f"vla-rl serve stopped during the robot's run (exit code {serve.returncode}); see "
                               f"{folder}/serve.err")  # fmt: skip
    finally:
        if robot is not None:
            robot_code, robot_out, robot_err = stop_command(robot, folder, "robot")
        serve_code, serve_out, _ = stop_command(serve, folder, "serve")
    if robot_code != 0:
        last = (robot_err.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the sim robot stopped with exit code {robot_code} ({last}); see {folder}/robot.err")
    episodes = [json.loads(line) for line in (folder / "episodes.jsonl").read_text().splitlines() if line]
    if len(episodes) != cfg.episodes:
        raise RuntimeError(f"the sim robot logged {len(episodes)} of {cfg.episodes} episodes; see {folder}/robot.err")
    result = {"identity": identity, "episodes": episodes, "robot_summary": last_json(robot_out),
              "serve_summary": last_json(serve_out) if "{\n" in serve_out else {"exit_code": serve_code}}  # fmt: skip
    write_text_atomic(done, json.dumps(result, indent=2))
    return result, True


def chunking(cfg):
    """The one chunking both sides run: latest merge (a latency-aware policy's), ``execute_steps``, the
    measured estimate's default window."""
    from vla_rl.stages import ChunkingConfig

    return ChunkingConfig(execute_steps=cfg.execute_steps, merge="latest")


def serve_args(cfg, checkpoint: Path, policy: dict, folder: Path) -> list[str]:
    """`vla-rl serve` as step 2 of the protocol runs it, on the sim robot's topics (configs/serve.yaml)."""
    return [
        "serve", f"--config_path={SERVE_CONFIG}", f"--checkpoint={checkpoint}", f"--control_hz={CONTROL_HZ}",
        *[f"--chunking.{k}={v}" for k, v in asdict(chunking(cfg)).items()], "--max_delay_steps=0",
        f"--mid_inference={str(policy['latency_aware']).lower()}", f"--added_latency_s={cfg.added_latency_s}",
        f"--latency_log={folder / 'latencies.jsonl'}", f"--topics.episode={EPISODE_TOPIC}",
        f"--noise_seed={cfg.noise_seed}", "--safety.max_velocity=[]", "--safety.max_acceleration=[]",
    ]  # fmt: skip


def robot_args(cfg, policy: dict, folder: Path) -> list[str]:
    """`vla-rl sim-robot` as step 2 of the protocol runs it: episode e from the evaluation's episode e."""
    return [
        "sim-robot", f"--env.task={cfg.task}", f"--env.max_episode_steps={cfg.max_episode_steps}",
        f"--env.image_size={policy['image_size']}", f"--env.cameras=[{','.join(policy['cameras'])}]",
        f"--seed={cfg.seed}", f"--eval_worlds={cfg.num_envs}", f"--max_episodes={cfg.episodes}",
        f"--episode_gap_s={cfg.episode_gap_s}", "--wait_for_controller=true",
        f"--episode_log={folder / 'episodes.jsonl'}",
    ]  # fmt: skip


def wait_until_ready(serve, log: Path, timeout_s: float) -> None:
    """Until the server says its policy is loaded and fits (its log line ``policy ready``); one line naming
    the cause when it exits, fails to load the checkpoint, or takes longer than ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        text = log.read_text() if log.is_file() else ""
        if "policy ready" in text:
            return
        failed = [line for line in text.splitlines() if "failed to load" in line or "does not fit" in line]
        if failed or serve.poll() is not None:
            raise RuntimeError(f"vla-rl serve did not start: {(failed or text.strip().splitlines() or ['?'])[-1]}")
        time.sleep(0.5)
    raise RuntimeError(
        f"vla-rl serve did not load its policy in {timeout_s:g} s; see {log} (or raise --start_timeout_s)"
    )


# -- the minutes of a resumable benchmark, over every process that worked on it ---------------------------------
# A benchmark killed and resumed runs in several processes; the time since the last one started leaves the earlier
# ones out. `RunClock` keeps each process's seconds in one JSON file, under a key of its own (its start time and
# pid), refreshed by a daemon thread every ``every_s`` seconds and whenever `minutes` is read, so a process killed
# without warning loses at most ``every_s`` seconds of the count.


class RunClock:
    """Minutes spent on the work whose clock file is ``path``, by this process and every earlier one."""

    def __init__(self, path: str | Path, every_s: float = 30.0):
        self.path = Path(path)
        self._key = f"{time.time():.6f}-{os.getpid()}"
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._save()
        threading.Thread(target=self._beat, args=(every_s,), daemon=True, name="run-clock").start()

    def _beat(self, every_s: float) -> None:
        while not self._stopped.wait(every_s):
            self._save()

    def _save(self) -> dict[str, float]:
        with self._lock:
            seconds = json.loads(self.path.read_text()) if self.path.is_file() else {}
            seconds[self._key] = round(time.monotonic() - self._start, 3)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(seconds, indent=1))
            return seconds

    def minutes(self) -> float:
        """Minutes over every process so far (this one up to now), rounded to 0.01."""
        return round(sum(self._save().values()) / 60, 2)

    def stop(self) -> float:
        """The final count (`minutes`); the clock stops refreshing."""
        self._stopped.set()
        return self.minutes()
