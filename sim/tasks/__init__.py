"""Tabletop task definitions: scene, reset distribution, success check and scripted expert."""

from sim.tasks.lift import LiftExpert, LiftTask

TASKS = {"lift": LiftTask}
EXPERTS = {"lift": LiftExpert}


def get_task(name: str):
    """Build a task by name; unknown names list the valid ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]()
