import subprocess
import sys

import pytest
import torch

from vla_core.types import ActionChunk, image_key


def test_action_chunk_validates_shapes():
    chunk = ActionChunk(actions=torch.zeros(2, 5, 3), obs_step=torch.tensor([0, 4]))
    assert chunk.horizon == 5
    with pytest.raises(ValueError, match=r"\(B, H, A\)"):
        ActionChunk(actions=torch.zeros(5, 3), obs_step=torch.tensor([0]))
    with pytest.raises(ValueError, match=r"obs_step must be \(B,\)=\(2,\)"):
        ActionChunk(actions=torch.zeros(2, 5, 3), obs_step=torch.tensor([0, 1, 2]))


def test_feature_names_follow_lerobot():
    assert image_key("front") == "observation.images.front"


def test_importing_types_stays_light():
    code = "import sys, vla_core.types, vla_core.runtime; print(sorted(m for m in ('mujoco', 'lerobot', 'rclpy', 'diffusers', 'sim', 'policies') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
