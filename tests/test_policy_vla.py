"""The diffusion VLA: Level-2 minibatching isolation, objectives, inpainting, and input checks."""

import shutil

import pytest
import torch

from policies.diffusion_vla import DiffusionVLAConfig
from policies.diffusion_vla.modeling_diffusion_vla import DiffusionVLAPolicy
from policies.tokenizer import WordTokenizer, word_vocabulary
from vla_core.types import ActionChunk, Policy

INSTRUCTIONS = ["pick up the red cube", "move the gripper to the green ball"]


def make_policy(objective="flow", **kw):
    torch.manual_seed(0)
    cfg = DiffusionVLAConfig(
        state_dim=3, action_dim=2, cameras=["front", "wrist"], image_size=32, patch_size=8, horizon=6,
        n_action_steps=3, dim=32, depth=2, heads=2, vision_width=32, vision_layers=1, text_width=32,
        vocabulary=word_vocabulary(INSTRUCTIONS), objective=objective, **kw,
    )  # fmt: skip
    return DiffusionVLAPolicy(cfg).eval()


def batch(b=3, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "observation.images.front": torch.rand(b, 3, size, size, generator=g),
        "observation.images.wrist": torch.rand(b, 3, size, size, generator=g),
        "observation.state": torch.randn(b, 3, generator=g),
        "task": [INSTRUCTIONS[i % 2] for i in range(b)],
        "action": torch.rand(b, 6, 2, generator=g) * 2 - 1,
        "action_is_pad": torch.zeros(b, 6, dtype=torch.bool),
    }


def randomize(policy):
    """Random weights everywhere, AdaLN included (zero at init), so no path is trivially silent."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.dit.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return policy


def test_perturbing_one_condition_copy_cell_changes_no_other_cell():
    """Each (condition, copy) cell is its own sample: a change to one reaches no other cell, neither
    another copy of the same condition nor the same copy index of another condition."""
    policy = randomize(make_policy())
    obs = batch()
    b, k = 3, 5
    noisy = torch.randn(b, k, 6, 2)
    t = torch.rand(b, k)
    with torch.no_grad():
        cond, mask = policy.encode_observation(obs)
        base = policy.dit(noisy, t, cond, mask)
        for i, j in [(0, 0), (1, 2), (2, 4)]:
            others = torch.ones(b, k, dtype=torch.bool)
            others[i, j] = False
            moved_noise = noisy.clone()
            moved_noise[i, j] += torch.randn(6, 2)
            moved_time = t.clone()
            moved_time[i, j] = 1 - moved_time[i, j]  # the cell's own timestep: its AdaLN context
            for perturbed in (policy.dit(moved_noise, t, cond, mask), policy.dit(noisy, moved_time, cond, mask)):
                torch.testing.assert_close(perturbed[others], base[others], rtol=0, atol=1e-6)
                assert (perturbed[i, j] - base[i, j]).abs().max() > 1e-3  # the cell itself did change
        # A condition's tokens reach all K copies of that condition and no copy of any other one.
        moved_cond = cond.clone()
        moved_cond[1] += torch.randn(cond.shape[1:])
        perturbed = policy.dit(noisy, t, moved_cond, mask)
    torch.testing.assert_close(perturbed[[0, 2]], base[[0, 2]], rtol=0, atol=1e-6)
    assert ((perturbed[1] - base[1]).abs().amax(dim=(1, 2)) > 1e-3).all()


def test_a_b_by_k_pass_equals_b_times_k_single_sample_passes():
    policy = randomize(make_policy())
    obs = batch()
    b, k = 3, 4
    noisy = torch.randn(b, k, 6, 2)
    t = torch.rand(b, k)
    with torch.no_grad():
        cond, mask = policy.encode_observation(obs)
        together = policy.dit(noisy, t, cond, mask)
        single = torch.stack([
            torch.stack([
                policy.dit(noisy[i : i + 1, j : j + 1], t[i : i + 1, j : j + 1], cond[i : i + 1], mask[i : i + 1])[0, 0]
                for j in range(k)
            ])
            for i in range(b)
        ])  # fmt: skip
    assert single.shape == together.shape == (b, k, 6, 2)
    torch.testing.assert_close(together, single, rtol=1e-5, atol=1e-5)
    # The conditions differ (images, instruction length), so a mix-up between them would show here.
    assert (together[0] - together[1]).abs().max() > 1e-2


def test_per_token_timesteps_agree_with_per_copy_ones_and_stay_within_their_copy():
    """The DiT's (B, K, H) timesteps (training-time RTC: known tokens are clean): equal timesteps over a
    copy's tokens give the (B, K) result, and one token's own timestep reaches its copy only."""
    policy = randomize(make_policy())
    b, k = 2, 3
    noisy = torch.randn(b, k, 6, 2)
    t = torch.rand(b, k)
    with torch.no_grad():
        cond, mask = policy.encode_observation(batch(b=b))
        per_copy = policy.dit(noisy, t, cond, mask)
        per_token = policy.dit(noisy, t[..., None].expand(b, k, 6), cond, mask)
        torch.testing.assert_close(per_token, per_copy, rtol=1e-5, atol=1e-5)
        moved = t[..., None].repeat(1, 1, 6)
        moved[1, 2, 0] = 0.0  # the first token of condition 1's copy 2 is clean
        perturbed = policy.dit(noisy, moved, cond, mask)
    others = torch.ones(b, k, dtype=torch.bool)
    others[1, 2] = False
    torch.testing.assert_close(perturbed[others], per_token[others], rtol=0, atol=1e-6)
    # Self-attention carries the change to the copy's other tokens too.
    assert ((perturbed[1, 2] - per_token[1, 2]).abs().amax(-1) > 1e-4).all()


def test_the_encoder_runs_once_per_condition_not_per_copy():
    policy = randomize(make_policy()).train()  # AdaLN-Zero gates at 0 would block the condition's gradient
    seen = []
    policy.encoder.vision.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs["pixel_values"].shape[0]),
                                                with_kwargs=True)  # fmt: skip
    loss = policy(batch(b=3), torch.Generator().manual_seed(0), copies=8)
    assert seen == [3 * 2]  # 3 conditions x 2 cameras in one call, not 3 x 8 copies
    loss.backward()
    assert policy.encoder.vision_proj.weight.grad.abs().sum() > 0  # gradients reach the shared encoder


def test_condition_tokens_follow_the_documented_layout():
    """[front patches | wrist patches | instruction | state]: each input moves only its own tokens,
    of its own condition (the encoder acts per sample), and instruction padding is masked."""
    policy = make_policy()
    obs = batch()
    # 32 px images in 8 px patches: 16 tokens per camera; 16 instruction slots; 1 state token.
    blocks = {"observation.images.front": slice(0, 16), "observation.images.wrist": slice(16, 32),
              "task": slice(32, 48), "observation.state": slice(48, 49)}  # fmt: skip
    with torch.no_grad():
        tokens, mask = policy.encode_observation(obs)
        assert tokens.shape == (3, 49, 32) and mask.shape == (3, 49)
        for key, block in blocks.items():
            changed = {k: (list(v) if k == "task" else v.clone()) for k, v in obs.items()}
            if key == "task":
                changed[key][1] = INSTRUCTIONS[0]  # condition 1 had the other instruction
            else:
                changed[key][1] = torch.rand(changed[key][1].shape, generator=torch.Generator().manual_seed(9))
            moved = (policy.encode_observation(changed)[0] - tokens).abs().amax(-1)  # (B, L)
            expected = torch.zeros(3, 49, dtype=torch.bool)
            expected[1, block] = True
            assert torch.equal(moved > 1e-5, expected), key
    # "pick up the red cube" has 5 words, "move the gripper to the green ball" 7, of the 16 slots.
    assert mask[:, 32:48].sum(1).tolist() == [5, 7, 5]
    assert mask[:, :32].all() and mask[:, 48].all()


@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_training_with_copies_fits_a_batch_and_sampling_recovers_it(objective):
    """Both objectives learn to reproduce the demonstrated chunks of a fixed batch."""
    policy = make_policy(objective, num_inference_steps=10).train()
    data = batch(b=2)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    first = None
    for _ in range(150):
        loss = policy(data, gen, copies=16)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.25 * first
    policy.eval()
    torch.manual_seed(1)
    chunk = policy.predict_chunk(data, torch.tensor([4, 9]))
    assert isinstance(policy, Policy) and isinstance(chunk, ActionChunk)
    assert chunk.actions.shape == (2, 6, 2) and chunk.obs_step.tolist() == [4, 9]
    err = (chunk.actions - data["action"]).abs().mean().item()
    assert err < 0.2, f"mean abs error {err:.3f} of sampled chunks vs the fitted actions (range [-1, 1])"


def test_rtc_inpainting_pulls_the_weighted_steps_toward_the_target():
    policy = make_policy("flow", num_inference_steps=10)
    obs = batch(b=2)
    target = torch.full((2, 6, 2), 0.7)
    weights = torch.tensor([[1.0, 1.0, 1.0, 0.5, 0.0, 0.0]] * 2)
    torch.manual_seed(3)
    free = policy.predict_chunk(obs).actions
    torch.manual_seed(3)
    guided = policy.predict_chunk(obs, inpaint=(target, weights)).actions
    free_err = (free[:, :3] - target[:, :3]).abs().mean()
    guided_err = (guided[:, :3] - target[:, :3]).abs().mean()
    assert guided_err < 0.5 * free_err, (guided_err, free_err)
    assert policy.supports_inpainting and not make_policy("ddpm").supports_inpainting
    with pytest.raises(ValueError, match="objective=flow"):
        make_policy("ddpm").predict_chunk(obs, inpaint=(target, weights))


def test_images_of_another_size_are_resized_and_bad_inputs_rejected():
    policy = make_policy()
    big = batch(size=64)
    assert policy.predict_chunk(big).actions.shape == (3, 6, 2)
    bad = batch()
    bad["observation.state"][1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        policy.predict_chunk(bad)
    bright = batch()
    bright["observation.images.wrist"] = bright["observation.images.wrist"] * 255  # pixel values, not [0, 1]
    with pytest.raises(ValueError, match=r"observation.images.wrist must be in \[0, 1\].*divide 0-255"):
        policy.predict_chunk(bright)
    missing = batch()
    del missing["observation.images.wrist"]
    with pytest.raises(ValueError, match="trained with cameras"):
        policy.predict_chunk(missing)
    wrong_actions = batch()
    wrong_actions["action"] = torch.zeros(3, 5, 2)
    with pytest.raises(ValueError, match=r"\(B, 6, 2\)"):
        policy(wrong_actions, copies=2)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="objective"):
        make_policy("score")
    with pytest.raises(ValueError, match="divisible by policy.heads"):
        DiffusionVLAPolicy(DiffusionVLAConfig(state_dim=3, action_dim=2, cameras=["front"], dim=32, heads=3))
    with pytest.raises(ValueError, match="multiple of patch_size"):
        DiffusionVLAPolicy(DiffusionVLAConfig(state_dim=3, action_dim=2, cameras=["front"], image_size=60))


def test_word_tokenizer_pads_and_maps_unknown_words():
    tok = WordTokenizer(word_vocabulary(INSTRUCTIONS), max_tokens=4)
    ids, mask = tok(["Pick up the RED cube", "fly away"], "cpu")
    vocab = word_vocabulary(INSTRUCTIONS)
    assert ids[0].tolist() == [vocab.index(w) for w in ["pick", "up", "the", "red"]]  # cut at 4 tokens
    assert ids[1].tolist() == [1, 1, 0, 0] and mask[1].tolist() == [1, 1, 0, 0]  # unknown words, then padding


def test_frozen_towers_get_no_gradient_but_their_projections_do():
    policy = randomize(make_policy(freeze_towers=True)).train()
    loss = policy(batch(), torch.Generator().manual_seed(0), copies=2)
    loss.backward()
    towers = list(policy.encoder.vision.parameters()) + list(policy.encoder.text.parameters())
    assert all(p.grad is None and not p.requires_grad for p in towers)
    assert policy.encoder.vision_proj.weight.grad.abs().sum() > 0
    assert policy.encoder.text_proj.weight.grad.abs().sum() > 0


def save_tiny_siglip(directory):
    """A SigLIP checkpoint as `transformers` writes one (config, safetensors, fast tokenizer), tiny and random."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, SiglipConfig, SiglipModel

    torch.manual_seed(3)
    words = ["<pad>", "<unk>", *word_vocabulary(INSTRUCTIONS)[2:]]
    config = SiglipConfig(
        text_config={"vocab_size": len(words), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 8, "pad_token_id": 0},
        vision_config={"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 48, "patch_size": 16},
    )  # fmt: skip
    SiglipModel(config).save_pretrained(directory)
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", unk_token="<unk>").save_pretrained(
        directory
    )
    return words


def test_a_pretrained_encoder_folder_missing_a_part_is_refused_in_one_line_naming_it(tmp_path):
    """Each broken copy of a good SigLIP folder (no weights, no tokenizer, another model, no folder) is refused
    before any loading, with one line naming what is missing; the good folder builds a policy."""
    import shutil

    from transformers import CLIPConfig, CLIPModel

    good = tmp_path / "siglip"
    save_tiny_siglip(good)

    def broken(name, drop):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        for file in drop:
            (folder / file).unlink()
        return folder

    clip = tmp_path / "clip"
    CLIPModel(CLIPConfig(text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                      "num_attention_heads": 2},
                         vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                        "num_attention_heads": 2, "image_size": 32, "patch_size": 16})).save_pretrained(clip)  # fmt: skip
    cases = {
        broken("no_weights", ["model.safetensors"]): "has no weights: none of model.safetensors",
        broken("no_tokenizer", ["tokenizer.json"]): "has no tokenizer",
        clip: "holds a 'clip' model, not SigLIP",
        tmp_path / "absent": "is not a directory",
    }
    for folder, message in cases.items():
        with pytest.raises(ValueError, match=message) as refused:
            make_policy(pretrained_encoder=str(folder), max_text_tokens=8)
        assert "\n" not in str(refused.value) and str(folder) in str(refused.value)
    assert make_policy(pretrained_encoder=str(good), max_text_tokens=8).encoder.image_size == 48


def test_pretrained_encoder_loads_weights_sizes_and_tokenizer_from_a_local_directory(tmp_path):
    from transformers import SiglipModel

    words = save_tiny_siglip(tmp_path / "siglip")
    policy = make_policy(pretrained_encoder=str(tmp_path / "siglip"), max_text_tokens=8)
    reference = SiglipModel.from_pretrained(tmp_path / "siglip")
    encoder = policy.encoder
    # The towers carry the saved weights and sizes, not the config's vision_width/image_size.
    assert torch.equal(encoder.vision.vision_model.embeddings.patch_embedding.weight,
                       reference.vision_model.embeddings.patch_embedding.weight)  # fmt: skip
    assert torch.equal(encoder.text.text_model.embeddings.token_embedding.weight,
                       reference.text_model.embeddings.token_embedding.weight)  # fmt: skip
    assert encoder.image_size == 48 and encoder.vision.config.hidden_size == 48
    # Instructions go through the saved tokenizer, padded to max_text_tokens.
    ids, attention = encoder.tokenize(["pick up the red cube"], "cpu")
    assert ids[0, :5].tolist() == [words.index(w) for w in ["pick", "up", "the", "red", "cube"]]
    assert ids.shape == (1, 8) and attention[0].tolist() == [1] * 5 + [0] * 3
    # The 32 px camera images are resized to the tower's 48 px; sampling gives a finite chunk.
    obs = batch()
    with torch.no_grad():
        chunk = policy.predict_chunk(obs)
    assert chunk.actions.shape == (3, 6, 2) and torch.isfinite(chunk.actions).all()
    loss = policy.train()(obs, torch.Generator().manual_seed(0), copies=2)
    assert torch.isfinite(loss)
    # A checkpoint round trip rebuilds the towers from the directory and restores the trained weights.
    from vla_rl.checkpoint import load_policy, save_checkpoint

    policy.eval()
    with torch.no_grad():
        encoder.vision_proj.weight.add_(0.1)  # stands for training: differs from a fresh build
        torch.manual_seed(1)
        before = policy.predict_chunk(obs).actions
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, policy, {})
    # Moved to another machine: the directory the towers came from is not there; the checkpoint's own
    # encoder/ (the towers' configs and the tokenizer) rebuilds them.
    shutil.rmtree(tmp_path / "siglip")
    restored, _ = load_policy(checkpoint)
    with torch.no_grad():
        torch.manual_seed(1)
        after = restored.predict_chunk(obs).actions
    assert torch.allclose(before, after, atol=1e-6)
    assert restored.encoder.tokenize(["pick up the red cube"], "cpu")[0].tolist() == ids.tolist()


def test_a_policy_on_random_towers_saves_no_encoder_folder(tmp_path):
    from vla_rl.checkpoint import save_checkpoint

    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, make_policy(), {})
    assert not (checkpoint / "pretrained_model" / "encoder").exists()
