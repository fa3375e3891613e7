"""A fine-tuning run's checkpoints: ``checkpoints/step-<iteration>/`` holds the policy as ``vla-rl eval`` and
``vla-rl serve`` load it, and ``training_state/finetune_state.pt`` what ``--resume`` needs: the run's
progress, the learner's optimizers (and critic), the curriculum, and every process's random streams
and measured delay lags, so a resumed run reaches the same next update as one that was never stopped
(the delay model's generators on an accelerator included).
Written atomically by the main process; every process takes part.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch

from vla_rl.checkpoint import TRAINING_STATE_DIR, begin_checkpoint, commit_checkpoint, write_policy

STATE_FILE = "finetune_state.pt"
# The estimator a run's updates use, saved with its state: since 2026-12-06 each decision is scored on the rows of
# its chunk that ran and credited with the steps they ran (`vla_rl.rl.rollout`). A run saved before carries none:
# it resumes, its later updates use this estimator, and its state says from which iteration
# (``state["executed_rows_credit_from"]``, in the summary's ``state``).
CREDIT = "executed_rows"


def initial_checkpoint(out: Path) -> str:
    """The checkpoint the run in ``out`` started from (its KL reference)."""
    return (out / "initial_checkpoint.txt").read_text().strip()


def random_state(streams: dict[str, torch.Generator], protocols: list, delay) -> dict:
    """This process's random streams (torch's, CUDA's, numpy's, Python's and the run's generators, the
    delay model's on an accelerator too) and the lags its latency protocols measured (the ``measured``
    delay estimate reads them)."""
    return {
        "delay_devices": {name: state for name, state in delay.state_dict().items() if name != "cpu"},
        "streams": {name: g.get_state() for name, g in streams.items()},
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "lags": [protocol.saved_lags() for protocol in protocols],
    }


def save(ckpt_dir: Path, policy, learner, streams, protocols, delay, curriculum, state: dict, algo: str,
         processes) -> None:  # fmt: skip
    """Checkpoint ``step-<iteration>`` of the run (see the module docstring)."""
    random_states = processes.gather(random_state(streams, protocols, delay))
    if processes.index != 0:
        if processes.accelerator is not None:
            processes.accelerator.wait_for_everyone()
        return
    iteration = state["iteration"]
    tmp = begin_checkpoint(ckpt_dir, iteration)
    write_policy(tmp, policy, {"step": iteration, "finetune": {"algo": algo, "env_steps": state["env_steps"]}})
    training = tmp / TRAINING_STATE_DIR
    training.mkdir()
    saved = {"state": state, **learner.state_dict(), "curriculum": curriculum.state_dict(), "processes": random_states,
             "credit": CREDIT}  # fmt: skip
    torch.save(saved, training / STATE_FILE)
    commit_checkpoint(ckpt_dir, tmp, iteration)
    if processes.accelerator is not None:
        processes.accelerator.wait_for_everyone()


def load(directory: Path, learner, streams, protocols, delay, curriculum, processes) -> dict:
    """Restore the run saved in ``directory`` (a ``training_state/``) into the learner, the streams, the
    protocols, the delay model and the curriculum; returns the run's progress (``state``)."""
    saved = torch.load(directory / STATE_FILE, weights_only=False)
    state = saved["state"]
    if saved.get("credit") != CREDIT and "executed_rows_credit_from" not in state:
        state["executed_rows_credit_from"] = state["iteration"]
        if processes.index == 0:
            print(f"note: {directory} was fine-tuned scoring every chunk row and crediting each decision from request "
                  f"to request; from iteration {state['iteration']} on it scores only the rows that ran and credits the "
                  f"steps they ran (vla_rl.rl.rollout)", file=sys.stderr)  # fmt: skip
    try:
        learner.load_state_dict(
            saved, {"actor": state["skipped_actor_updates"], "critic": state["skipped_critic_updates"]}
        )
    except ValueError as err:
        raise ValueError(f"{directory} {err}") from None
    curriculum.load_state_dict(saved["curriculum"])
    if len(saved["processes"]) != processes.count:
        raise ValueError(
            f"{directory} was written by {len(saved['processes'])} processes; resume it with as many "
            f"(accelerate launch --num_processes={len(saved['processes'])})"
        )
    mine = saved["processes"][processes.index]
    for name, g in streams.items():
        g.set_state(mine["streams"][name])
    torch.set_rng_state(mine["torch_rng"])
    if mine["cuda_rng"]:
        torch.cuda.set_rng_state_all(mine["cuda_rng"])
    for protocol, lags in zip(protocols, mine["lags"], strict=True):
        protocol.restore_lags(lags, str(directory / STATE_FILE))
    delay.load_state_dict(mine.get("delay_devices", {}))  # written since 0.3; the CPU one is a stream above
    np.random.set_state(mine["numpy_rng"])
    random.setstate(mine["python_rng"])
    return state


def check_in_sync(modules: list[torch.nn.Module], processes) -> list[float]:
    """Every process's checksum of its weights; a data-parallel run whose processes disagree stops."""
    checksum = float(sum(p.detach().double().abs().sum() for m in modules for p in m.parameters()))
    sums = processes.gather(checksum)
    if len(set(sums)) > 1:
        raise RuntimeError(f"the data-parallel processes' weights differ after an update (checksums {sums}); a bug")
    return sums
