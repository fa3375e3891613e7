"""The LIBERO evaluation protocols in use, by name: how many episodes each task runs from which initial
states, how many no-op settle steps follow each reset, where an episode is cut off, and what counts as a
success. `vla-rl eval --protocol=<name>` runs one; every LIBERO number vla-rl reports names it.

| name | source | episodes per task | settle | max steps Spatial / Object / Goal / 10 / 90 |
|---|---|---|---|---|
| ``openpi`` | openpi ``examples/libero/main.py``; OpenVLA and OpenVLA-OFT ``run_libero_eval.py`` | 50 | 10 | 220 / 280 / 300 / 520 / 400 |
| ``lerobot`` | LeRobot ``lerobot.envs.libero`` (``TASK_SUITE_MAX_STEPS``), as ``lerobot-eval`` runs it | 10 | 10 | 280 / 280 / 300 / 520 / 400 |
| ``rlinf`` | RLinf's LIBERO env (all 500 initial states of a 10-task suite) | 50 | 15 | 512 everywhere |
| ``simplevla`` | SimpleVLA-RL | 50 | 10 | 512 everywhere |

Under every protocol episode i of a task starts from the task's fixed initial state i (LIBERO ships 50 per
task), after ``settle_steps`` no-op actions, and ends with success at the first step the task's goal
predicate holds (LeRobot's ``LiberoEnv`` terminates there). RLinf reports ``success_once``, whether the
predicate held at any step within the limit: the same outcome per episode; only the episode lengths of a
run that goes on after a success would differ. RLinf evaluates pi0.5 on LIBERO-Long with 480 steps, not
512; OpenVLA-OFT reports the mean of three seeds. Neither is a preset here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sim.config import EnvConfig
from sim.factory import LIBERO_PREFIX

LIBERO_CAMERAS = ["image", "image2"]  # agentview and wrist, as the lerobot/libero datasets hold them
LIBERO_IMAGE_SIZE = 256  # their image side, pixels
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
INITIAL_STATES_PER_TASK = 50  # LIBERO's fixed initial states of each task


@dataclass(frozen=True)
class LiberoProtocol:
    """One protocol (see the module doc): ``max_steps`` per suite, in control steps after settling."""

    name: str
    source: str
    episodes_per_task: int
    settle_steps: int
    max_steps: dict[str, int]

    def limit(self, suite: str) -> int:
        return self.max_steps[suite]


def _limits(*steps: int) -> dict[str, int]:
    return dict(zip(SUITES, steps, strict=True))


PROTOCOLS: dict[str, LiberoProtocol] = {
    p.name: p
    for p in (
        LiberoProtocol("openpi", "openpi examples/libero/main.py; OpenVLA(-OFT) run_libero_eval.py", 50, 10,
                       _limits(220, 280, 300, 520, 400)),
        LiberoProtocol("lerobot", "LeRobot lerobot.envs.libero TASK_SUITE_MAX_STEPS (lerobot-eval)", 10, 10,
                       _limits(280, 280, 300, 520, 400)),
        LiberoProtocol("rlinf", "RLinf LIBERO env (success_once)", 50, 15, _limits(512, 512, 512, 512, 512)),
        LiberoProtocol("simplevla", "SimpleVLA-RL", 50, 10, _limits(512, 512, 512, 512, 512)),
    )
}  # fmt: skip
DEFAULT_PROTOCOL = "openpi"


def protocol(name: str) -> LiberoProtocol:
    """The protocol called ``name``; ValueError naming the valid ones."""
    if name not in PROTOCOLS:
        raise ValueError(f"unknown LIBERO protocol {name!r}; choose --protocol= one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def with_libero_cameras(env: EnvConfig) -> EnvConfig:
    """The cameras LIBERO policies expect, where ``env`` still has the MuJoCo tasks' default camera (front,
    which LIBERO lacks): both cameras, at 256 px unless an image size was given."""
    default = EnvConfig()
    if list(env.cameras) != list(default.cameras):
        return env
    size = LIBERO_IMAGE_SIZE if env.image_size == default.image_size else env.image_size
    return replace(env, cameras=list(LIBERO_CAMERAS), image_size=size)


def is_libero_task(task: str) -> bool:
    """Whether an ``--env.task`` names a LIBERO suite or one of its tasks (``libero_spatial``, ``libero_10/3``)."""
    return task.startswith(LIBERO_PREFIX)
