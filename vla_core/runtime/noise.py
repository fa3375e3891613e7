"""The sampling noise of one request, the same in every process: what lets a served episode and its
simulated twin (`vla-rl bench robot-parity`) sample alike.

A denoising policy starts each chunk from noise (`Policy.predict_chunk`'s ``noise``). Drawn from a
process's own random stream, the noise of a request depends on everything that process drew before
(other worlds, other episodes, the robot's start-up); keyed by (seed, episode, request) it depends
on nothing else. `vla-rl eval --noise_seed` and `vla-rl serve --noise_seed` both draw it here.
"""

from __future__ import annotations

import numpy as np
import torch


def request_noise(seed: int, episode: int, request: int, *shape: int) -> torch.Tensor:
    """(1, *shape) float32 standard normal noise of request ``request`` (its index in the episode, from 0) of
    episode ``episode`` of a run seeded ``seed``, all >= 0, on the CPU; ``shape`` is the policy's
    ``noise_shape`` (`vla_core.types.FlowSteerable`: (horizon, action_dim) for vla-rl's own policies, the
    padded (chunk_size, max_action_dim) for a LeRobot flow VLA). Equal keys give equal noise in any process;
    different keys, independent noise (numpy's ``SeedSequence`` mixes the key)."""
    if min(seed, episode, request) < 0:
        raise ValueError(
            f"the noise of a request is keyed by seed, episode and request >= 0, got {seed, episode, request}"
        )
    key = np.random.SeedSequence([seed, episode, request]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator().manual_seed(int(key[0]) << 32 | int(key[1]))
    return torch.randn((1, *shape), generator=generator)


def noise_shape(policy) -> tuple[int, ...]:
    """The shape of one sample's initial noise: the policy's ``noise_shape`` (`vla_core.types.FlowSteerable`; a
    LeRobot flow VLA's padded (chunk_size, max_action_dim)), else its config's (horizon, action_dim)."""
    try:
        return tuple(policy.noise_shape)
    except (AttributeError, ValueError):  # a policy that declares none (or samples from no noise)
        config = policy.config
        return (config.horizon, config.action_dim)
