"""LeRobot's flow VLAs (pi0, pi05) through vla-rl: the RL chain around LeRobot's own Euler steps, RTC
guidance, the tokenizer found offline, LoRA / frozen-backbone fine-tuning, eval and serve.

The policies are LeRobot's own classes, shrunk by the test-only patch of `tiny_lerobot_vla` (real size
does not fit a CPU test); `test_real_size_*` builds the real-size networks on the meta device.
"""

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from extras import require
from safetensors.torch import load_file
from tiny_lerobot_vla import PALIGEMMA_TOKENIZER, save_tiny_vla, tiny_backbones, word_tokenizer

from policies.denoising_chain import DenoisingChain, ExplorationNoise
from policies.lerobot import flow
from policies.lerobot.adaptation import ADAPTER_FILE, AdaptationConfig
from vla_rl.checkpoint import load_policy

require("peft", "vla")  # LoRA adapters

WORDS = ["lift", "the", "cube", "pick", "up", "and", "place", "it", "put", "a", "on"]
B = 3


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    word_tokenizer(directory, WORDS)
    return directory


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def tiny_vla(request, tmp_path_factory, tokenizer_dir):
    """(directory, kind): a random tiny pi0 / pi05 LeRobot checkpoint for the lift env (front camera 64 px,
    11 states, 4 actions, chunks of 8, 3 Euler steps)."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_vla(directory, AutoTokenizer.from_pretrained(str(tokenizer_dir)), kind=request.param)
    return directory, request.param


def _load(directory, tokenizer_dir, **kwargs):
    with tiny_backbones():
        return load_policy(directory, tokenizer_dir=str(tokenizer_dir), **kwargs)[0]


def _obs(b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"observation.images.front": torch.rand(b, 3, 64, 64, generator=g),
            "observation.state": torch.randn(b, 11, generator=g), "task": ["lift the cube"] * b}  # fmt: skip


def test_a_checkpoint_whose_tokenizer_is_not_here_is_refused_naming_the_flag(tiny_vla, tmp_path):
    directory, _ = tiny_vla
    with tiny_backbones(), pytest.raises(ValueError, match=r"google/paligemma-3b-pt-224.*--tokenizer_dir=<dir>"):
        load_policy(directory)
    with pytest.raises(ValueError, match="is not a directory"):
        load_policy(directory, tokenizer_dir=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_policy(directory, tokenizer_dir=str(tmp_path / "empty"))


def test_the_policy_reads_lerobots_config_and_its_zero_noise_chain_is_lerobots_sampler(tiny_vla, tokenizer_dir):
    directory, kind = tiny_vla
    policy = _load(directory, tokenizer_dir)
    cfg = policy.config
    assert (cfg.lerobot_type, cfg.horizon, cfg.num_inference_steps, cfg.cameras) == (kind, 8, 3, ["front"])
    assert policy.is_flow and policy.supports_inpainting
    obs, start = _obs(), torch.randn(B, 8, 32)
    lerobots = policy.predict_chunk(obs, noise=start).actions  # LeRobot's predict_action_chunk, unpatched
    # The same Euler loop run by vla-rl's sampler with no exploration noise: bit for bit LeRobot's.
    sampler = flow.Sampler(torch.zeros(3))
    with flow.integrator(policy.model, sampler) as predict:
        ours = policy._chunk_out(predict(policy._model_batch(obs), noise=start), obs, None).actions
    torch.testing.assert_close(ours, lerobots, rtol=0, atol=0)
    assert sampler.chain.latents.shape == (B, 4, 8, 32)  # K + 1 latents of the padded chunk
    torch.testing.assert_close(sampler.chain.latents[:, 0], start, rtol=0, atol=0)


def test_a_chains_log_prob_is_the_gaussian_density_around_lerobots_euler_steps(tiny_vla, tokenizer_dir):
    directory, _ = tiny_vla
    policy = _load(directory, tokenizer_dir)
    obs, start = _obs(), torch.randn(B, 8, 32)
    deterministic = flow.Sampler(torch.zeros(3))
    with flow.integrator(policy.model, deterministic) as predict:
        predict(policy._model_batch(obs), noise=start)
    path = deterministic.chain.latents  # LeRobot's Euler path (pinned to LeRobot by the test above)
    std = 0.05
    offset = torch.randn(B, 8, 32, generator=torch.Generator().manual_seed(1)) * std
    latents = path.clone()
    latents[:, 3] += offset  # only the last step leaves the deterministic path
    chain = DenoisingChain(latents, torch.full((3,), std), None, None)
    n = 8 * 32
    normal = -math.log(std) - 0.5 * math.log(2 * math.pi)  # log N(0; 0, std^2) per element
    expected = torch.stack(
        [torch.full((B,), n * normal)] * 2 + [n * normal - 0.5 * (offset / std).square().flatten(1).sum(1)], 1
    )
    torch.testing.assert_close(policy.log_prob(obs, chain, per_step=True), expected, rtol=1e-5, atol=1e-3)


def test_acting_and_scoring_agree_and_the_trainable_weights_get_gradients(tiny_vla, tokenizer_dir):
    directory, _ = tiny_vla
    for trainable in ("all", "expert", "lora"):
        policy = _load(directory, tokenizer_dir)
        policy.adapt(AdaptationConfig(trainable=trainable, lora_rank=4 if trainable == "lora" else 16))
        actor = policy.rl_actor(ExplorationNoise(min_std=0.1))
        assert actor.num_factors == 3 and actor.value_dim == 8 * 4 + 11
        assert actor.value_features(_obs()).shape == (B, 8 * 4 + 11)
        chunk, chain, behaviour = policy.sample_with_log_prob(_obs(), noise=ExplorationNoise(min_std=0.1))
        assert chunk.actions.shape == (B, 8, 4) and chain.latents.shape == (B, 4, 8, 32)
        every_dim = policy.log_prob(_obs(), chain, per_step=True)
        torch.testing.assert_close(every_dim.sum(1), behaviour, rtol=1e-6, atol=1e-2)  # sums of ~2000
        # The actor's score leaves out the final step's padded dimensions (4 run of 32): moving them changes
        # the chain's density, not the score.
        scored = actor.score(_obs(), chain)
        torch.testing.assert_close(scored.values[:, :-1], every_dim[:, :-1].detach())
        moved = replace(chain, latents=chain.latents.clone())
        moved.latents[:, -1, :, 4:] += 1.0
        with torch.no_grad():
            torch.testing.assert_close(actor.score(_obs(), moved).values, scored.values.detach())
            assert (policy.log_prob(_obs(), moved, per_step=True)[:, -1] < every_dim[:, -1] - 1).all()
        scored.values.sum().backward()
        grads = {n for n, p in policy.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        backbone = {n for n in grads if ".paligemma." in n}
        expert = {n for n in grads if ".gemma_expert." in n}
        if trainable == "all":
            assert backbone and expert
        elif trainable == "expert":
            assert expert and not backbone
        else:
            assert grads and all("lora_" in n for n in grads)
            assert {p.requires_grad for n, p in policy.named_parameters() if "lora_" not in n} == {False}


def test_rtc_guidance_pulls_the_weighted_steps_to_the_target_and_no_weight_is_lerobots_chunk(tiny_vla, tokenizer_dir):
    directory, _ = tiny_vla
    policy = _load(directory, tokenizer_dir)
    obs, start = _obs(), torch.randn(B, 8, 32)
    free = policy.predict_chunk(obs, noise=start).actions
    target = torch.full((B, 8, 4), 0.3)
    weights = torch.zeros(B, 8)
    unguided = policy.predict_chunk(obs, noise=start, inpaint=(target, weights)).actions
    torch.testing.assert_close(unguided, free, rtol=0, atol=1e-6)
    weights[:, :3] = 1.0
    guided = policy.predict_chunk(obs, noise=start, inpaint=(target, weights)).actions
    before, after = (free[:, :3] - 0.3).abs().mean(), (guided[:, :3] - 0.3).abs().mean()
    assert after < before / 5, (before, after)


def test_a_lora_policy_saves_its_adapters_merged_and_lerobot_loads_the_same_function(tiny_vla, tokenizer_dir, tmp_path):
    from lerobot.policies.factory import get_policy_class

    directory, kind = tiny_vla
    policy = _load(directory, tokenizer_dir)
    policy.adapt(AdaptationConfig(trainable="lora", lora_rank=4))
    with torch.no_grad():  # trained adapters (B starts at zero, which would merge to nothing)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    live = {k: v.clone() for k, v in policy.state_dict().items()}
    obs, start = _obs(), torch.randn(B, 8, 32)
    expected = policy.predict_chunk(obs, noise=start).actions
    policy.save_pretrained(tmp_path / "saved")
    assert all(torch.equal(v, live[k]) for k, v in policy.state_dict().items())  # the live weights untouched
    saved = json.loads((tmp_path / "saved" / "policy_preprocessor.json").read_text())
    assert [
        s["config"].get("tokenizer_name") for s in saved["steps"] if s["registry_name"] == "tokenizer_processor"
    ] == [PALIGEMMA_TOKENIZER]  # named as before, so LeRobot reads the copy as it read the original
    assert (tmp_path / "saved" / ADAPTER_FILE).is_file() and (tmp_path / "saved" / "tokenizer").is_dir()
    weights = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert not any("lora_" in k or "base_layer" in k for k in weights)  # LeRobot's names only
    with tiny_backbones():
        reloaded = load_policy(tmp_path / "saved")[0]  # its own tokenizer/ folder: no --tokenizer_dir
        lerobots = get_policy_class(kind).from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(reloaded.predict_chunk(obs, noise=start).actions, expected, rtol=1e-5, atol=1e-5)
    batch = reloaded._model_batch(obs)
    torch.testing.assert_close(
        reloaded.postprocessor(lerobots.predict_action_chunk(batch, noise=start)), expected, rtol=1e-5, atol=1e-5
    )


def _finetune(directory, tokenizer_dir, out, **overrides):
    from test_rl import small_run

    from vla_rl.finetune import finetune
    from vla_rl.rl.ppo import PPOConfig

    # PPO from its first iteration: advantages against the critic are non-zero even when every episode fails.
    fields = {"tokenizer_dir": str(tokenizer_dir), "iterations": 1, "update_epochs": 1, "minibatch_size": 8,
              "lr": 1e-3, "ppo": PPOConfig(critic_warmup_iterations=0)} | overrides  # fmt: skip
    with tiny_backbones():
        return finetune(small_run(directory, out, **fields))


@pytest.mark.parametrize("trainable", ["expert", "lora"])
def test_finetune_trains_a_lerobot_vla_and_reports_its_peak_memory(tiny_vla, tokenizer_dir, tmp_path, trainable):
    from vla_core.runtime import DelayConfig

    directory, _ = tiny_vla
    # Under a delay of 2 steps: the rollouts carry the delay augmentation, which the value head reads.
    summary = _finetune(directory, tokenizer_dir, tmp_path / "run", vla=AdaptationConfig(trainable=trainable),
                        delay=DelayConfig(steps=2))  # fmt: skip
    assert summary["iterations"] == 1 and summary["peak_memory"]["gib"] > 0.1
    assert summary["history"][0]["executed_env_steps"] > 0
    before = load_file(str(Path(directory) / "model.safetensors"))
    after = load_file(
        str(tmp_path / "run" / "checkpoints" / "step-00000001" / "pretrained_model" / "model.safetensors")
    )
    assert set(before) == set(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the update changed nothing"
    if trainable == "expert":
        assert not any(".paligemma." in k for k in changed)
    else:  # only LoRA's targets, LeRobot's defaults for the type (the expert's q/v and the action projections)
        with tiny_backbones():
            targets = _load(directory, tokenizer_dir).model._get_default_peft_targets()["target_modules"]
        assert changed and all(re.fullmatch(targets, k.removesuffix(".weight")) for k in changed), changed


def test_a_killed_lora_run_resumes_to_the_weights_of_an_unstopped_one(tiny_vla, tokenizer_dir, tmp_path):
    directory, _ = tiny_vla
    lora = AdaptationConfig(trainable="lora", lora_rank=4)
    _finetune(directory, tokenizer_dir, tmp_path / "straight", vla=lora, iterations=2)
    _finetune(directory, tokenizer_dir, tmp_path / "stopped", vla=lora, iterations=1)
    _finetune(directory, tokenizer_dir, tmp_path / "stopped", vla=lora, iterations=2, resume=True)
    last = Path("checkpoints") / "step-00000002" / "pretrained_model"
    for name in ("model.safetensors", ADAPTER_FILE):
        straight, resumed = (load_file(str(tmp_path / run / last / name)) for run in ("straight", "stopped"))
        assert set(straight) == set(resumed)
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), name


def test_lora_adapters_of_a_bf16_model_train_in_float32(tiny_vla, tokenizer_dir):
    directory, _ = tiny_vla
    policy = _load(directory, tokenizer_dir)
    policy.adapt(AdaptationConfig(trainable="lora", lora_rank=4, dtype="bfloat16"))
    adapters = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    assert adapters and {p.dtype for p in adapters.values()} == {torch.float32}
    assert {p.dtype for n, p in policy.named_parameters() if "gemma_expert.model.layers.0.mlp" in n} == {torch.bfloat16}
    _, chain, _ = policy.sample_with_log_prob(_obs(), noise=ExplorationNoise(min_std=0.1))
    policy.log_prob(_obs(), chain).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters.values())


def test_bf16_and_gradient_checkpointing_recompute_the_expert_in_the_backward_pass(tiny_vla, tokenizer_dir):
    directory, _ = tiny_vla
    policy = _load(directory, tokenizer_dir)
    policy.adapt(AdaptationConfig(trainable="expert", dtype="bfloat16", gradient_checkpointing=True))
    backbone = policy.model.model.paligemma_with_expert.paligemma
    assert backbone.model.language_model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    layer = policy.model.model.paligemma_with_expert.gemma_expert.model.layers[0]
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    _, chain, _ = policy.sample_with_log_prob(_obs(), noise=ExplorationNoise(min_std=0.1))
    calls.clear()
    score = policy.log_prob(_obs(), chain)
    assert score.dtype == torch.float32 and torch.isfinite(score).all()
    assert len(calls) == 3  # one expert pass per Euler step
    score.sum().backward()
    assert len(calls) == 6  # checkpointing ran each again for its gradients
    grads = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert grads and not any(".paligemma." in n for n in grads)  # the expert trains, the backbone is frozen


def _openpi_checkpoint_shapes(kind: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of weights a real pi0 / pi05 checkpoint carries: openpi's PyTorch layout (its JAX
    to PyTorch conversion; LeRobot's hub checkpoints hold the same names under ``model.``), worked out from
    the published architecture: Gemma 2B (width 2048, 18 layers, 8 heads of 256, one KV head, MLP 16384),
    the Gemma 300M expert (width 1024, MLP 4096), SigLIP so400m (width 1152, 27 layers, MLP 4304,
    patches of 14), 32 padded action dims, 257152 tokens."""
    vlm, expert, tower = ("paligemma_with_expert.paligemma.model.language_model.layers",
                          "paligemma_with_expert.gemma_expert.model.layers",
                          "paligemma_with_expert.paligemma.model.vision_tower.vision_model")  # fmt: skip
    shapes = {
        "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight": (257152, 2048),
        f"{tower}.embeddings.patch_embedding.weight": (1152, 3, 14, 14),
        f"{tower}.encoder.layers.26.self_attn.q_proj.weight": (1152, 1152),
        f"{tower}.encoder.layers.26.mlp.fc1.weight": (4304, 1152),
        "paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight": (2048, 1152),
        "action_in_proj.weight": (1024, 32),
        "action_out_proj.weight": (32, 1024),
    }
    for layer in (0, 17):
        shapes |= {f"{vlm}.{layer}.self_attn.q_proj.weight": (2048, 2048), f"{vlm}.{layer}.self_attn.k_proj.weight": (256, 2048),
                   f"{vlm}.{layer}.self_attn.v_proj.weight": (256, 2048), f"{vlm}.{layer}.mlp.gate_proj.weight": (16384, 2048),
                   f"{vlm}.{layer}.mlp.down_proj.weight": (2048, 16384),
                   f"{expert}.{layer}.self_attn.q_proj.weight": (2048, 1024), f"{expert}.{layer}.self_attn.k_proj.weight": (256, 1024),
                   f"{expert}.{layer}.self_attn.o_proj.weight": (1024, 2048), f"{expert}.{layer}.mlp.up_proj.weight": (4096, 1024)}  # fmt: skip
    if kind == "pi0":
        shapes |= {"state_proj.weight": (1024, 32), "action_time_mlp_in.weight": (1024, 2048),
                   "action_time_mlp_out.weight": (1024, 1024)}  # fmt: skip
    else:  # pi05: the timestep conditions the expert's norms (adaRMS); the state is tokenized, no projection
        shapes |= {"time_mlp_in.weight": (1024, 1024), "time_mlp_out.weight": (1024, 1024),
                   f"{expert}.0.input_layernorm.dense.weight": (3072, 1024)}  # fmt: skip
    return shapes


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_real_size_pi0_and_pi05_have_the_weight_names_of_a_real_checkpoint(kind, tmp_path):
    """On the meta device (no memory): LeRobot's real-size network takes every weight of a real checkpoint,
    through LeRobot's own key fixes, and vla-rl reads its config as a 50-step chunk policy."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.factory import get_policy_class, make_policy_config

    from policies.lerobot.configuration_lerobot import LeRobotConfig

    features = {"observation.images.base_0_rgb": PolicyFeature(FeatureType.VISUAL, (3, 224, 224)),
                "observation.images.left_wrist_0_rgb": PolicyFeature(FeatureType.VISUAL, (3, 224, 224)),
                "observation.state": PolicyFeature(FeatureType.STATE, (8,))}  # fmt: skip
    config = make_policy_config(kind, input_features=features,
                                output_features={"action": PolicyFeature(FeatureType.ACTION, (7,))}, device="cpu")  # fmt: skip
    config._save_pretrained(tmp_path)
    config.device = "meta"  # LeRobot moves the model to its config's device; meta holds no data
    with torch.device("meta"):
        policy = get_policy_class(kind)(config)
    shapes = _openpi_checkpoint_shapes(kind)
    checkpoint = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    fixed = {
        k if k.startswith("model.") else f"model.{k}": v
        for k, v in policy._fix_pytorch_state_dict_keys(checkpoint, config).items()
    }  # as its from_pretrained
    missing, unexpected = policy.load_state_dict(fixed, strict=False, assign=True)  # a shape mismatch raises
    assert unexpected == [] and not set(fixed) & set(missing)
    count = sum(p.numel() for p in policy.parameters())
    assert 3.5e9 < count < 4.2e9, count  # PaliGemma 3B (its 0.5 B embedding tied) + the 0.3 B expert + heads
    ours = LeRobotConfig.from_directory(tmp_path)
    assert (ours.horizon, ours.n_action_steps, ours.num_inference_steps, ours.action_dim) == (50, 50, 10, 7)
    assert (ours.image_size, sorted(ours.cameras)) == (224, ["base_0_rgb", "left_wrist_0_rgb"])


def test_eval_runs_a_lerobot_vla_with_rtc_guidance_under_delay(tiny_vla, tokenizer_dir, tmp_path):
    from sim.config import EnvConfig
    from vla_core.runtime import ChunkingConfig, DelayConfig
    from vla_rl.eval import EvalConfig, evaluate

    directory, _ = tiny_vla
    policy = _load(directory, tokenizer_dir)
    guided = []
    predict = policy.predict_chunk

    def counting(obs, obs_step=None, **kwargs):
        inpaint = kwargs.get("inpaint")
        guided.append(None if inpaint is None else float(inpaint[1].sum()))
        return predict(obs, obs_step, **kwargs)

    policy.predict_chunk = counting
    cfg = EvalConfig(checkpoint=str(directory), tokenizer_dir=str(tokenizer_dir),
                     env=EnvConfig(num_envs=2, max_episode_steps=16), num_episodes=2, video_episodes=0,
                     chunking=ChunkingConfig(execute_steps=4, merge="rtc"), delay=DelayConfig(steps=2),
                     output_dir=str(tmp_path / "eval"))  # fmt: skip
    result = evaluate(cfg, policy=policy.eval())
    assert result["episodes"] == 2 and result["rtc_guidance"] is True
    assert result["delay_histogram"] == {"2": result["delay_histogram"]["2"]}  # every chunk 2 steps late
    # Every request carries guidance; after an episode's first chunk its weights cover the queued actions.
    assert len(guided) >= 4 and None not in guided and guided[0] == 0 and all(w > 0 for w in guided[1:]), guided


@pytest.mark.parametrize("tiny_vla", ["pi0"], indirect=True)  # one kind: pi05 takes the same path, 9 s more
def test_serve_drives_the_sim_robot_with_a_lerobot_vla_and_rtc(tiny_vla, tokenizer_dir, tmp_path):
    """Two processes over ROS 2: `vla-rl sim-robot` and `vla-rl serve` running the tiny VLA (its inference in
    a thread: the test-only shrinking patch lives in the serving process), chunks guided by RTC."""
    from extras import require

    require("rclpy", "ros")
    import subprocess

    from ros_helpers import STOPPED_BY_SIGINT, RobotClient, last_json, ros_environ, start_command, stop_command
    from std_msgs.msg import String

    directory, _ = tiny_vla
    domain = 64
    robot = start_command(["sim-robot", "--env.task=lift", "--seed=100"], domain, tmp_path, "robot")
    with open(tmp_path / "serve.out", "w") as out, open(tmp_path / "serve.err", "w") as err:
        serve = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "tiny_vla_cli.py"), "serve", "--config_path=configs/serve.yaml",
             f"--checkpoint={directory}", f"--tokenizer_dir={tokenizer_dir}", "--inference=thread",
             "--chunking.execute_steps=4", f"--latency_log={tmp_path / 'latencies.jsonl'}",
             "--control_rt_priority=0", "--control_lock_memory=false"],
            stdout=out, stderr=err, env=ros_environ(domain),
        )  # fmt: skip
    client = RobotClient(domain)
    chunks = []
    client.node.create_subscription(String, "/vla_rl/chunk", lambda m: chunks.append(json.loads(m.data)), 50)
    try:
        client.wait_for_robot()
        client.spin_until(lambda: len(chunks) >= 6, 180, "six chunks from the served VLA")
    finally:
        client.close()
        serve_code, _, serve_err = stop_command(serve, tmp_path, "serve")
        robot_code, robot_out, robot_err = stop_command(robot, tmp_path, "robot")
    assert serve_code == STOPPED_BY_SIGINT, serve_err
    assert robot_code == STOPPED_BY_SIGINT, robot_err
    assert all(c["horizon"] == 8 for c in chunks) and all(c["guided"] for c in chunks[1:]), chunks
    summary = last_json(robot_out)
    rejected = summary["commands_rejected"]
    assert set(rejected) <= {"stale"} and rejected.get("stale", 0) <= 1, summary
    assert summary["commands_received"] >= 20, summary


@pytest.mark.slow
def test_an_openpi_libero_evaluation_runs_a_lerobot_pi0(tokenizer_dir, tmp_path):
    """A tiny pi0 shaped as LeRobot's LIBERO checkpoints are (two 256-pixel cameras, 8 states, 7 actions)
    through `vla-rl eval` on libero_spatial/0 under the openpi protocol: the episode ends at openpi's 220
    steps unless it succeeds first, and the run is recorded per task."""
    from transformers import AutoTokenizer

    from sim.config import EnvConfig
    from sim.libero_protocol import LIBERO_CAMERAS, LIBERO_IMAGE_SIZE
    from vla_rl.eval import EvalConfig, evaluate

    save_tiny_vla(tmp_path / "pi0", AutoTokenizer.from_pretrained(str(tokenizer_dir)), cameras=LIBERO_CAMERAS,
                  image_size=LIBERO_IMAGE_SIZE, state_dim=8, action_dim=7, chunk_size=10, n_action_steps=5)  # fmt: skip
    with tiny_backbones():
        result = evaluate(EvalConfig(
            checkpoint=str(tmp_path / "pi0"), tokenizer_dir=str(tokenizer_dir), output_dir=str(tmp_path / "eval"),
            episodes_per_task=1, video_episodes=0,
            env=EnvConfig(task="libero_spatial/0", num_envs=1, cameras=list(LIBERO_CAMERAS), image_size=LIBERO_IMAGE_SIZE),
        ))  # fmt: skip
    assert result["protocol"]["name"] == "openpi" and result["protocol"]["max_episode_steps"] == 220
    (episode,) = result["per_episode"]
    assert episode["task"] == "libero_spatial/0" and episode["initial_state"] == 0
    assert episode["success"] or episode["length"] == 220
    assert [(r["task"], r["episodes"]) for r in result["per_task"]] == [("libero_spatial/0", 1)]


# -- the steering hooks (`vla_core.types.FlowSteerable`) on LeRobot's padded chunk --------------------------


def _euler_by_hand(policy, obs, start, extra=None):
    """LeRobot's loop written out over the adapter's ``velocity`` hook: dt = -1/n, t_k = 1 + k dt,
    x <- x + dt (v(x, t_k) + extra); the padded chunk (B, 8, 32) in LeRobot's normalization."""
    n = policy.config.num_inference_steps
    x = start.clone()
    with torch.no_grad():
        for k in range(n):
            v = policy.velocity(obs, x, 1.0 + k * (-1.0 / n))
            x = x + (-1.0 / n) * (v + (0 if extra is None else extra))
    return x


def test_a_lerobot_vla_declares_its_padded_noise_and_its_chunk_is_the_euler_integral_of_the_velocity_hook(
    tiny_vla, tokenizer_dir
):
    directory, _ = tiny_vla
    policy = _load(directory, tokenizer_dir)
    assert policy.noise_shape == (8, 32) and policy.latent_dim == 32  # chunk_size, max_action_dim; the expert's width
    obs, start = _obs(), torch.randn(B, 8, 32)
    lerobots = policy.predict_chunk(obs, noise=start).actions  # LeRobot's own loop
    by_hand = policy.postprocessor(_euler_by_hand(policy, obs, start)[..., :4])  # LeRobot unpads to 4 dims
    torch.testing.assert_close(lerobots, by_hand, rtol=1e-5, atol=1e-5)
    c = torch.rand(B, 8, 32, generator=torch.Generator().manual_seed(4)) * 0.6 - 0.3
    seen = []

    def steer(x_t, t, latents):
        seen.append((x_t.clone(), t.clone(), latents.clone()))
        return c

    steered = policy.predict_chunk(obs, noise=start, steer=steer).actions
    torch.testing.assert_close(steered, policy.postprocessor(_euler_by_hand(policy, obs, start, c)[..., :4]),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert torch.equal(torch.stack([t for _, t, _ in seen]), torch.tensor([[1.0, 2 / 3, 1 / 3]] * B).T)
    for x_t, t, latents in seen:  # the latents the steer reads are the hook's at that step
        assert latents.shape == (B, 32)
        torch.testing.assert_close(latents, policy.latents(obs, x_t, t), rtol=1e-5, atol=1e-6)
    assert (policy.latents(obs, start + 0.5, 1.0) - seen[0][2]).abs().max() > 1e-4  # they move with x_t
    # A steer that reads the velocity gets the padded one at each step: returning c - v makes every step's velocity
    # c, so the chunk is start - c (three steps of -c / 3) in LeRobot's normalization, whatever the policy.
    velocities = []

    def composing(x_t, t, latents, velocity):
        velocities.append((x_t.clone(), t.clone(), velocity.clone()))
        return c - velocity

    composing.reads_velocity = True
    composed = policy.predict_chunk(obs, noise=start, steer=composing).actions
    torch.testing.assert_close(composed, policy.postprocessor((start - c)[..., :4]), rtol=1e-5, atol=1e-5)
    for x_t, t, velocity in velocities:
        assert velocity.shape == (B, 8, 32)
        torch.testing.assert_close(velocity, policy.velocity(obs, x_t, t), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"noise for LeRobot's pi0\S* must be \(B, chunk_size, max_action_dim\) = "
                                         r"\(3, 8, 32\), the padded chunk its sampler integrates, got \(3, 8, 4\)"):  # fmt: skip
        policy.predict_chunk(obs, noise=torch.randn(B, 8, 4))  # (B, horizon, action_dim): not what pi0 integrates


def test_a_constant_steer_shifts_a_lerobot_vlas_chunk_by_minus_itself_when_the_velocity_ignores_x(
    tiny_vla, tokenizer_dir
):
    directory, _ = tiny_vla
    policy = _load(directory, tokenizer_dir)
    with torch.no_grad():
        policy.model.model.action_in_proj.weight.zero_()  # the velocity no longer reads x
    obs, start = _obs(), torch.randn(B, 8, 32)
    c = torch.rand(B, 8, 32, generator=torch.Generator().manual_seed(4)) * 0.6 - 0.3
    free = policy.normalize_action(policy.predict_chunk(obs, noise=start).actions)
    steered = policy.normalize_action(policy.predict_chunk(obs, noise=start, steer=lambda x, t, lat: c).actions)
    torch.testing.assert_close(steered - free, -c[..., :4], rtol=0, atol=1e-4)  # LeRobot does not clamp


def test_a_repeated_noise_gives_a_finite_chunk_on_pi0_pi05_and_a_fine_tuned_bf16_lora_policy(tiny_vla, tokenizer_dir):
    """DSRL's repeated noise: one vector of max_action_dim values along every chunk row (an expanded view)."""
    directory, _ = tiny_vla
    row = torch.randn(32, generator=torch.Generator().manual_seed(5))
    for adapted in (None, AdaptationConfig(trainable="lora", lora_rank=4, dtype="bfloat16")):
        policy = _load(directory, tokenizer_dir)
        if adapted is not None:
            policy.adapt(adapted)
            with torch.no_grad():  # a trained adapter
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.5)
        repeated = row.expand(B, *policy.noise_shape)
        chunk = policy.predict_chunk(_obs(), noise=repeated).actions
        assert chunk.shape == (B, 8, 4) and torch.isfinite(chunk).all()
        torch.testing.assert_close(chunk, policy.predict_chunk(_obs(), noise=repeated.clone()).actions, rtol=0, atol=0)
        steered = policy.predict_chunk(_obs(), noise=repeated, steer=lambda x, t, latents: torch.ones_like(x))
        assert torch.isfinite(steered.actions).all()
        latents = policy.latents(_obs(), repeated, 0.5)  # read through the LoRA-wrapped output layer too
        assert latents.shape == (B, policy.latent_dim) and torch.isfinite(latents).all()


def test_a_lerobot_policy_that_is_not_a_flow_vla_is_refused_rl_and_rtc_naming_what_works(tmp_path):
    from test_lerobot_interop import _lerobot_act_policy

    _lerobot_act_policy(tmp_path / "act")
    policy = load_policy(tmp_path / "act")[0]
    assert not policy.is_flow and not policy.supports_inpainting
    with pytest.raises(ValueError, match=r"LeRobot's act policy has no RL actor.*pi0, pi05 and SmolVLA"):
        policy.rl_actor(ExplorationNoise())
    with pytest.raises(ValueError, match=r"needs a flow VLA.*--chunking.merge=latest"):
        policy.predict_chunk(_obs(), inpaint=(torch.zeros(B, 8, 4), torch.ones(B, 8)))
    fix = r"needs a flow velocity, which LeRobot's act policy does not have; steer a flow policy: LeRobot's pi0"
    for call in (lambda: policy.predict_chunk(_obs(), steer=lambda *a: 0), lambda: policy.noise_shape,
                 lambda: policy.velocity(_obs(), torch.zeros(B, 8, 4), 0.5), lambda: policy.latent_dim):  # fmt: skip
        with pytest.raises(ValueError, match=fix):
            call()
    with pytest.raises(ValueError, match=r"--vla.\* adapts LeRobot's flow VLAs.*'act' policy: drop the --vla"):
        _finetune(tmp_path / "act", "", tmp_path / "run", vla=AdaptationConfig(trainable="expert"))
    with pytest.raises(ValueError, match="tokenizes no instructions: drop --tokenizer_dir"):
        load_policy(tmp_path / "act", tokenizer_dir=str(tmp_path))


def test_flags_that_would_be_ignored_are_refused(tiny_checkpoint, tmp_path):
    out, _ = tiny_checkpoint  # a vla-rl diffusion policy: its instructions use its own vocabulary
    with pytest.raises(ValueError, match="holds a vla-rl policy, which brings its own tokenizer: drop --tokenizer_dir"):
        load_policy(out, tokenizer_dir=str(tmp_path))
    with pytest.raises(ValueError, match="with --vla.trainable=expert there are none"):
        AdaptationConfig(trainable="expert", lora_rank=8).validate()
    AdaptationConfig(trainable="lora", lora_rank=8).validate()  # where they apply, accepted


# -- SmolVLA: LeRobot builds its backbone from SmolVLM's config and processor, here a tiny local copy --


@pytest.fixture(scope="module")
def tiny_smolvla(tmp_path_factory):
    """(directory, the local SmolVLM folder --tokenizer_dir names): a random tiny SmolVLA for the lift env."""
    from tiny_lerobot_vla import save_tiny_smolvla, save_tiny_smolvlm

    vlm = tmp_path_factory.mktemp("smolvlm")
    save_tiny_smolvlm(vlm, WORDS)
    directory = tmp_path_factory.mktemp("smolvla")
    save_tiny_smolvla(directory, vlm)
    return directory, vlm


def test_smolvla_needs_its_vlms_config_and_its_zero_noise_chain_is_lerobots_sampler(tiny_smolvla, tokenizer_dir):
    directory, vlm = tiny_smolvla
    with pytest.raises(ValueError, match=r"config.json of HuggingFaceTB/SmolVLM2-500M-Video-Instruct.*hf download"):
        load_policy(directory, tokenizer_dir=str(tokenizer_dir))  # a tokenizer folder without the VLM's config
    policy = load_policy(directory, tokenizer_dir=str(vlm))[0]
    assert (policy.config.lerobot_type, policy.config.num_inference_steps, policy.config.horizon) == ("smolvla", 3, 8)
    obs, start = _obs(), torch.randn(B, 8, 32)
    lerobots = policy.predict_chunk(obs, noise=start).actions
    sampler = flow.Sampler(torch.zeros(3))
    with flow.integrator(policy.model, sampler) as predict:
        ours = policy._chunk_out(predict(policy._model_batch(obs), noise=start), obs, None).actions
    torch.testing.assert_close(ours, lerobots, rtol=0, atol=0)
    _, chain, behaviour = policy.sample_with_log_prob(obs, noise=ExplorationNoise(min_std=0.1))
    torch.testing.assert_close(policy.log_prob(obs, chain).detach(), behaviour, rtol=1e-6, atol=1e-2)
    scored = policy.rl_actor(ExplorationNoise(min_std=0.1)).score(obs, chain)  # the final step's 4 run dims
    torch.testing.assert_close(scored.values[:, :-1], policy.log_prob(obs, chain, per_step=True)[:, :-1].detach())
    scored.values.sum().backward()
    assert any(p.grad is not None for p in policy.model.model.vlm_with_expert.lm_expert.parameters())
    # The steering hooks: LeRobot's loop is the Euler integral of the velocity hook; a repeated noise is finite.
    assert policy.noise_shape == (8, 32) and policy.latent_dim == policy.model.model.vlm_with_expert.expert_hidden_size
    torch.testing.assert_close(lerobots, policy.postprocessor(_euler_by_hand(policy, obs, start)[..., :4]),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    repeated = torch.randn(32, generator=torch.Generator().manual_seed(5)).expand(B, 8, 32)
    steered = policy.predict_chunk(obs, noise=repeated, steer=lambda x, t, latents: 0.1 * torch.ones_like(x)).actions
    assert steered.shape == (B, 8, 4) and torch.isfinite(steered).all()
    assert policy.latents(obs, repeated, 0.5).shape == (B, policy.latent_dim)


def test_finetune_trains_smolvla_with_lora_and_saves_a_checkpoint_vla_rl_reloads_offline(tiny_smolvla, tmp_path):
    directory, vlm = tiny_smolvla
    _finetune(directory, vlm, tmp_path / "run", vla=AdaptationConfig(trainable="lora", lora_rank=4))
    saved = tmp_path / "run" / "checkpoints" / "step-00000001" / "pretrained_model"
    before, after = load_file(str(Path(directory) / "model.safetensors")), load_file(str(saved / "model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    targets = _load(directory, vlm).model._get_default_peft_targets()["target_modules"]
    assert changed and all(re.fullmatch(targets, k.removesuffix(".weight")) for k in changed), changed
    again = load_policy(saved)[0]  # the VLM's config and processor travel in its tokenizer/ folder
    assert again.config.lerobot_type == "smolvla" and again.predict_chunk(_obs()).actions.shape == (B, 8, 4)


@pytest.mark.slow
def test_finetune_on_libero_evaluates_under_the_openpi_protocol(tokenizer_dir, tmp_path):
    """A LIBERO-shaped tiny pi0 fine-tuned one iteration on libero_spatial/0 with short rollouts (30 steps),
    evaluated before and after under the openpi protocol: its own step limit (220), whatever the
    rollouts' is, one episode per task from initial state 0."""
    from transformers import AutoTokenizer

    from sim.config import EnvConfig
    from sim.libero_protocol import LIBERO_CAMERAS, LIBERO_IMAGE_SIZE

    save_tiny_vla(tmp_path / "pi0", AutoTokenizer.from_pretrained(str(tokenizer_dir)), cameras=LIBERO_CAMERAS,
                  image_size=LIBERO_IMAGE_SIZE, state_dim=8, action_dim=7, chunk_size=10, n_action_steps=5)  # fmt: skip
    env = EnvConfig(task="libero_spatial/0", num_envs=1, cameras=list(LIBERO_CAMERAS), image_size=LIBERO_IMAGE_SIZE,
                    max_episode_steps=30)  # fmt: skip
    summary = _finetune(tmp_path / "pi0", tokenizer_dir, tmp_path / "run", env=env, eval_every=1, eval_episodes=1,
                        vla=AdaptationConfig(trainable="expert"))  # fmt: skip
    assert [e["episodes"] for e in summary["evals"]] == [1, 1]
    record = json.loads((tmp_path / "run" / "eval" / "iter-0001" / "eval.json").read_text())
    assert record["protocol"]["name"] == "openpi" and record["protocol"]["max_episode_steps"] == 220
    (episode,) = record["per_episode"]
    assert episode["initial_state"] == 0 and (episode["success"] or episode["length"] == 220)
    assert summary["history"][0]["executed_env_steps"] <= 30 * 2  # the rollouts stop at their own 30 steps
