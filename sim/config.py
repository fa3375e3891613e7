"""Configuration of the batched simulated environments, and the conventions every backend shares:
which worlds a call selects, what a seed means, the LeRobot features (no simulator import here)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

Backend = Literal["cpu", "warp"]
RLBenchActionMode = Literal["keypose", "joint"]  # see EnvConfig.rlbench_action_mode
RenderIsolation = Literal["thread", "process"]  # see EnvConfig.render_isolation


@dataclass
class EnvConfig:
    """A batch of simulated worlds running one task."""

    # Task name: a MuJoCo tabletop task (`sim.tasks.TASKS`), a LIBERO suite or task (libero_spatial,
    # libero_spatial/3; `sim.libero_env`), a robosuite task (robosuite/Lift; `sim.robosuite_env`) or an
    # RLBench task (rlbench/close_jar; `sim.rlbench_env`, needs CoppeliaSim, PyRep and RLBench).
    task: str = "lift"
    # Physics backend. cpu = MuJoCo with mujoco.rollout threads; warp = MuJoCo Warp, all worlds
    # in one process on `device` (needs the `gpu` extra). See `sim.factory.make_env`.
    backend: Backend = "cpu"
    device: str = "cpu"  # torch device of the observations; the cpu backend runs on "cpu" only
    num_envs: int = 16  # worlds stepped as one batch
    image_size: int = 64  # square camera image side, pixels
    # Cameras rendered each step, as named in the observation.images.<camera> keys; empty = physics
    # only (no images). MJCF camera names, except LIBERO's: image (agentview) and image2 (wrist).
    cameras: list[str] = field(default_factory=lambda: ["front"])
    substeps: int = 25  # physics steps per control step (0.002 s each: 20 Hz control)
    num_threads: int = 0  # physics threads; 0 = one per CPU core
    # Renderers of the camera images, each with its own GL context: worker processes (see render_isolation) or
    # threads (render_isolation=thread; 1 = the calling thread only); 0 = one per CPU core. Frames are identical
    # for any count.
    render_threads: int = 0
    # Where the camera images are rendered (cpu and warp backends): process = in render_threads worker processes,
    # each with its own GL (a driver crash costs a restarted worker, never the run; `sim.render.ProcessRenderers`);
    # thread = in threads of this process (`sim.render.ParallelRenderers`; Mesa's llvmpipe crashed long runs
    # natively with two of them rendering at once). Frames are identical either way; speed too (`vla-rl bench sim`).
    render_isolation: RenderIsolation = "process"
    max_episode_steps: int = 0  # 0 = the task's own limit
    # No-op control steps after each reset, before the first observation, while objects settle: -1 = the
    # task's own (LIBERO: 10, LeRobot's; the other tasks start settled and take only 0 or -1).
    # `vla-rl eval --protocol` sets it on LIBERO (`sim.libero_protocol`).
    settle_steps: int = -1
    # RLBench tasks only (rlbench/<task>; `sim.rlbench_env`): how an action commands the arm. keypose = an
    # end-effector pose [x, y, z, qx, qy, qz, qw, gripper_open] reached by RLBench's planner (PerAct's
    # setting); joint = 7 absolute joint positions and gripper_open.
    rlbench_action_mode: RLBenchActionMode = "keypose"
    # RLBench tasks only: -1 = each episode draws one of the task's variations (PerAct evaluates over all);
    # k >= 0 = every episode runs variation k.
    rlbench_variation: int = -1
    # RLBench tasks only: a folder of stored RLBench episodes (<folder>/<task>/all_variations/episodes/,
    # e.g. PerAct's test set); when set, reset(seed) starts worlds at stored episodes, as PerAct evaluates;
    # "" = new random scenes.
    rlbench_demo_root: str = ""
    # A variation outside the demonstrations (`sim.variations`, the MuJoCo suite on the cpu backend): position,
    # size, colour, distractors, camera or lighting, drawn per episode from the world's seed and recorded with
    # each episode. "" = in distribution.
    variation: str = ""


# Fields that choose how the worlds are computed, never what they compute (threads, renderers): a run resumed
# with other values continues the same run, so resume checks leave them out (`outcome_fields`).
EXECUTION_FIELDS = ("num_threads", "render_threads", "render_isolation")


def outcome_fields(config: EnvConfig) -> dict[str, Any]:
    """``config`` as a dict without its `EXECUTION_FIELDS`: what two runs must share to continue one another."""
    return {k: v for k, v in asdict(config).items() if k not in EXECUTION_FIELDS}


# -- what every backend shares: world selection, seeds, features ---------------------------------


def render_thread_count(config: EnvConfig) -> int:
    """Threads (or worker processes) that render the camera images of ``config``'s worlds: ``render_threads`` (0 =
    one per CPU core), never more than the worlds, 1 when no camera is rendered."""
    if config.render_threads < 0:
        raise ValueError(f"--env.render_threads must be >= 0 (0 = one per CPU core), got {config.render_threads}")
    if config.render_isolation not in ("thread", "process"):
        raise ValueError(f"--env.render_isolation must be thread or process, got {config.render_isolation!r}")
    if not config.cameras:
        return 1
    return max(1, min(config.render_threads or os.cpu_count() or 1, config.num_envs))


def is_batch_seed(seed: Any) -> bool:
    """True for None or one int (a seed of the whole batch), False for one seed per selected world."""
    return seed is None or isinstance(seed, int | np.integer)


def per_world_seeds(seed: Sequence[int], count: int) -> list[int]:
    """One seed per selected world, checked: ``count`` ints."""
    seeds = [int(s) for s in seed]
    if len(seeds) != count:
        raise ValueError(f"{count} worlds need {count} seeds (one each) or a single int, got {len(seeds)}")
    return seeds


def batch_world_seed(seed: int, world: int) -> np.random.SeedSequence:
    """The stream world ``world`` draws its episodes from after a reset of the whole batch with the one int
    ``seed``: child ``world`` of ``SeedSequence(seed)`` (what ``spawn`` gives, whatever the batch's size).
    Passed as one world's seed (`seed_sequences`), it starts that world's episode in a batch of any size."""
    return np.random.SeedSequence(int(seed), spawn_key=(int(world),))


def seed_sequences(seed: int | Sequence[int] | None, worlds: np.ndarray) -> list | None:
    """The seed of each of ``worlds`` (k,) as a ``np.random.SeedSequence``, or None for "no seed given".

    One int: world i gets `batch_world_seed` (seed, i), what a full reset with that seed gives it. One
    seed per world: an int s gives ``SeedSequence(s)``, so equal seeds, equal streams; a ``SeedSequence``
    (`batch_world_seed`'s, say) is that world's stream as it is.
    """
    if seed is None:
        return None
    if is_batch_seed(seed):
        return [batch_world_seed(int(seed), w) for w in worlds]
    given = list(seed)
    if len(given) != len(worlds):
        raise ValueError(f"{len(worlds)} worlds need {len(worlds)} seeds (one each) or a single int, got {len(given)}")
    return [s if isinstance(s, np.random.SeedSequence) else np.random.SeedSequence(int(s)) for s in given]


def env_features(
    cameras: Sequence[str], image_size: int, state_names: Sequence[str], action_names: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """LeRobot's feature dict of a batched env (see `vla_core.types.BatchedEnv.features`): square
    ``image_size`` images per camera, stored as images, then the named state and action vectors."""
    from vla_core.types import ACTION, OBS_STATE, image_key

    features: dict[str, dict[str, Any]] = {
        image_key(cam): {
            "dtype": "image",
            "shape": (image_size, image_size, 3),
            "names": ["height", "width", "channels"],
        }
        for cam in cameras
    }
    features[OBS_STATE] = {"dtype": "float32", "shape": (len(state_names),), "names": list(state_names)}
    features[ACTION] = {"dtype": "float32", "shape": (len(action_names),), "names": list(action_names)}
    return features


def reseed(streams: list[np.random.Generator], seed: int | Sequence[int] | None, worlds: np.ndarray) -> None:
    """Give each of ``worlds`` the random stream of its seed (`seed_sequences`); with no seed
    (None) they keep drawing from their own streams, as an autoreset does."""
    seeds = seed_sequences(seed, worlds)
    for w, s in zip(worlds, seeds or []):
        streams[w] = np.random.default_rng(s)
