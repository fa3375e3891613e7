"""Checkpoint directories, written atomically.

Layout of ``<output_dir>/checkpoints/step-<NNNNNNNN>/``:

- ``model.safetensors``: policy weights (EMA weights when EMA is on), normalization buffers included
- ``config.json``: ``{"policy_type": ..., "policy": <policy config>}``
- ``stats.json``: the normalization statistics, human readable
- ``metadata.json``: step, dataset, git revision, vla-rl version, time
- ``training_state.pt``: optimizer, LR schedule, raw weights, RNG state and loss history (for --resume)

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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import vla_rl


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


def save_checkpoint(
    checkpoints_dir: Path,
    step: int,
    policy: torch.nn.Module,
    metadata: dict[str, Any],
    training_state: dict[str, Any] | None = None,
    keep_last: int = 2,
) -> Path:
    """Write ``step-<step>`` atomically, point ``last`` at it, and prune older checkpoints."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / f"step-{step:08d}"
    tmp = checkpoints_dir / f".tmp-step-{step:08d}-{os.getpid()}"
    for stale in checkpoints_dir.glob(".tmp-step-*"):  # left by a killed writer (one writer per run)
        shutil.rmtree(stale, ignore_errors=True)
    for stale in checkpoints_dir.glob(".last-*"):  # a link a killed writer made but never swapped in
        stale.unlink(missing_ok=True)
    tmp.mkdir()
    state = {k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(
        json.dumps({"policy_type": policy.policy_type, "policy": asdict(policy.config)}, indent=2)
    )
    stats = {k: state[k].tolist() for k in state if k.startswith(("state_", "action_"))}
    (tmp / "stats.json").write_text(json.dumps(stats, indent=2))
    meta = {"step": step, "vla_rl_version": vla_rl.__version__, "git_revision": git_revision(), "time": time.time()}
    (tmp / "metadata.json").write_text(json.dumps({**meta, **metadata}, indent=2))
    if training_state is not None:
        torch.save(training_state, tmp / "training_state.pt")
    for f in tmp.iterdir():
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


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint dir, a ``checkpoints`` dir or a training output dir; return the checkpoint dir."""
    path = Path(path)
    for candidate in (path, path / "last", path / "checkpoints" / "last"):
        if (candidate / "model.safetensors").is_file() and (candidate / "config.json").is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"no checkpoint at {path} (expected model.safetensors and config.json there, or in "
        f"{path}/checkpoints/last); train one with `vla-rl train` or pass the right --checkpoint"
    )


def load_policy(path: str | Path, expected_type: str | None = None, device: str | torch.device = "cpu"):
    """Build the policy stored at ``path`` and load its weights. Returns (policy, checkpoint_dir)."""
    from policies import POLICY_TYPES

    ckpt = resolve_checkpoint(path)
    config = json.loads((ckpt / "config.json").read_text())
    policy_type = config.get("policy_type")
    if policy_type is None:
        other = config.get("type", "unknown")
        raise ValueError(
            f"{ckpt} is not a vla-rl checkpoint (config.json has no policy_type; it looks like a {other!r} "
            f"policy from another tool); pass a directory written by `vla-rl train`"
        )
    if expected_type is not None and policy_type != expected_type:
        raise ValueError(
            f"checkpoint {ckpt} holds a {policy_type!r} policy, but {expected_type!r} was asked for; "
            f"set policy.type={policy_type} or choose a {expected_type} checkpoint"
        )
    if policy_type not in POLICY_TYPES:
        raise ValueError(f"checkpoint {ckpt} has unknown policy type {policy_type!r}; known: {sorted(POLICY_TYPES)}")
    config_cls, policy_cls = POLICY_TYPES[policy_type]
    policy = policy_cls(config_cls(**config["policy"]))
    policy.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    return policy.to(device).eval(), ckpt
