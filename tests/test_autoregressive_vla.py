"""The autoregressive VLA (`policies/autoregressive_vla`): its action tokenizer fitted by `vla-rl train` and
saved in the checkpoint, teacher-forced training, constrained KV-cached decoding, training-time RTC as
committed-action tokens, its RL actor (token sequences) through GRPO, a local PaliGemma backbone with its
processor, and the bad input it refuses."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from policies import AutoregressiveVLAConfig, PreTrainedPolicy
from policies.denoising_chain import ExplorationNoise
from policies.token_actor import TokenDecision
from policies.token_decoding import decode
from vla_core.data import ChunkedDemos, open_dataset
from vla_core.runtime import DelayConfig
from vla_rl.train import DatasetConfig, TrainConfig, train

sys.path.insert(0, str(Path(__file__).parent))


def _train(dataset_root, out, steps=30, **policy):
    cfg = TrainConfig(
        dataset=DatasetConfig(root=str(dataset_root)), output_dir=str(out), steps=steps, batch_size=8, save_every=steps,
        log_every=10, log_with="none", num_threads=2, warmup_steps=2, policy=AutoregressiveVLAConfig(**policy),
    )  # fmt: skip
    return train(cfg)


@pytest.fixture(scope="module")
def ar_checkpoint(tiny_dataset, tmp_path_factory):
    """An autoregressive_vla (FAST tokens) trained for a few steps on the tiny lift dataset: plumbing, not skill."""
    out = tmp_path_factory.mktemp("ar") / "run"
    summary = _train(tiny_dataset[0], out)
    return Path(summary["checkpoint"]), tiny_dataset[0]


@pytest.fixture(scope="module")
def ar_rtc_checkpoint(tiny_dataset, tmp_path_factory):
    """An autoregressive_vla trained with delays up to 3 (training-time RTC), a few steps."""
    cfg = TrainConfig(
        dataset=DatasetConfig(root=str(tiny_dataset[0])), output_dir=str(tmp_path_factory.mktemp("ar_rtc") / "run"),
        steps=10, batch_size=8, save_every=10, log_every=10, log_with="none", num_threads=2, warmup_steps=2,
        policy=AutoregressiveVLAConfig(), delay=DelayConfig(kind="uniform", low=0, high=3),
    )  # fmt: skip
    return Path(train(cfg)["checkpoint"])


def _demos(root):
    return ChunkedDemos(open_dataset(str(root), None), None)


def _batch(root, frames=(0, 9, 18, 27)):
    return _demos(root).batch(torch.tensor(frames), 16)


def test_train_fits_the_tokenizer_on_the_dataset_and_the_checkpoint_reloads_the_same_policy(ar_checkpoint):
    """The saved tokenizer encodes the dataset's chunks as a tokenizer fitted here on the same chunks does (it
    was fitted on them, not on something else), the budget covers the longest of them, and the reloaded
    policy decodes the same tokens and has the same loss as before saving."""
    from policies.action_tokenizers import fit_action_tokenizer

    directory, root = ar_checkpoint
    model_dir = directory / "pretrained_model"
    assert {"action_tokenizer.json", "action_tokenizer_bpe.json"} <= {p.name for p in model_dir.iterdir()}
    summary = json.loads((directory.parent.parent / "train_summary.json").read_text())
    assert summary["action_values_tokenized"] == 30 * 8 * 16 * 4  # steps x batch x horizon x action dims
    assert 0 < summary["action_values_clipped"] < 0.05 * summary["action_values_tokenized"]  # 1st-99th percentile
    policy = PreTrainedPolicy.from_pretrained(model_dir)
    chunks = _demos(root).action_chunks(16).double().numpy()
    mine = fit_action_tokenizer("fast", chunks, vocab_size=256, scale=10.0)
    theirs = policy.action_tokenizer.encode(chunks).tokens
    assert theirs == mine.encode(chunks).tokens
    longest = max(len(t) for t in theirs)
    assert longest <= policy.config.max_action_tokens == min(16 * 4, int(np.ceil(longest * 1.25)))
    batch = _batch(root)
    first = policy.predict_chunk(batch).actions
    again = PreTrainedPolicy.from_pretrained(model_dir)
    assert torch.equal(again.predict_chunk(batch).actions, first)
    with torch.no_grad():
        assert again(batch).item() == policy(batch).item()


def test_the_decoder_writes_only_action_tokens_and_the_cache_changes_no_token(ar_checkpoint):
    """Sampled at temperature 2 from a barely trained model (so every token is likely somewhere), every
    token is an action token or the end token, every chunk is finite and of the chunk's shape, and greedy
    decoding with and without the key-value cache writes the same tokens (the prompt has padding in its
    middle: short instructions and no committed rows)."""
    directory, root = ar_checkpoint
    policy = PreTrainedPolicy.from_pretrained(directory / "pretrained_model")
    batch = _batch(root)
    space = policy.token_space
    chunk, decoded = policy.sample_tokens(batch, None, 2.0, generator=torch.Generator().manual_seed(0))
    written = decoded.ids[decoded.mask]
    action = (written >= space.first_id) & (written < space.first_id + space.size)
    assert (action | (written == space.eos_id)).all()
    assert chunk.actions.shape == (4, 16, 4) and torch.isfinite(chunk.actions).all()
    prefix, mask = policy.prefix(batch)
    assert (mask == 0).any()  # the padding the cached positions must skip
    cached = decode(policy.backbone.lm, prefix, mask, space, policy.token_budget)
    uncached = decode(policy.backbone.lm, prefix, mask, space, policy.token_budget, use_cache=False)
    assert torch.equal(cached.ids, uncached.ids) and torch.equal(cached.mask, uncached.mask)


def test_training_makes_greedy_decoding_write_the_demonstrated_tokens(tiny_dataset):
    """Teacher-forced training on four frames until the loss is small: greedy decoding then writes each
    frame's own demonstrated token sequence (end token included), and the chunk is the demonstration
    within the tokenizer's round-trip bound."""
    root = tiny_dataset[0]
    demos = _demos(root)
    dataset = open_dataset(str(root), None)
    torch.manual_seed(0)
    from policies.autoregressive_vla.modeling_autoregressive_vla import AutoregressiveVLAPolicy

    policy = AutoregressiveVLAPolicy.from_dataset(
        AutoregressiveVLAConfig(), dataset.meta.features, dataset.meta.stats, demos.tasks
    )
    policy.fit_to_demonstrations(demos)
    batch = demos.batch(torch.tensor([0, 30, 60, 90]), 16)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for _ in range(150):  # about 40 steps; stopping there also avoids the slow denormal floats of a vanishing loss
        loss = policy(batch)
        if loss.item() < 0.02:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.02
    policy.eval()
    chunk, decoded = policy.sample_tokens(batch, None, 0.0)
    tokens = policy.action_tokenizer.encode(batch["action"].double().numpy()).tokens
    assert decoded.action_tokens(policy.token_space) == tokens
    _ids, mask = policy.token_ids(tokens)
    assert torch.equal(decoded.mask.sum(1), mask.sum(1))  # the end token is written where the sequence ends
    bound = torch.as_tensor(policy.action_tokenizer.max_error(), dtype=torch.float32)
    inside = (batch["action"] >= torch.as_tensor(policy.action_tokenizer.low)) & (
        batch["action"] <= torch.as_tensor(policy.action_tokenizer.high))  # fmt: skip
    error = (chunk.actions - batch["action"]).abs()
    assert (error[inside] <= bound.expand_as(error)[inside] + 1e-5).all()


def test_the_rl_actor_scores_what_it_sampled_and_its_factors_are_the_tokens(ar_checkpoint):
    """act's per-token log-probabilities (the sampling distribution at the temperature) equal score's
    teacher-forced ones; one factor per token, padded to the budget with the padding masked; the entropy
    of a token's distribution is at most log(number of allowed tokens)."""
    directory, root = ar_checkpoint
    policy = PreTrainedPolicy.from_pretrained(directory / "pretrained_model")
    actor = policy.rl_actor(ExplorationNoise(eta=0.0, min_std=0.1, temperature=1.0))
    batch = _batch(root)
    torch.manual_seed(1)
    _chunk, decision = actor.act(batch, torch.zeros(4, dtype=torch.long))
    assert decision.ids.shape == (4, policy.token_budget) == (4, actor.num_factors)
    torch.manual_seed(1)
    _, decoded = policy.sample_tokens(batch, None, 1.0)
    scored = actor.score(batch, decision)
    assert torch.equal(scored.mask, decision.mask)
    t = decoded.ids.shape[1]
    assert torch.allclose(scored.values[:, :t], decoded.log_probs, atol=1e-5)
    assert (scored.values[~scored.mask] == 0).all()
    entropy = actor.entropy(batch, decision)
    assert (entropy[decision.mask] <= np.log(policy.token_space.size + 1) + 1e-4).all() and (entropy >= -1e-6).all()
    both = TokenDecision.cat([decision, decision.select(torch.tensor([2, 0]))])
    assert torch.equal(both.ids[4], decision.ids[2]) and len(both) == 6
    assert actor.value_features(batch).shape == (4, actor.value_dim)
    with pytest.raises(ValueError, match="--noise.temperature"):
        policy.rl_actor(ExplorationNoise(eta=0.0, min_std=0.1, temperature=0.0))
    with pytest.raises(ValueError, match="explores by --noise.temperature"):
        policy.rl_actor(ExplorationNoise(eta=1.0, min_std=0.1))
    from vla_rl.finetune import trained_factors

    assert trained_factors(0, actor) == slice(None)
    with pytest.raises(ValueError, match="factors are the tokens of a sequence: drop --train_last_steps"):
        trained_factors(2, actor)


def test_a_grpo_step_raises_the_log_prob_of_rewarded_sequences_and_lowers_penalized_ones(ar_checkpoint):
    """Real rollouts of the policy, groups of two worlds from one initial state, success marked by hand (one
    per group). One plain SGD step of GRPO's update (one minibatch: the ratio is 1, nothing is clipped)
    follows the gradient of mean A_i r_it over the tokens, so the rewarded sequences' log-probabilities rise
    and the penalized ones' fall."""
    from sim.config import EnvConfig
    from sim.factory import make_env
    from vla_core.runtime import ChunkingConfig, DelayModel, LatencySpec
    from vla_core.runtime.delayed_env import DelayedChunkEnv
    from vla_rl.rl import grpo
    from vla_rl.rl.grpo import GRPOConfig
    from vla_rl.rl.rollout import collect
    from vla_rl.rl.update import Anchors, GradientStep, UpdateSettings, batched_score

    directory, _ = ar_checkpoint
    policy = PreTrainedPolicy.from_pretrained(directory / "pretrained_model")
    actor = policy.rl_actor(ExplorationNoise(eta=0.0, min_std=0.1))
    torch.manual_seed(0)
    with make_env(EnvConfig(num_envs=4, max_episode_steps=8)) as env:
        denv = DelayedChunkEnv(env, LatencySpec.of(policy), ChunkingConfig(execute_steps=4), DelayModel(DelayConfig()))
        rollout, _ = collect(actor, denv, episodes_per_world=1, seed=grpo.group_seeds(4, 2, 0))
    rollout.success = rollout.world % 2 == 0
    before = batched_score(actor, rollout, 64)
    step = GradientStep(torch.optim.SGD(policy.parameters(), lr=1e-3), max_grad_norm=0)
    settings = UpdateSettings(
        epochs=1, minibatch_size=len(rollout), clip_low=0.2, clip_high=0.28, factors=slice(None), pcgrad=False,
        max_grad_norm=0.0, lr=1e-3, head_lr=1e-3, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    stats = grpo.update(actor, rollout, Anchors(before), cfg=GRPOConfig(group_size=2), actor_step=step,
                        settings=settings)  # fmt: skip
    assert stats["groups_dropped"] == 0
    change = (batched_score(actor, rollout, 64).values - before.values).sum(1)  # (M,)
    assert change[rollout.success].mean() > 0 > change[~rollout.success].mean()


def test_training_time_rtc_reads_the_committed_actions_as_prompt_tokens_and_keeps_them(ar_rtc_checkpoint, tiny_dataset):
    """Trained with delays up to 3, the policy's prompt has one token per committed row: other committed
    actions change the prompt after them, and the chunk starts with the committed actions exactly."""
    from vla_core.runtime.delay import augmentation

    policy = PreTrainedPolicy.from_pretrained(ar_rtc_checkpoint / "pretrained_model")
    assert policy.config.max_delay_steps == 3
    batch = _batch(tiny_dataset[0])
    committed = torch.full((4, 16, 4), 0.3)
    committed[:, :, 3] = -0.2
    batch.update(augmentation(committed, torch.ones(4, 16, dtype=torch.bool), torch.tensor([0, 1, 2, 3]), 3))
    prefix, mask = policy.prefix(batch)
    assert mask[:, -4:-1].tolist() == [[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    actions = policy.predict_chunk(batch).actions
    for row, d in enumerate([0, 1, 2, 3]):
        assert torch.equal(actions[row, :d], committed[row, :d])
    other = dict(batch, **augmentation(-committed, torch.ones(4, 16, dtype=torch.bool), torch.tensor([0, 1, 2, 3]), 3))
    changed = policy.prefix(other)[0]
    assert torch.equal(changed[0], prefix[0]) and not torch.equal(changed[3], prefix[3])


def _save_tiny_paligemma(directory: Path, words: list[str]) -> int:
    """A random tiny PaliGemma with its processor (a word-level tokenizer, SigLIP's image processor at 32 px),
    saved as `save_pretrained` writes them; returns the tokenizer's size."""
    from tiny_lerobot_vla import word_tokenizer
    from transformers import (
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessor,
    )

    processor = PaliGemmaProcessor(image_processor=SiglipImageProcessor(size={"height": 32, "width": 32}),
                                   tokenizer=word_tokenizer(directory, words))  # fmt: skip
    vocab = len(processor.tokenizer)
    config = PaliGemmaConfig(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                       "projection_dim": 64},
        text_config={"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": vocab},
        projection_dim=64, vocab_size=vocab, image_token_index=vocab - 1,
    )  # fmt: skip
    PaliGemmaForConditionalGeneration(config).save_pretrained(directory)
    processor.save_pretrained(directory)
    return vocab


def test_a_local_paligemma_backbone_reads_the_instruction_with_its_own_tokenizer(tiny_dataset, tmp_path):
    """Loaded from a local directory: its weights (the vision tower's), its tokenizer's ids for the instruction,
    its image size, and the vocabulary extended by the action tokens and the end token after its own. The
    checkpoint carries the backbone's config and processor: moved elsewhere, with the directory it was trained
    from gone, it loads and decodes the same chunk."""
    from safetensors.torch import load_file

    directory = tmp_path / "paligemma"
    directory.mkdir()
    vocab = _save_tiny_paligemma(directory, ["lift", "the", "cube", "pick", "up"])
    summary = _train(tiny_dataset[0], tmp_path / "run", steps=4, pretrained_backbone=str(directory))
    policy = PreTrainedPolicy.from_pretrained(Path(summary["checkpoint"]) / "pretrained_model")
    assert policy.token_space.first_id == vocab and policy.token_space.eos_id == vocab + 256
    assert policy.backbone.lm.get_input_embeddings().num_embeddings == vocab + 257
    assert policy.backbone.image_size == 32
    ids, mask = policy.backbone.tokenize(["lift the cube"], "cpu")
    from transformers import AutoTokenizer

    assert ids[0, : int(mask.sum())].tolist() == AutoTokenizer.from_pretrained(directory)("lift the cube")["input_ids"]
    fresh = AutoregressiveVLAConfig(pretrained_backbone=str(directory), state_dim=11, action_dim=4, cameras=["front"])
    from policies.autoregressive_vla.modeling_autoregressive_vla import AutoregressiveVLAPolicy

    saved = load_file(str(directory / "model.safetensors"))
    name = next(k for k in saved if "vision_tower" in k and k.endswith("weight"))
    loaded = dict(AutoregressiveVLAPolicy(fresh).backbone.vlm.named_parameters())
    assert torch.equal(loaded[name.replace("model.", "model.", 1)], saved[name])
    batch = _batch(tiny_dataset[0])
    expected = policy.predict_chunk(batch).actions
    moved = tmp_path / "moved"  # the checkpoint elsewhere, the backbone directory it was trained from gone
    shutil.copytree(Path(summary["checkpoint"]) / "pretrained_model", moved)
    shutil.move(directory, tmp_path / "gone")
    again = PreTrainedPolicy.from_pretrained(moved)
    assert torch.equal(again.predict_chunk(batch).actions, expected)
    shutil.move(tmp_path / "gone", directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no processor.*save the model's processor"):
        AutoregressiveVLAPolicy(fresh)


def test_lerobot_loads_it_with_its_tokenizer_and_what_lerobot_saves_vla_rl_reloads(ar_checkpoint, tmp_path):
    """Through the plugin, LeRobot's loader reads the weights (tied embeddings written once) and the action
    tokenizer, and decodes the same chunk; LeRobot's save writes both again, and vla-rl reloads that."""
    from test_lerobot_interop import _lerobot_with_plugins

    PreTrainedConfig, get_policy_class = _lerobot_with_plugins()
    directory, root = ar_checkpoint
    model_dir = directory / "pretrained_model"
    ours = PreTrainedPolicy.from_pretrained(model_dir)
    config = PreTrainedConfig.from_pretrained(model_dir)
    assert config.type == "vla_rl_autoregressive_vla"
    theirs = get_policy_class(config.type).from_pretrained(model_dir)
    batch = _batch(root)
    expected = ours.predict_chunk(batch).actions
    assert torch.equal(theirs.predict_action_chunk(batch), expected)
    theirs.save_pretrained(tmp_path / "saved_by_lerobot")
    again = PreTrainedPolicy.from_pretrained(tmp_path / "saved_by_lerobot")
    assert torch.equal(again.predict_chunk(batch).actions, expected)


def test_every_trainable_weight_gets_a_gradient_from_the_loss(ar_checkpoint):
    """No weight sits outside the loss (data-parallel training would stop on one: DDP without unused parameters)."""
    directory, root = ar_checkpoint
    policy = PreTrainedPolicy.from_pretrained(directory / "pretrained_model").train()
    policy(_batch(root)).backward()
    missing = [name for name, p in policy.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing


def test_a_resumed_run_keeps_the_tokenizer_it_saved(tiny_dataset, tmp_path):
    """`--resume=true` reads the action tokenizer from the checkpoint it resumes, not a new fit: a tokenizer
    planted in that checkpoint (uniform bins over a range 1.5 times as wide) is the one the run goes on with
    and saves again."""
    from policies.action_tokenizers import fit_action_tokenizer, load_action_tokenizer

    def run(steps, resume):
        return train(TrainConfig(
            dataset=DatasetConfig(root=str(tiny_dataset[0])), output_dir=str(tmp_path / "run"), steps=steps,
            batch_size=4, save_every=2, log_every=2, log_with="none", num_threads=2, warmup_steps=1, resume=resume,
            policy=AutoregressiveVLAConfig(action_tokenizer="uniform_bins"),
        ))  # fmt: skip

    first = Path(run(2, False)["checkpoint"]) / "pretrained_model"
    chunks = _demos(tiny_dataset[0]).action_chunks(16).double().numpy()
    planted = fit_action_tokenizer("uniform_bins", chunks * 1.5, num_bins=256)
    planted.save(first)
    final = Path(run(4, True)["checkpoint"]) / "pretrained_model"
    saved = load_action_tokenizer(final)
    assert np.array_equal(saved.low, planted.low) and np.array_equal(saved.high, planted.high)
    assert not np.array_equal(saved.low, fit_action_tokenizer("uniform_bins", chunks, num_bins=256).low)


def test_in_the_delta_frame_the_tokens_are_the_steps_and_decoding_them_returns_the_demonstration(tiny_dataset):
    """``action_frame=delta``: the indices come from the dataset's names (the arm's ee_x/y/z; the grip absolute),
    the bins are fitted on the steps (a far narrower range than the absolute targets'), a batch is tokenized as
    its steps, and decoding a demonstration's own tokens gives it back within the accumulated rounding: each
    row's error at most the sum of the half bins of the rows up to it. The checkpoint keeps the indices."""
    from policies.action_tokenizers.relative import to_delta
    from policies.autoregressive_vla.modeling_autoregressive_vla import AutoregressiveVLAPolicy
    from policies.token_decoding import Decoded, score_tokens

    root = tiny_dataset[0]
    demos, dataset = _demos(root), open_dataset(str(root), None)
    names = demos.state_names
    config = AutoregressiveVLAConfig(action_tokenizer="uniform_bins", action_frame="delta")
    policy = AutoregressiveVLAPolicy.from_dataset(config, dataset.meta.features, dataset.meta.stats, demos.tasks)
    policy.fit_to_demonstrations(demos)
    assert policy.config.delta_state_indices == [names.index("ee_x"), names.index("ee_y"), names.index("ee_z"), -1]
    with pytest.raises(ValueError, match="is set from the dataset's names"):  # by hand, another pairing: refused
        AutoregressiveVLAPolicy.from_dataset(AutoregressiveVLAConfig(action_tokenizer="uniform_bins", action_frame="delta",
                                                                     delta_state_indices=[0, 1, 2, -1]),
                                             dataset.meta.features, dataset.meta.stats, demos.tasks).fit_to_demonstrations(demos)  # fmt: skip
    tokenizer = policy.action_tokenizer
    absolute = _demos(root).action_chunks(16).double()
    assert (
        (tokenizer.high - tokenizer.low)[:3] < 0.5 * (absolute.amax((0, 1)) - absolute.amin((0, 1))).numpy()[:3]
    ).all()
    batch = _batch(root)
    steps = to_delta(batch["action"].double(), batch["observation.state"].double(), policy.config.delta_state_indices)
    tokens = tokenizer.encode(steps.numpy()).tokens
    ids, mask = policy.token_ids(tokens)
    decoded = Decoded(ids=ids, mask=mask, log_probs=torch.zeros(ids.shape))
    actions = policy.detokenize(decoded, batch)
    half_bin = torch.as_tensor(tokenizer.bin_width / 2, dtype=torch.float32)
    rows = torch.arange(1, 17, dtype=torch.float32)[:, None]
    bound = torch.cat([rows * half_bin[:3], half_bin[3:].expand(16, 1)], dim=1)  # the grip's error is its own row's
    inside = torch.as_tensor(tokenizer.encode(steps.numpy()).clipped == 0)
    assert inside.any()
    assert ((actions - batch["action"]).abs()[inside] <= bound + 1e-5).all()
    with torch.no_grad():  # the training loss is the negative log-likelihood of the steps' tokens
        prefix, prefix_mask = policy.prefix(batch)
        log_probs = score_tokens(policy.backbone.lm, prefix, prefix_mask, ids, mask, policy.token_space,
                                 max_tokens=policy.token_budget)  # fmt: skip
        assert torch.isclose(policy(batch), -log_probs.sum() / mask.sum())


def test_a_delta_frame_checkpoint_reloads_its_indices_and_decodes_from_the_observed_state(tiny_dataset, tmp_path):
    """Trained two steps and reloaded: the indices travel in config.json, and the same tokens give chunks that
    move with the observed state (the arm 1 cm further along x: every row's x 1 cm further; the grip unmoved)."""

    out = Path(_train(tiny_dataset[0], tmp_path / "run", steps=2, action_tokenizer="uniform_bins",
                      action_frame="delta")["checkpoint"]) / "pretrained_model"  # fmt: skip
    policy = PreTrainedPolicy.from_pretrained(out)
    names = _demos(tiny_dataset[0]).state_names
    assert policy.config.delta_state_indices == [names.index("ee_x"), names.index("ee_y"), names.index("ee_z"), -1]
    batch = _batch(tiny_dataset[0])
    _chunk, decoded = policy.sample_tokens(batch, None, 1.0, generator=torch.Generator().manual_seed(0))
    moved = {**batch, "observation.state": batch["observation.state"].clone()}
    moved["observation.state"][:, names.index("ee_x")] += 0.01
    shift = policy.detokenize(decoded, moved) - policy.detokenize(decoded, batch)
    assert torch.allclose(shift[..., 0], torch.full_like(shift[..., 0], 0.01), atol=1e-6)
    assert torch.equal(shift[..., 1:], torch.zeros_like(shift[..., 1:]))


def test_bad_input_gets_one_line_naming_the_fix(ar_checkpoint, tmp_path):
    """A checkpoint without its tokenizer, a tokenizer fitted on other action dimensions, a token budget shorter
    than the data's chunks, and clipping of out-of-range training actions, which is counted."""
    from policies.action_tokenizers import fit_action_tokenizer

    directory, root = ar_checkpoint
    copy = tmp_path / "model"
    shutil.copytree(directory / "pretrained_model", copy)
    (copy / "action_tokenizer.json").unlink()
    with pytest.raises(ValueError, match="lacks its action tokenizer"):
        PreTrainedPolicy.from_pretrained(copy)
    policy = PreTrainedPolicy.from_pretrained(directory / "pretrained_model")
    other = fit_action_tokenizer("fast", np.random.default_rng(0).normal(size=(64, 16, 3)), vocab_size=256)
    with pytest.raises(ValueError, match="16 steps x 3 action dimensions.*fit it on the dataset"):
        policy.set_action_tokenizer(other)
    saved = json.loads((directory / "pretrained_model" / "config.json").read_text())
    assert saved["max_action_tokens"] == policy.config.max_action_tokens > 2
    policy.config.max_action_tokens = 2
    with pytest.raises(ValueError, match="max_action_tokens=2 is shorter than the dataset's longest chunk"):
        policy.fit_to_demonstrations(_demos(root))
    policy.config.max_action_tokens = saved["max_action_tokens"]
    batch = _batch(root)
    batch["action"] = batch["action"].clone()
    batch["action"][0, 0, 0] = 1e3  # far outside the fitted range
    tokenizer = policy.action_tokenizer
    outside = int(
        ((batch["action"].double().numpy() < tokenizer.low) | (batch["action"].double().numpy() > tokenizer.high)).sum()
    )
    assert outside >= 1
    before = policy.clipped_values
    with torch.no_grad():
        assert torch.isfinite(policy(batch))
    assert policy.clipped_values - before == outside


def test_eval_runs_it_with_temporal_ensembling_and_the_delay_augmentation(ar_rtc_checkpoint, tmp_path):
    """`vla-rl eval` under a fixed delay of 2 with ACT's temporal ensembling: every request carries the
    augmentation (two committed rows after an episode's first chunk) and every chunk starts with them."""
    from sim.config import EnvConfig
    from vla_core.runtime import ChunkingConfig
    from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK
    from vla_rl.eval import EvalConfig, evaluate

    policy = PreTrainedPolicy.from_pretrained(ar_rtc_checkpoint / "pretrained_model")
    seen = []
    predict = policy.predict_chunk

    def recording(obs, obs_step=None, **kwargs):
        chunk = predict(obs, obs_step, **kwargs)
        mask = obs[OBS_COMMITTED_MASK][:, :3]
        kept = torch.where(mask[..., None], chunk.actions[:, :3] == obs[OBS_COMMITTED_ACTIONS][:, :3], True).all()
        seen.append((mask.sum(1).tolist(), bool(kept)))
        return chunk

    policy.predict_chunk = recording
    cfg = EvalConfig(checkpoint=str(ar_rtc_checkpoint), env=EnvConfig(num_envs=2, max_episode_steps=16), num_episodes=2,
                     video_episodes=0, chunking=ChunkingConfig(execute_steps=4, merge="ensemble"),
                     delay=DelayConfig(steps=2), output_dir=str(tmp_path / "eval"))  # fmt: skip
    result = evaluate(cfg, policy=policy.eval())
    assert result["episodes"] == 2 and set(result["delay_histogram"]) == {"2"}
    assert seen[0][0] == [0, 0] and all(counts == [2, 2] for counts, _ in seen[1:]), seen
    assert all(kept for _, kept in seen)


def test_serve_drives_the_sim_robot_with_it(ar_rtc_checkpoint, tmp_path):
    """Two processes over ROS 2: `vla-rl sim-robot` and `vla-rl serve` running the token policy with temporal
    ensembling (its inference worker in its own process); every command it sends is accepted."""
    from extras import require

    require("rclpy", "ros")
    from ros_helpers import STOPPED_BY_SIGINT, RobotClient, last_json, start_command, stop_command
    from std_msgs.msg import String

    domain = 67
    robot = start_command(["sim-robot", "--env.task=lift", "--seed=100"], domain, tmp_path, "robot")
    serve = start_command(["serve", "--config_path=configs/serve.yaml", f"--checkpoint={ar_rtc_checkpoint}",
                           "--chunking.merge=ensemble", "--chunking.execute_steps=4", "--control_rt_priority=0",
                           "--control_lock_memory=false"], domain, tmp_path, "serve")  # fmt: skip
    client = RobotClient(domain)
    chunks = []
    client.node.create_subscription(String, "/vla_rl/chunk", lambda m: chunks.append(json.loads(m.data)), 50)
    try:
        client.wait_for_robot()
        client.spin_until(lambda: len(chunks) >= 6, 180, "six chunks from the served token policy")
    finally:
        client.close()
        serve_code, _, serve_err = stop_command(serve, tmp_path, "serve")
        robot_code, robot_out, robot_err = stop_command(robot, tmp_path, "robot")
    assert serve_code == STOPPED_BY_SIGINT, serve_err
    assert robot_code == STOPPED_BY_SIGINT, robot_err
    assert all(c["horizon"] == 16 and c["merge"] == "ensemble" for c in chunks), chunks
    summary = last_json(robot_out)
    rejected = summary["commands_rejected"]
    assert set(rejected) <= {"stale"} and rejected.get("stale", 0) <= 1, summary
    assert summary["commands_received"] >= 20, summary


def test_the_decoding_benchmark_times_each_arm_on_the_same_tokens_and_its_figures_are_ratios(ar_checkpoint):
    """`bench ar-decoding`'s arms on one policy: batched or one by one, with or without the cache, greedy
    decoding writes the same tokens for every observation. Its figures from hand-set times: 64 chunks in
    0.5 s batched and cached, 8 s one by one uncached (16x), 2 s batched uncached (4x), 3.2 s one by one
    cached (2.5x; 50 ms a chunk)."""
    from vla_rl.bench_ar_decoding import _time_arm, format_summary, ratios

    directory, root = ar_checkpoint
    policy = PreTrainedPolicy.from_pretrained(directory / "pretrained_model")
    demos = _demos(root)
    observations = [{k: v for k, v in demos.batch(torch.tensor([f]), 16).items() if k != "action"}
                    for f in (0, 40, 80)]  # fmt: skip
    tokens = {}
    for batched in (True, False):
        for cached in (True, False):
            tokens[batched, cached] = _time_arm(policy, observations, batched, cached, repeats=1)[1]
    assert all(t == tokens[False, False] for t in tokens.values())
    _, decoded = policy.sample_tokens(observations[1], None, 0.0)
    assert tokens[True, True][1] == decoded.ids[0][decoded.mask[0]].tolist()
    seconds = {"batched_cached": 0.5, "sequential_uncached": 8.0, "batched_uncached": 2.0, "sequential_cached": 3.2}
    arms = {arm: {"median_seconds": s, "seconds": [s], "chunks_per_s": 64 / s, "same_tokens_as_baseline": 64}
            for arm, s in seconds.items()}  # fmt: skip
    figures = ratios(arms, 64)
    assert figures == {"decode_speedup": 16.0, "batching_speedup": 4.0, "cache_speedup": 2.5, "latency_b1_ms": 50.0}
    report = {"observations": 64, "arms": arms, "config": {"quick": False}, "device": "cpu", "torch_threads": 1,
              "tokens_per_chunk": {"mean": 1, "max": 1, "budget": 1, "valid_sequences": 0}, **figures}  # fmt: skip
    assert format_summary(report).splitlines()[-1] == "decode_speedup=16.00 latency_b1_ms=50.00"


@pytest.mark.slow
def test_an_openpi_libero_evaluation_runs_it(tmp_path):
    """A small autoregressive VLA shaped for LIBERO (its two cameras at 64 pixels, 8 states, 7 actions; FAST
    tokens fitted on random smooth chunks) through `vla-rl eval` on libero_spatial/0 under the openpi
    protocol: the episode ends at openpi's 220 steps unless it succeeds first, recorded per task."""
    import types

    from policies.autoregressive_vla.modeling_autoregressive_vla import AutoregressiveVLAPolicy
    from sim.config import EnvConfig
    from sim.libero_protocol import LIBERO_CAMERAS
    from vla_rl.eval import EvalConfig, evaluate

    torch.manual_seed(0)
    policy = AutoregressiveVLAPolicy(AutoregressiveVLAConfig(
        state_dim=8, action_dim=7, cameras=list(LIBERO_CAMERAS), horizon=10, n_action_steps=5,
        vocabulary=["<pad>", "<unk>", "pick", "up", "the", "black", "bowl"],
    ))  # fmt: skip
    steps = torch.linspace(0, 1, 10)[None, :, None]
    g = torch.Generator().manual_seed(0)
    chunks = torch.rand(256, 1, 7, generator=g) * (1 - steps) + torch.rand(256, 1, 7, generator=g) * steps
    policy.fit_to_demonstrations(types.SimpleNamespace(action_chunks=lambda horizon, frames=None: chunks))
    policy.save_pretrained(tmp_path / "ar")
    result = evaluate(EvalConfig(
        checkpoint=str(tmp_path / "ar"), output_dir=str(tmp_path / "eval"), episodes_per_task=1, video_episodes=0,
        env=EnvConfig(task="libero_spatial/0", num_envs=1, cameras=list(LIBERO_CAMERAS), image_size=64),
    ))  # fmt: skip
    assert result["protocol"]["name"] == "openpi" and result["protocol"]["max_episode_steps"] == 220
    (episode,) = result["per_episode"]
    assert episode["task"] == "libero_spatial/0" and episode["initial_state"] == 0
    assert episode["success"] or episode["length"] == 220


@pytest.mark.parametrize("vision", ["keypoints", "both"])
def test_keypoint_image_tokens_come_first_per_camera_train_and_reload(tiny_dataset, tmp_path, vision):
    """``vision=keypoints``: each camera's image tokens are its keypoint CNN's K tokens (the coordinates' linear map
    plus each keypoint's embedding); ``both``: those, then the SigLIP patches exactly as the tower gives them. Every
    trainable weight gets a gradient (with ``keypoints`` the tower is frozen, not trainable), and the checkpoint
    reloads the same prompt."""
    from vla_core.types import image_key

    summary = _train(tiny_dataset[0], tmp_path / "run", steps=3, vision=vision, num_keypoints=4, vision_channels=8)
    policy = PreTrainedPolicy.from_pretrained(Path(summary["checkpoint"]) / "pretrained_model")
    backbone, cfg = policy.backbone, policy.config
    batch = _batch(tiny_dataset[0])
    with torch.no_grad():
        prefix, _ = policy.prefix(batch)
        image = torch.nn.functional.interpolate(batch[image_key(cfg.cameras[0])], size=(64, 64), mode="bilinear")
        xy = backbone.keypoints[0].encoder(image).view(len(image), 4, 2)
        expected = backbone.keypoints[0].coordinates(xy) + backbone.keypoints[0].index
        torch.testing.assert_close(prefix[:, :4], expected, rtol=0, atol=1e-5)
        patches = backbone.vlm.model.get_image_features(pixel_values=backbone._pixels(batch[image_key(cfg.cameras[0])]))
        patches = getattr(patches, "pooler_output", patches)
        text = backbone.tokenize(list(batch["task"]), prefix.device)[0].shape[1]
        if vision == "both":
            torch.testing.assert_close(prefix[:, 4 : 4 + patches.shape[1]], patches, rtol=0, atol=1e-5)
        image_tokens = len(cfg.cameras) * (4 + (patches.shape[1] if vision == "both" else 0))
        assert prefix.shape[1] == image_tokens + text + 1  # then the instruction and the state (no committed rows)
    policy.train()
    policy(batch).backward()
    assert not [name for name, p in policy.named_parameters() if p.requires_grad and p.grad is None]
    tower = [p.requires_grad for p in backbone.vlm.model.vision_tower.parameters()]
    assert (not any(tower)) if vision == "keypoints" else all(tower)
    policy.save_pretrained(tmp_path / "saved")
    again = PreTrainedPolicy.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(again.prefix(batch)[0], prefix, rtol=0, atol=0)


def test_the_auxiliary_objective_adds_the_weighted_error_of_the_true_state_read_from_the_prompt(tiny_dataset, tmp_path):
    """``environment_state_weight``: on a dataset recorded with the true state, the loss is the token loss plus the
    weight times the mean squared error of a linear head on the prompt's readout against the true state,
    standardized by the dataset's own mean and std (recomputed here from the frames); a dataset without it, or a
    batch without it, is refused naming the fix; the head travels with the checkpoint."""
    from policies.autoregressive_vla.modeling_autoregressive_vla import AutoregressiveVLAPolicy
    from sim.config import EnvConfig
    from vla_rl.record import RecordConfig, record

    lift = open_dataset(str(tiny_dataset[0]), None)
    with pytest.raises(ValueError, match="record --environment_state=true"):
        AutoregressiveVLAConfig(environment_state_weight=0.5).fit_to_dataset(lift.meta.features, ["x"])
    root = record(RecordConfig(env=EnvConfig(task="track", num_envs=2), num_episodes=2, output_dir=str(tmp_path / "ds"),
                               environment_state=True))["dataset"]  # fmt: skip
    dataset, demos = open_dataset(root, None), _demos(root)
    config = AutoregressiveVLAConfig(action_tokenizer="uniform_bins", environment_state_weight=0.5)
    torch.manual_seed(0)
    policy = AutoregressiveVLAPolicy.from_dataset(config, dataset.meta.features, dataset.meta.stats, demos.tasks)
    policy.fit_to_demonstrations(demos)
    assert policy.config.environment_state_dim == 6
    frames = demos.environment_state.double()
    torch.testing.assert_close(policy.environment_state_mean.double(), frames.mean(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(policy.environment_state_std.double(), frames.std(0, correction=0).clamp_min(1e-6),
                               atol=1e-5, rtol=1e-3)  # fmt: skip
    batch = demos.batch(torch.tensor([0, 5, 10, 15]), 16)
    with torch.no_grad():
        with_aux = policy(batch)
        policy.config.environment_state_weight = 0.0
        tokens_only = policy(batch)
        policy.config.environment_state_weight = 0.5
        target = (batch["observation.environment_state"].double() - frames.mean(0)) / frames.std(
            0, correction=0
        ).clamp_min(1e-6)
        error = (policy.environment_state_head(policy.prefix_features(batch)).double() - target).pow(2).mean()
    torch.testing.assert_close(with_aux.double(), tokens_only.double() + 0.5 * error, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="environment_state=true"):
        policy({k: v for k, v in batch.items() if k != "observation.environment_state"})
    policy.save_pretrained(tmp_path / "saved")
    again = PreTrainedPolicy.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(again(batch), with_aux)
