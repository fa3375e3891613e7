"""The base of every policy config: one draccus choice per policy type (``--policy.type=...``)."""

from __future__ import annotations

from dataclasses import dataclass

import draccus


@dataclass
class PolicyConfig(draccus.ChoiceRegistry):
    """Fields every policy has, so evaluation and deployment can drive any of them."""

    @classmethod
    def default_choice_name(cls) -> str:
        # `--policy.horizon=8` without `--policy.type` keeps meaning the small diffusion policy.
        return "diffusion"

    @property
    def type(self) -> str:
        return self.get_choice_name(type(self))
