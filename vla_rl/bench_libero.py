"""`vla-rl bench libero`: `vla-rl eval` against LeRobot's own evaluator (`lerobot-eval`'s ``rollout``) on the
same LIBERO tasks, initial states, worlds and policy, compared step by step.

No policy that succeeds on LIBERO can be had offline, so agreement of success rates alone would compare
failures. Both evaluators instead drive one seeded policy whose actions depend on what it sees: a small
ACT with random weights (deterministic at inference), saved by LeRobot with its processors; vla-rl loads
it through its LeRobot adapter, LeRobot runs it natively.

Protocol (fixed 2026-12-02, before any run):
- Tasks ``suite/task_ids`` (libero_spatial 0 and 1), ``worlds`` worlds per task (2), one episode per
  world: the task's initial states 0 .. worlds - 1 in both (LeRobot: ``episode_index`` k of ``n_envs``;
  vla-rl: ``--protocol=lerobot --episodes_per_task=worlds``, LeRobot's step limits and 10 settle steps).
  Cameras ``image`` and ``image2`` at ``image_size`` (64) px, ACT chunks of 8 with 4 actions executed.
- Compared per world and step, up to the step its episode ends in either evaluator: the observation the
  policy is given (both cameras and the 8-D state, after LeRobot's ``preprocess_observation`` and
  ``LiberoProcessorStep``, which both apply) as a sha1 of its bytes, and the success flag.
  ``state_agreement``: the fraction of compared steps whose observation hashes and success are equal;
  ``outcome_agreement``: the fraction of episodes with the same success and length.
  The observation is what the policy sees, not the whole simulator state: two runs whose object
  velocities differ but whose images and robot state agree would count as equal until they diverge.
- Throughput: env steps over the seconds of the rollouts (environment construction and the first reset
  excluded in both), vla-rl's over LeRobot's, LeRobot's envs as ``lerobot-eval`` builds them
  (``AsyncVectorEnv``, one process per world).
- Final line: ``state_agreement=<x> outcome_agreement=<y> throughput_ratio=<z>``. Targets: both
  agreements 1.0, throughput >= 1.2.

Protocol history:
- 2026-12-02: written as above, before the first run.
- 2026-12-02: three ``--quick`` runs found two faults of the benchmark's own code, fixed before the first
  default run: a reset of LeRobot's vector env before its rollout (to start the simulators untimed) moved
  each of its worlds to the next initial state, so the two evaluators compared states 0 and 1 (0 of 281
  steps equal); and the first record of LeRobot's run was dropped. The protocol text is unchanged; the
  timing now starts after each evaluator's own first reset. Quick run after the fixes:
  ``state_agreement=1.000 outcome_agreement=1.000 throughput_ratio=0.933`` (one world of
  libero_spatial/0, 281 of 281 steps equal).
- 2026-12-02, run 1 (defaults): ``state_agreement=1.000 outcome_agreement=1.000 throughput_ratio=0.924``
  (1,124 of 1,124 steps equal; 9.42 against 10.20 env-steps/s).
- 2026-12-02, amendment after run 1: a second reader found that LeRobot's side processed and hashed each
  observation for the comparison inside its timed window (ours hashed inside its own). Both now keep copies
  and hash after the run; the protocol's timing rule (construction and first reset excluded) is unchanged.
  Run 2 (defaults): ``state_agreement=1.000 outcome_agreement=1.000 throughput_ratio=0.935`` (1,124 of
  1,124 steps equal; 118.5 s against 110.8 s of rollouts).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vla_core.files import write_text_atomic

COMPARED_KEYS = ("observation.images.image", "observation.images.image2", "observation.state")


@dataclass
class BenchLiberoConfig:
    """`vla-rl eval` against LeRobot's evaluator on LIBERO, step by step (see the module doc)."""

    suite: str = "libero_spatial"
    task_ids: list[int] = field(default_factory=lambda: [0, 1])
    worlds: int = 2  # worlds per task, one episode each: initial states 0 .. worlds - 1
    image_size: int = 64
    seed: int = 0  # of the random ACT weights
    output_dir: str = "outputs/bench/libero"
    quick: bool = False  # one task, one world (a mechanics check; still LeRobot's full step limit)


def digest(obs: dict[str, Any], world: int) -> str:
    """sha1 of world ``world``'s compared observation tensors (COMPARED_KEYS), as float32 bytes."""
    h = hashlib.sha1()
    for key in COMPARED_KEYS:
        h.update(obs[key][world].detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_act(directory: Path, cfg: BenchLiberoConfig) -> None:
    """A small ACT with random weights for LIBERO's features, saved by LeRobot with its processors."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.act.modeling_act import ACTPolicy
    from lerobot.policies.factory import make_pre_post_processors

    size = cfg.image_size
    act_cfg = ACTConfig(
        input_features={"observation.images.image": PolicyFeature(FeatureType.VISUAL, (3, size, size)),
                        "observation.images.image2": PolicyFeature(FeatureType.VISUAL, (3, size, size)),
                        "observation.state": PolicyFeature(FeatureType.STATE, (8,))},
        output_features={"action": PolicyFeature(FeatureType.ACTION, (7,))},
        chunk_size=8, n_action_steps=4, dim_model=32, n_heads=2, dim_feedforward=64, n_encoder_layers=1,
        n_decoder_layers=1, use_vae=False, pretrained_backbone_weights=None, device="cpu",
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    policy = ACTPolicy(act_cfg)
    stats = {
        "observation.state": {"mean": torch.zeros(8), "std": torch.ones(8)},
        "action": {"mean": torch.zeros(7), "std": torch.full((7,), 0.5)},
        **{k: {"mean": torch.full((3, 1, 1), 0.5), "std": torch.full((3, 1, 1), 0.25)}
           for k in ("observation.images.image", "observation.images.image2")},
    }  # fmt: skip
    pre, post = make_pre_post_processors(act_cfg, dataset_stats=stats)
    for part in (policy, pre, post):
        part.save_pretrained(directory)


def run_ours(policy_dir: Path, cfg: BenchLiberoConfig, task_id: int, out: Path) -> dict[str, Any]:
    """`vla-rl eval` of one task; every observation and success flag per world and step, and the seconds of
    the rollout (from after the first reset to the end)."""
    from sim.config import EnvConfig
    from sim.subprocess_env import SubprocessBatchedEnv
    from vla_rl.stages import EvalConfig, evaluate

    steps: list[dict[str, Any]] = []
    clock: dict[str, float] = {}
    real_reset, real_step = SubprocessBatchedEnv.reset, SubprocessBatchedEnv.step

    def kept(obs: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: obs[k].clone() for k in COMPARED_KEYS}  # hashed after the run, outside the timed window

    def reset(self, *args, **kwargs):
        obs = real_reset(self, *args, **kwargs)
        clock.setdefault("start", time.perf_counter())
        steps.append({"obs": [kept(obs)] * self.num_envs, "success": [False] * self.num_envs})
        return obs

    def step(self, actions):
        obs, reward, terminated, truncated, info = real_step(self, actions)
        final = info.get("final_obs", obs)
        done = (terminated | truncated).numpy()
        seen = [kept(final) if done[w] else None for w in range(self.num_envs)]
        now = kept(obs)
        steps.append({"obs": [s if s is not None else now for s in seen], "success": info["success"].tolist()})
        clock["end"] = time.perf_counter()
        return obs, reward, terminated, truncated, info

    SubprocessBatchedEnv.reset, SubprocessBatchedEnv.step = reset, step
    try:
        result = evaluate(EvalConfig(
            checkpoint=str(policy_dir), protocol="lerobot", episodes_per_task=cfg.worlds, video_episodes=0,
            env=EnvConfig(task=f"{cfg.suite}/{task_id}", num_envs=cfg.worlds, cameras=["image", "image2"],
                          image_size=cfg.image_size),
            output_dir=str(out), overwrite=True,
        ))  # fmt: skip
    finally:
        SubprocessBatchedEnv.reset, SubprocessBatchedEnv.step = real_reset, real_step
    for s in steps:
        s["obs"] = [digest(o, w) for w, o in enumerate(s["obs"])]
    lengths = [e["length"] for e in sorted(result["per_episode"], key=lambda e: e["world"])]
    successes = [e["success"] for e in sorted(result["per_episode"], key=lambda e: e["world"])]
    return {"steps": steps, "lengths": lengths, "successes": successes,
            "seconds": clock["end"] - clock["start"], "env_steps": sum(lengths)}  # fmt: skip


class RecordingVectorEnv:
    """LeRobot's vector env, passed through, recording the digest and success of every world after its reset
    and each step (LeRobot's ``rollout(return_observations=True)`` cannot stack LIBERO's nested observations:
    it raises a TypeError, so the observations are taken here, processed as ``rollout`` processes them)."""

    def __init__(self, env, worlds: int):
        from lerobot.envs.utils import preprocess_observation
        from lerobot.processor.env_processor import LiberoProcessorStep

        self._env, self._worlds, self._raw, self._successes = env, worlds, [], []
        self._process = lambda raw: LiberoProcessorStep().observation(preprocess_observation(raw))

    def __getattr__(self, name):
        return getattr(self._env, name)

    def _record(self, raw, success) -> None:
        self._raw.append(copy.deepcopy(raw))  # processed and hashed after the run, outside the timed window
        self._successes.append(success)

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Per reset and step: each world's observation digest and success flag."""
        out = []
        for raw, success in zip(self._raw, self._successes, strict=True):
            obs = self._process(raw)
            out.append({"obs": [digest(obs, w) for w in range(self._worlds)], "success": success})
        return out

    def reset(self, *args, **kwargs):
        raw, info = self._env.reset(*args, **kwargs)
        self._record(raw, [False] * self._worlds)
        self.started = time.perf_counter()  # timed from here: the simulators start at their first reset
        return raw, info

    def step(self, actions):
        raw, reward, terminated, truncated, info = self._env.step(actions)
        success = [bool(s) for s in info.get("is_success", [False] * self._worlds)]
        self._record(raw, success)
        self.ended = time.perf_counter()
        return raw, reward, terminated, truncated, info


def run_lerobot(policy_dir: Path, cfg: BenchLiberoConfig, task_id: int) -> dict[str, Any]:
    """LeRobot's ``rollout`` (what ``lerobot-eval`` runs per batch) on its own LIBERO vector env of one task."""
    from lerobot.envs.configs import LiberoEnv as LiberoEnvConfig
    from lerobot.envs.factory import make_env, make_env_pre_post_processors
    from lerobot.policies.act.modeling_act import ACTPolicy
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.scripts.lerobot_eval import rollout

    from sim.libero_setup import prepare_libero

    prepare_libero()
    env_cfg = LiberoEnvConfig(task=cfg.suite, task_ids=[task_id], observation_height=cfg.image_size,
                              observation_width=cfg.image_size)  # fmt: skip
    policy = ACTPolicy.from_pretrained(policy_dir).eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(policy_dir))
    env_pre, env_post = make_env_pre_post_processors(env_cfg=env_cfg, policy_cfg=policy.config)
    vec = make_env(env_cfg, n_envs=cfg.worlds, use_async_envs=True)[cfg.suite][task_id]
    # No reset before the rollout's own: each reset of LeRobot's LiberoEnv moves it on to its next initial state.
    recorder = RecordingVectorEnv(vec, cfg.worlds)
    try:
        data = rollout(recorder, policy, env_pre, env_post, pre, post, seeds=list(range(cfg.worlds)))
    finally:
        vec.close()
    seconds, steps = recorder.ended - recorder.started, recorder.steps
    done = data["done"].numpy()  # (N, T) cumulative
    lengths = [int(np.argmax(done[w])) + 1 if done[w].any() else done.shape[1] for w in range(cfg.worlds)]
    successes = [bool(data["success"][w].any()) for w in range(cfg.worlds)]
    return {"steps": steps, "lengths": lengths, "successes": successes, "seconds": seconds,
            "env_steps": sum(lengths)}  # fmt: skip


def compare(ours: dict[str, Any], theirs: dict[str, Any], worlds: int) -> dict[str, Any]:
    """Per world, the steps up to its episode's end in either run: equal observation hash and success."""
    compared = equal = 0
    first_difference = []
    for w in range(worlds):
        last = min(ours["lengths"][w], theirs["lengths"][w])
        differed = False
        for t in range(last + 1):
            compared += 1
            recorded = t < len(ours["steps"]) and t < len(theirs["steps"])  # a step one side never took differs
            same = recorded and (ours["steps"][t]["obs"][w] == theirs["steps"][t]["obs"][w]
                                 and bool(ours["steps"][t]["success"][w]) == bool(theirs["steps"][t]["success"][w]))  # fmt: skip
            equal += same
            if not same and not differed:
                first_difference.append({"world": w, "step": t})
                differed = True
    episodes_same = sum(
        ours["lengths"][w] == theirs["lengths"][w] and ours["successes"][w] == theirs["successes"][w]
        for w in range(worlds)
    )
    return {"compared_steps": compared, "equal_steps": equal, "first_difference": first_difference,
            "episodes": worlds, "same_episodes": episodes_same}  # fmt: skip


def bench_libero(cfg: BenchLiberoConfig) -> dict[str, Any]:
    if cfg.quick:
        cfg = BenchLiberoConfig(**{**asdict(cfg), "task_ids": cfg.task_ids[:1], "worlds": 1})
    out = Path(cfg.output_dir) / ("quick" if cfg.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    policy_dir = out / "act"
    make_act(policy_dir, cfg)
    tasks = []
    for task_id in cfg.task_ids:
        ours = run_ours(policy_dir, cfg, task_id, out / f"ours_{task_id}")
        theirs = run_lerobot(policy_dir, cfg, task_id)
        tasks.append({"task": f"{cfg.suite}/{task_id}", **compare(ours, theirs, cfg.worlds),
                      "ours": {**{k: ours[k] for k in ("lengths", "successes", "seconds", "env_steps")},
                               "recorded_steps": len(ours["steps"])},
                      "lerobot": {**{k: theirs[k] for k in ("lengths", "successes", "seconds", "env_steps")},
                                  "recorded_steps": len(theirs["steps"])}})  # fmt: skip
        write_text_atomic(
            out / f"steps_{task_id}.json", json.dumps({"ours": ours["steps"], "lerobot": theirs["steps"]})
        )
    compared = sum(t["compared_steps"] for t in tasks)
    ours_rate = sum(t["ours"]["env_steps"] for t in tasks) / sum(t["ours"]["seconds"] for t in tasks)
    theirs_rate = sum(t["lerobot"]["env_steps"] for t in tasks) / sum(t["lerobot"]["seconds"] for t in tasks)
    report = {
        "config": asdict(cfg), "tasks": tasks,
        "state_agreement": sum(t["equal_steps"] for t in tasks) / compared,
        "outcome_agreement": sum(t["same_episodes"] for t in tasks) / sum(t["episodes"] for t in tasks),
        "ours_env_steps_per_s": ours_rate, "lerobot_env_steps_per_s": theirs_rate,
        "throughput_ratio": ours_rate / theirs_rate,
    }  # fmt: skip
    write_text_atomic(out / "libero_eval.json", json.dumps(report, indent=2))
    return report


def format_summary(report: dict[str, Any]) -> str:
    lines = [
        f"{'task':<20} {'steps':>6} {'equal':>6} {'ours len':>12} {'lerobot len':>12} {'ours s':>8} {'lerobot s':>9}"
    ]
    for t in report["tasks"]:
        lines.append(f"{t['task']:<20} {t['compared_steps']:>6} {t['equal_steps']:>6} {t['ours']['lengths']!s:>12} "
                     f"{t['lerobot']['lengths']!s:>12} {t['ours']['seconds']:>8.1f} {t['lerobot']['seconds']:>9.1f}")  # fmt: skip
    lines.append(f"state_agreement={report['state_agreement']:.3f} outcome_agreement={report['outcome_agreement']:.3f} "
                 f"throughput_ratio={report['throughput_ratio']:.3f}")  # fmt: skip
    return "\n".join(lines)
