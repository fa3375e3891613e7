"""Configuration of a LeRobot policy used through vla-rl's policy contract.

The fields every vla-rl policy has are read from the LeRobot directory's ``config.json`` (its
input and output features and its chunk length), so ``vla-rl eval`` and ``vla-rl serve`` check a
LeRobot policy against the env exactly as they check their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from policies.pretrained import PolicyConfig
from vla_core.types import ACTION, OBS_STATE, image_key


@PolicyConfig.register_subclass("lerobot")
@dataclass
class LeRobotConfig(PolicyConfig):
    """A LeRobot policy saved with ``save_pretrained`` together with its processors."""

    pretrained_path: str = ""  # local directory: config.json, model.safetensors, policy_*processor*.json
    lerobot_type: str = ""  # LeRobot's name of the policy, e.g. act (read from config.json)
    # A local directory with what the checkpoint names by hub id and cannot be fetched offline: the
    # tokenizer of its instructions (pi0, pi05: PaliGemma's), for SmolVLA also its VLM's config.json.
    # "": the checkpoint's own tokenizer/ folder (vla-rl writes one), else the local Hugging Face cache.
    tokenizer_dir: str = ""
    num_inference_steps: int = 0  # Euler steps of a flow VLA's sampler (pi0, pi05, SmolVLA); 0: none

    @classmethod
    def from_directory(cls, directory: str | Path, tokenizer_dir: str = "") -> LeRobotConfig:
        """The config of the LeRobot policy in ``directory``; ValueError naming the problem if LeRobot
        (with every installed LeRobot plugin) cannot read it. tokenizer_dir: see the field."""
        lerobot_config = load_lerobot_config(directory)
        visual = [k for k, f in lerobot_config.input_features.items() if k.startswith(image_key(""))]
        if OBS_STATE not in lerobot_config.input_features or not visual or ACTION not in lerobot_config.output_features:
            raise ValueError(
                f"the LeRobot policy in {directory} must read {OBS_STATE} and at least one camera and write "
                f"{ACTION}; it has inputs {sorted(lerobot_config.input_features)}"
            )
        sides = {tuple(lerobot_config.input_features[k].shape[-2:]) for k in visual}
        if len(sides) != 1 or len(next(iter(sides))) != 2 or len(set(next(iter(sides)))) != 1:
            raise ValueError(f"the LeRobot policy in {directory} must take square images of one size, got {sides}")
        if lerobot_config.n_obs_steps != 1:
            raise ValueError(
                f"the LeRobot {lerobot_config.type} policy in {directory} reads {lerobot_config.n_obs_steps} "
                f"observation frames; vla-rl's observation batch holds one (n_obs_steps=1 policies: ACT, pi0, SmolVLA, ...)"
            )
        horizon = len(lerobot_config.action_delta_indices)
        return cls(
            pretrained_path=str(Path(directory).resolve()),
            lerobot_type=lerobot_config.type,
            horizon=horizon,
            n_action_steps=min(getattr(lerobot_config, "n_action_steps", horizon), horizon),
            image_size=next(iter(sides))[0],
            crop_shift=0,
            state_dim=lerobot_config.input_features[OBS_STATE].shape[0],
            action_dim=lerobot_config.output_features[ACTION].shape[0],
            cameras=[k.removeprefix(image_key("")) for k in visual],
            tokenizer_dir=str(Path(tokenizer_dir).resolve()) if tokenizer_dir else "",
            # pi0 and pi05 call them num_inference_steps, SmolVLA num_steps
            num_inference_steps=int(
                getattr(lerobot_config, "num_inference_steps", 0) or getattr(lerobot_config, "num_steps", 0) or 0
            ),
        )

    def fit_to_dataset(self, features: dict[str, dict], tasks: list[str], cameras: list[str] | None = None) -> None:
        raise ValueError("vla-rl train does not train LeRobot policies from scratch; use LeRobot's lerobot-train")


def load_lerobot_config(directory: str | Path):
    """LeRobot's ``PreTrainedConfig`` of a directory, after LeRobot has imported its installed plugins."""
    import lerobot.policies  # noqa: F401  (registers LeRobot's own policy types)
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()
    try:
        return PreTrainedConfig.from_pretrained(str(directory))
    except Exception as e:  # draccus and LeRobot raise many kinds; the message is what matters
        raise ValueError(f"{directory} is neither a vla-rl checkpoint nor a policy LeRobot can load: {e}") from e
