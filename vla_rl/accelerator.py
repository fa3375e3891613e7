"""The accelerate ``Accelerator`` of the training commands (``vla-rl train``, ``vla-rl finetune``)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_accelerator(trackers: list[str], project_dir: Path):
    """accelerate's Accelerator for a training command (``vla-rl train``, ``vla-rl finetune``).

    Under ``accelerate launch`` it joins the launched processes into one data-parallel run. Without
    a GPU, accelerate does that only when told to use the CPU; otherwise each process would run
    alone, unaware of the others.
    """
    from accelerate import Accelerator

    return Accelerator(cpu=not torch.cuda.is_available(), log_with=trackers or None, project_dir=str(project_dir))
