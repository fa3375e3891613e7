"""A training config as JSON: what ``vla-rl train`` writes as ``train_config.json`` and into every
checkpoint's metadata, and the flat form its trackers log. A composition that reuses a finished run
compares the saved file with ``config_dict`` of the config it would run (``vla_rl.stages.config_dict``)."""

from __future__ import annotations

from dataclasses import asdict


def config_dict(cfg) -> dict:
    """asdict(cfg) plus the policy's type, which asdict leaves out (``cfg.policy``: a ``PolicyConfig``)."""
    d = asdict(cfg)
    d["policy"] = {"type": cfg.policy.type, **d["policy"]}
    return d


def flat_dict(d: dict, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys; a value other than int, float, str or bool as its str."""
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(flat_dict(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return flat


def chunking_made_with(chunking, tasks: list[str]) -> dict:
    """``asdict(chunking)`` as a resume check compares it: ``on_new_instruction`` left out where no task of ``tasks``
    has an instruction that changes, since every rule then runs alike and a run saved before the field holds none."""
    from sim.tasks import instruction_changes

    d = asdict(chunking)
    if not any(instruction_changes(task) for task in tasks):
        d.pop("on_new_instruction")
    return d
