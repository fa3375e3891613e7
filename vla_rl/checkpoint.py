"""Checkpoint directories, written atomically.

Layout of ``<output_dir>/checkpoints/step-<NNNNNNNN>/`` (LeRobot's: a ``pretrained_model`` beside
the ``training_state``):

- ``pretrained_model/``: the policy as ``PreTrainedPolicy.save_pretrained`` writes it, which is
  what ``vla-rl eval`` and ``vla-rl serve`` load:
  - ``config.json``: ``{"type": "vla_rl_<policy type>", <config fields>}``
  - ``model.safetensors``: weights (EMA weights when EMA is on), normalization buffers included
  - ``stats.json``: the normalization statistics, human readable
- ``metadata.json``: step, dataset, git revision, vla-rl version, time
- ``training_state/``: what ``--resume`` needs, written by accelerate's ``save_state`` (raw weights,
  optimizer, registered objects such as the LR schedule and the EMA, every process's RNG) plus
  ``progress.pt`` (step, loss curve, sampling generators; see ``vla_rl.train``)

Each checkpoint is written into a hidden temporary directory and renamed into place, and
``checkpoints/last`` is a symlink swapped with an atomic rename, so a killed process never
leaves a partial checkpoint where a reader looks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import vla_rl

POLICY_DIR, TRAINING_STATE_DIR, METADATA_FILE = "pretrained_model", "training_state", "metadata.json"


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=False,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def temporary_checkpoint_dir(checkpoints_dir: Path, step: int) -> Path:
    """Where step ``step``'s checkpoint is written before it is renamed into place. The name is the same
    in every process, so the processes of a data-parallel run write into one directory."""
    return checkpoints_dir / f".tmp-step-{step:08d}"


def begin_checkpoint(checkpoints_dir: Path, step: int) -> Path:
    """Create and return the temporary directory of step ``step``'s checkpoint (one writer per run,
    the main process). Leftovers of a killed writer are removed first."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    for stale in checkpoints_dir.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in checkpoints_dir.glob(".last-*"):  # a link a killed writer made but never swapped in
        stale.unlink(missing_ok=True)
    tmp = temporary_checkpoint_dir(checkpoints_dir, step)
    tmp.mkdir()
    return tmp


def write_policy(checkpoint: Path, policy, metadata: dict[str, Any]) -> None:
    """Write ``pretrained_model/`` (the policy as ``save_pretrained`` writes it, plus a readable
    ``stats.json``) and ``metadata.json`` into a checkpoint directory."""
    model_dir = checkpoint / POLICY_DIR
    policy.save_pretrained(model_dir)
    state = policy.state_dict()
    stats = {k: state[k].tolist() for k in state if k.startswith(("state_", "action_"))}
    (model_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    meta = {"vla_rl_version": vla_rl.__version__, "git_revision": git_revision(), "time": time.time()}
    (checkpoint / METADATA_FILE).write_text(json.dumps({**meta, **metadata}, indent=2))


def commit_checkpoint(checkpoints_dir: Path, tmp: Path, step: int, keep_last: int = 2) -> Path:
    """Rename the finished ``tmp`` to ``step-<step>``, point ``last`` at it, prune older checkpoints."""
    final = checkpoints_dir / f"step-{step:08d}"
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    link_tmp = checkpoints_dir / f".last-{os.getpid()}"
    if link_tmp.is_symlink():
        link_tmp.unlink()
    os.symlink(final.name, link_tmp)
    os.replace(link_tmp, checkpoints_dir / "last")
    for old in sorted(checkpoints_dir.glob("step-*"))[:-keep_last]:
        shutil.rmtree(old)
    return final


def save_checkpoint(checkpoints_dir: Path, step: int, policy, metadata: dict[str, Any], keep_last: int = 2) -> Path:
    """Write a checkpoint holding only the policy (no training state) atomically; returns its directory."""
    tmp = begin_checkpoint(checkpoints_dir, step)
    write_policy(tmp, policy, {"step": step, **metadata})
    return commit_checkpoint(checkpoints_dir, tmp, step, keep_last)


def check_resume(ckpt_dir: Path, resume: bool) -> Path | None:
    """The checkpoint a run resumes from (None for a fresh run), or one line naming the fix: a fresh
    run must not overwrite checkpoints, and a resumed one needs ``checkpoints/last``."""
    has_checkpoint = (ckpt_dir / "last").exists()
    if has_checkpoint and not resume:
        raise FileExistsError(
            f"{ckpt_dir.parent} already holds checkpoints; pass --resume=true to continue, or a new --output_dir"
        )
    if resume and not has_checkpoint:
        raise FileNotFoundError(f"--resume=true but {ckpt_dir}/last does not exist; start without --resume")
    return resolve_checkpoint(ckpt_dir) if resume else None


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint dir, a ``checkpoints`` dir or a training output dir; return the checkpoint dir
    (the one holding ``pretrained_model/`` and ``metadata.json``)."""
    path = Path(path)
    for candidate in (path, path / "last", path / "checkpoints" / "last"):
        if (candidate / POLICY_DIR / "config.json").is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"no checkpoint at {path} (expected {POLICY_DIR}/config.json there, or in "
        f"{path}/checkpoints/last); train one with `vla-rl train` or pass the right --checkpoint"
    )


def resolve_policy_dir(path: str | Path) -> Path:
    """The directory holding ``config.json`` + ``model.safetensors``: ``path`` itself (a policy saved with
    ``save_pretrained``) or the ``pretrained_model/`` of the checkpoint ``path`` leads to."""
    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path.resolve()
    return resolve_checkpoint(path) / POLICY_DIR


def load_policy(
    path: str | Path, expected_type: str | None = None, device: str | torch.device = "cpu", tokenizer_dir: str = ""
):
    """Build the policy stored at ``path`` and load its weights. Returns (policy, policy directory).
    tokenizer_dir: the local folder of a LeRobot VLA's tokenizer (``--tokenizer_dir``)."""
    from policies import PreTrainedPolicy

    model_dir = resolve_policy_dir(path)
    policy = PreTrainedPolicy.from_pretrained(model_dir, device=device, tokenizer_dir=tokenizer_dir)
    if expected_type is not None and policy.config.type != expected_type:
        raise ValueError(
            f"checkpoint {model_dir} holds a {policy.config.type!r} policy, but {expected_type!r} was asked for; "
            f"set policy.type={policy.config.type} or choose a {expected_type} checkpoint"
        )
    return policy, model_dir
