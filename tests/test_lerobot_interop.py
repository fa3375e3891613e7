"""Policies cross between LeRobot and vla-rl both ways, through one door each side:

- LeRobot's own loaders read a vla-rl checkpoint through the `lerobot_policy_vla_rl` plugin (plugins/);
- vla-rl's loader (`load_policy`, so `vla-rl eval` and `vla-rl serve`) reads a directory LeRobot wrote.
"""

import json

import torch

from vla_rl.checkpoint import load_policy, resolve_policy_dir


def _lerobot_with_plugins():
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()  # imports every installed `lerobot_policy_*` distribution, as LeRobot's scripts do
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class

    return PreTrainedConfig, get_policy_class


def _observation(cfg, b=2):
    gen = torch.Generator().manual_seed(0)
    obs = {f"observation.images.{cam}": torch.rand(b, 3, cfg.image_size, cfg.image_size, generator=gen)
           for cam in cfg.cameras}  # fmt: skip
    obs["observation.state"] = torch.randn(b, cfg.state_dim, generator=gen)
    obs["task"] = ["lift the cube"] * b
    return obs


def test_lerobot_loads_a_vla_rl_checkpoint_and_predicts_the_same_chunks(tiny_checkpoint, tmp_path):
    PreTrainedConfig, get_policy_class = _lerobot_with_plugins()
    model_dir = resolve_policy_dir(tiny_checkpoint[0])
    ours, _ = load_policy(model_dir)

    config = PreTrainedConfig.from_pretrained(model_dir)
    assert config.type == "vla_rl_diffusion"
    assert (config.horizon, config.state_dim, config.cameras) == (ours.config.horizon, 11, ours.config.cameras)
    theirs = get_policy_class(config.type).from_pretrained(model_dir)
    for name, value in ours.state_dict().items():  # every weight and statistic, under its vla-rl name
        torch.testing.assert_close(theirs.model.state_dict()[name], value, rtol=0, atol=0)

    obs = _observation(ours.config)
    noise = torch.randn(2, ours.config.horizon, ours.config.action_dim)
    expected = ours.predict_chunk(obs, noise=noise).actions
    torch.testing.assert_close(theirs.predict_action_chunk(obs, noise=noise), expected, rtol=0, atol=0)

    # LeRobot's scripts load the processors saved beside the model: they batch and move, nothing else.
    from lerobot.policies.factory import make_pre_post_processors

    pre, post = make_pre_post_processors(config, pretrained_path=str(model_dir))
    single = {k: v[0] for k, v in obs.items()}  # one unbatched frame, as a LeRobot env gives it
    got = post(theirs.predict_action_chunk(pre(single), noise=noise[:1]))
    # Compared with a batch of one on our side too: kernels for other batch sizes round differently.
    one = ours.predict_chunk({k: v[:1] for k, v in obs.items()}, noise=noise[:1]).actions
    torch.testing.assert_close(got, one, rtol=0, atol=0)

    # select_action serves the first n_action_steps actions of one chunk, then asks for a new one.
    theirs.reset()
    torch.manual_seed(7)
    first = [theirs.select_action(obs) for _ in range(ours.config.n_action_steps)]
    torch.manual_seed(7)
    chunk = ours.predict_chunk(obs).actions
    torch.testing.assert_close(torch.stack(first, 1), chunk[:, : ours.config.n_action_steps], rtol=0, atol=0)

    # What LeRobot saves, vla-rl loads, with LeRobot's extra base fields ignored.
    theirs.save_pretrained(tmp_path / "saved_by_lerobot")
    saved = json.loads((tmp_path / "saved_by_lerobot" / "config.json").read_text())
    assert saved["type"] == "vla_rl_diffusion" and "n_obs_steps" in saved
    again, _ = load_policy(tmp_path / "saved_by_lerobot")
    torch.testing.assert_close(again.predict_chunk(obs, noise=noise).actions, expected, rtol=0, atol=0)


def _lerobot_act_policy(directory):
    """A small random ACT policy saved by LeRobot with its processors, for the default lift env."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.act.modeling_act import ACTPolicy
    from lerobot.policies.factory import make_pre_post_processors

    cfg = ACTConfig(
        input_features={"observation.images.front": PolicyFeature(FeatureType.VISUAL, (3, 64, 64)),
                        "observation.state": PolicyFeature(FeatureType.STATE, (11,))},
        output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))},
        chunk_size=8, n_action_steps=4, dim_model=32, n_heads=2, dim_feedforward=64, n_encoder_layers=1,
        n_decoder_layers=1, use_vae=False, pretrained_backbone_weights=None, device="cpu",
    )  # fmt: skip
    torch.manual_seed(0)
    policy = ACTPolicy(cfg)
    stats = {
        "observation.state": {"mean": torch.zeros(11), "std": torch.ones(11)},
        "action": {"mean": torch.tensor([0.5, 0.0, 0.2, 0.5]), "std": torch.tensor([0.1, 0.1, 0.1, 0.5])},
        "observation.images.front": {"mean": torch.full((3, 1, 1), 0.5), "std": torch.full((3, 1, 1), 0.25)},
    }
    pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
    for part in (policy, pre, post):
        part.save_pretrained(directory)
    return policy, pre, post


def test_a_lerobot_policy_runs_behind_the_vla_rl_contract_and_in_eval(tmp_path):
    from sim.config import EnvConfig
    from vla_rl.eval import EvalConfig, evaluate

    lerobot_dir = tmp_path / "act"
    act, pre, post = _lerobot_act_policy(lerobot_dir)
    policy, _ = load_policy(lerobot_dir)
    cfg = policy.config
    assert (cfg.type, cfg.lerobot_type) == ("lerobot", "act")
    # The fields every vla-rl policy has, read from LeRobot's features and chunk length.
    assert (cfg.horizon, cfg.n_action_steps, cfg.cameras, cfg.image_size) == (8, 4, ["front"], 64)
    assert (cfg.state_dim, cfg.action_dim) == (11, 4)

    obs = _observation(cfg)
    expected = post(act.predict_action_chunk(pre(dict(obs))))  # LeRobot's own pipeline, by hand
    chunk = policy.predict_chunk(obs, torch.tensor([3, 4]))
    torch.testing.assert_close(chunk.actions, expected, rtol=0, atol=0)
    assert chunk.obs_step.tolist() == [3, 4]

    # The same door serves `vla-rl eval`: the LeRobot policy drives the sim suite.
    result = evaluate(EvalConfig(checkpoint=str(lerobot_dir), env=EnvConfig(num_envs=2, max_episode_steps=8),
                                 num_episodes=2, video_episodes=0, output_dir=str(tmp_path / "eval")))  # fmt: skip
    assert result["episodes"] == 2 and all(1 <= e["length"] <= 8 for e in result["per_episode"])


def test_the_lerobot_fields_vla_rl_ignores_are_the_installed_lerobots():
    from dataclasses import fields

    from lerobot.configs.policies import PreTrainedConfig

    from policies.pretrained import LEROBOT_FIELDS

    assert {f.name for f in fields(PreTrainedConfig)} == LEROBOT_FIELDS
