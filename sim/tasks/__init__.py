"""Tabletop task definitions: scene, reset distribution, success check and scripted expert.

Every task shares the same arm, camera and 4-D action (``sim/assets/panda_arm.xml``); see
``sim.tasks.base`` for what a task and an expert provide.
"""

from sim.tasks.base import Expert, Task
from sim.tasks.lift import LiftExpert, LiftTask
from sim.tasks.open_drawer import OpenDrawerExpert, OpenDrawerTask
from sim.tasks.pick_place import PickPlaceExpert, PickPlaceTask
from sim.tasks.push import PushExpert, PushTask
from sim.tasks.push_impulse import PushImpulseTask
from sim.tasks.reach import ReachExpert, ReachTask
from sim.tasks.reach_switch import ReachSwitchExpert, ReachSwitchTask
from sim.tasks.stack import StackTask
from sim.tasks.track import TrackExpert, TrackTask
from sim.tasks.track_jump import TrackJumpExpert, TrackJumpTask
from sim.tasks.track_reverse import TrackReverseTask

TASKS: dict[str, type[Task]] = {
    "lift": LiftTask,
    "reach": ReachTask,
    "push": PushTask,
    "pick_place": PickPlaceTask,
    "stack": StackTask,
    "open_drawer": OpenDrawerTask,
    "track": TrackTask,
    "track_reverse": TrackReverseTask,
    "push_impulse": PushImpulseTask,
    "track_jump": TrackJumpTask,
    "reach_switch": ReachSwitchTask,
}
EXPERTS: dict[str, type[Expert]] = {
    "lift": LiftExpert,
    "reach": ReachExpert,
    "push": PushExpert,
    "pick_place": PickPlaceExpert,
    "stack": PickPlaceExpert,  # the same carry-and-release script; the place target is on the blue cube
    "open_drawer": OpenDrawerExpert,
    "track": TrackExpert,
    "track_reverse": TrackExpert,  # it reads the ball's current velocity, so it follows every turn
    "push_impulse": PushExpert,  # it reads the cube's current position, and starts again when it slips away
    "track_jump": TrackJumpExpert,  # it reads where the ball is now, so it follows every jump
    "reach_switch": ReachSwitchExpert,
}


def instruction_changes(name: str) -> bool:
    """Whether task ``name``'s instruction can change mid-episode (`reach_switch`); False for a task of another
    simulator (LIBERO's, robosuite's, RLBench's) or none."""
    return name in TASKS and hasattr(TASKS[name], "instructions_of")


def get_task(name: str) -> Task:
    """Build a task by name; unknown names list the valid ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]()
