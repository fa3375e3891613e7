"""`vla-rl pretrain-encoder`: towers written as a SigLIP folder that `--policy.pretrained_encoder` loads as it loads
`google/siglip-*` (and a checkpoint then loads without it), the probe's regression checked on features whose
answer is known, and a finished output reused."""

from types import SimpleNamespace

import pytest
import torch

from vla_rl.pretrain_encoder import PretrainEncoderConfig, pretrain_encoder, probe_cm


def test_the_probe_is_exact_on_features_linear_in_the_position_and_poor_on_noise():
    """Features = a fixed linear map of the object's position (the last 3 of 6 targets): the ridge probe's error
    is under 0.5 cm; features of pure noise: several cm (positions spread over tens of cm)."""
    g = torch.Generator().manual_seed(0)
    targets = torch.rand(400, 6, generator=g) * 0.4
    mixing = torch.randn(3, 16, generator=g)

    def model_of(make):
        return SimpleNamespace(vision_model=lambda pixel_values: SimpleNamespace(last_hidden_state=make(pixel_values)))

    # The "images" carry the row index; the stub turns it into that row's features.
    images = torch.arange(400, dtype=torch.float32).view(400, 1, 1, 1).expand(400, 1, 2, 2)
    linear = model_of(lambda px: (targets[((px[:, 0, 0, 0] + 1) / 2).round().long(), 3:] @ mixing)[:, None])
    noise = model_of(lambda px: torch.randn(len(px), 1, 16, generator=g))
    assert probe_cm(linear, images[:300], targets[:300], images[300:], targets[300:], ridge=1e-6) < 0.5
    assert probe_cm(noise, images[:300], targets[:300], images[300:], targets[300:]) > 5.0


def test_pretrained_towers_load_as_a_siglip_folder_into_a_policy_and_are_reused(tmp_path):
    from transformers import AutoTokenizer, SiglipTextModel, SiglipVisionModel

    cfg = PretrainEncoderConfig(tasks=["lift", "reach"], images_per_task=24, image_size=32, vision_width=32,
                                vision_layers=1, text_width=16, text_layers=1, heads=2, steps=3, batch_size=8,
                                num_envs=8, num_threads=1, output_dir=str(tmp_path / "enc"))  # fmt: skip
    summary = pretrain_encoder(cfg)
    assert summary["frames"] == 48 and summary["held_out"] == 4
    probe = summary["probe_error_cm"]
    assert probe["pretrained"] > 0 and probe["random_towers"] > 0
    per_task = probe["pretrained_per_task"]
    assert per_task and set(per_task) <= {"lift", "reach"} and all(e > 0 for e in per_task.values())
    # The overall error is the frame-weighted mean of the tasks' means, so it lies between them (2-digit rounding).
    assert min(per_task.values()) - 0.01 <= probe["pretrained"] <= max(per_task.values()) + 0.01
    directory = tmp_path / "enc"
    vision, text = SiglipVisionModel.from_pretrained(directory), SiglipTextModel.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert vision.config.hidden_size == 32 and text.config.hidden_size == 16
    ids = tokenizer(["Pick up the red cube"], padding="max_length", max_length=8)["input_ids"][0]
    assert tokenizer.unk_token_id not in ids[:5] and ids[5:] == [tokenizer.pad_token_id] * 3
    # A diffusion VLA built on it (the path a real SigLIP takes) encodes an observation.
    from policies.diffusion_vla import DiffusionVLAConfig
    from policies.diffusion_vla.condition_encoder import ConditionEncoder

    encoder = ConditionEncoder(DiffusionVLAConfig(pretrained_encoder=str(directory), state_dim=11, action_dim=4,
                                                  cameras=["front"], image_size=32, dim=32, heads=2))  # fmt: skip
    tokens, mask = encoder([torch.rand(2, 3, 32, 32)], torch.zeros(2, 11), ["pick up the red cube"] * 2)
    assert tokens.shape[0] == 2 and mask.shape == tokens.shape[:2] and torch.isfinite(tokens).all()
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert pretrain_encoder(cfg) == summary and (directory / "model.safetensors").stat().st_mtime_ns == written
    with pytest.raises(ValueError, match="unknown task"):
        pretrain_encoder(PretrainEncoderConfig(tasks=["nope"], output_dir=str(tmp_path / "bad")))
