"""The checks of vla-rl's code written for GPUs, to run on a machine with a CUDA device (CI has none).

    python benchmarks/gpu_smoke.py [--out gpu_smoke.json]

Each check runs on its own and reports pass, fail (with the error) or not run (with the reason, e.g.
MuJoCo Warp not installed); the JSON holds every check, the last line printed is
``gpu_smoke=<pass|fail> passed=<n> failed=<k> not_run=<m>``, and the exit code is 1 when one fails.

1. ``delay_streams``: the delay model's generators on the GPU follow the one seeding rule (stream s
   draws what seed + s draws, different streams differ) and a saved state restores the draws.
2. ``policy_on_gpu``: a small diffusion policy and a small flow VLA on the GPU give the chunk they give
   on the CPU for the same observation and noise, and the chunk kept in ``gpu_smoke_reference.json``
   (``max_gap_to_reference``: written once by ``--write-reference`` on a CPU, so a check run on the CPU
   compares with something it did not compute); the RL actor samples and scores a chain there; a latency
   head added on the GPU leaves the chunk unchanged.
3. ``shell_on_gpu``: the simulation's shell of the latency protocol over a MuJoCo Warp env on the GPU,
   with uniform delays, runs whole episodes with the state on the device.
4. ``ray_worker_on_gpu``: a Ray rollout worker that declares a GPU runs its policy copy there and hands
   the learner CPU tensors (``--ray.worker_gpus``).
5. ``lerobot_vla_on_gpu``: LeRobot's pi0 (shrunk by the tests' config patch, `tests/tiny_lerobot_vla.py`)
   behind vla-rl's adapter gives on the GPU the chunk it gives on the CPU and the kept reference; adapted as `vla-rl finetune
   --vla.trainable=expert --vla.dtype=bfloat16 --vla.gradient_checkpointing=true` makes it, it samples a
   chain and scores it with finite float32 log-probs and gradients there; reports the peak memory.
6. ``autoregressive_vla_on_gpu``: a small autoregressive VLA (FAST tokens fitted on random smooth chunks)
   decodes on the GPU the tokens it decodes on the CPU, batched with the key-value cache and without it;
   its RL actor samples a sequence there and scores it with finite log-probs and gradients; reports the
   decode time of the batch and the peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class NotRun(Exception):
    """A check that cannot run here (a missing part), as opposed to one that fails."""


# The chunks of the checks' small policies for their fixed observation and noise, computed once on a CPU by
# `--write-reference` (again after a change that is meant to change them, saying so in the commit).
REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_smoke_reference.json")
REFERENCE_TOLERANCE = 1e-3  # float32 kernels of another device (or BLAS) agree to about 1e-5 on these sizes


def gap_to_reference(name: str, actions) -> float:
    """The largest absolute difference of ``actions`` (any device) from the kept chunk ``name``."""
    import torch

    with open(REFERENCE) as f:
        kept = torch.tensor(json.load(f)[name])
    if tuple(kept.shape) != tuple(actions.shape):
        raise AssertionError(f"{name}: chunk of shape {tuple(actions.shape)}, the reference's is {tuple(kept.shape)}")
    return float((actions.detach().cpu().double() - kept.double()).abs().max())


def check_delay_streams(device) -> dict:
    import torch

    from vla_core.runtime import DelayConfig, DelayModel

    cfg = DelayConfig(kind="uniform", high=9, seed=5)
    a = DelayModel(cfg, stream=3).sample(64, device)
    same = DelayModel(DelayConfig(kind="uniform", high=9, seed=8)).sample(64, device)
    other = DelayModel(cfg, stream=4).sample(64, device)
    assert a.device.type == device.type and torch.equal(a, same) and not torch.equal(a, other)
    model = DelayModel(cfg, stream=1)
    model.sample(10, device)
    state = model.state_dict()
    expected = model.sample(32, device)
    fresh = DelayModel(cfg, stream=1)
    fresh.load_state_dict(state)
    assert device.type == "cpu" or any(name.startswith(device.type) for name in state), state.keys()
    assert torch.equal(fresh.sample(32, device), expected)
    return {"streams_differ": True, "restored": True}


def _tiny_policy(kind: str):
    import torch

    from policies.diffusion import DiffusionConfig
    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from policies.diffusion_vla import DiffusionVLAConfig
    from policies.diffusion_vla.modeling_diffusion_vla import DiffusionVLAPolicy

    torch.manual_seed(0)
    shared = {"state_dim": 3, "action_dim": 2, "cameras": ["front"], "image_size": 16, "horizon": 6,
              "n_action_steps": 2, "vocabulary": ["<pad>", "<unk>", "go"]}  # fmt: skip
    if kind == "diffusion":
        policy = DiffusionPolicy(
            DiffusionConfig(**shared, vision_channels=8, num_keypoints=4, text_dim=8, hidden_dim=32)
        )
    else:
        policy = DiffusionVLAPolicy(DiffusionVLAConfig(**shared, patch_size=8, dim=32, depth=1, heads=2, vision_width=32,
                                                       vision_layers=1, text_width=32, objective="flow"))  # fmt: skip
    policy.set_normalization([0.0] * 3, [1.0] * 3, [-1.0, -1.0], [1.0, 1.0])
    return policy.eval()


def _policy_inputs():
    """The fixed observation (4 worlds) and noise the small policies' chunks are compared on."""
    import torch

    g = torch.Generator().manual_seed(1)
    obs = {"observation.images.front": torch.rand(4, 3, 16, 16, generator=g), "observation.state": torch.randn(4, 3, generator=g),
           "task": ["go"] * 4}  # fmt: skip
    return obs, torch.randn(4, 6, 2, generator=g)


def check_policy_on_gpu(device) -> dict:
    import torch

    from policies.denoising_chain import ExplorationNoise

    obs, noise = _policy_inputs()
    on = lambda o: {k: v.to(device) if torch.is_tensor(v) else v for k, v in o.items()}
    gaps, to_reference = {}, {}
    for kind in ("diffusion", "flow"):
        policy = _tiny_policy(kind)
        cpu = policy.predict_chunk(obs, noise=noise).actions
        policy.to(device)
        gpu = policy.predict_chunk(on(obs), noise=noise.to(device)).actions
        gaps[kind] = float((gpu.cpu() - cpu).abs().max())
        to_reference[kind] = gap_to_reference(kind, gpu)
        assert gaps[kind] < 1e-3 and to_reference[kind] < REFERENCE_TOLERANCE, (kind, gaps[kind], to_reference[kind])
        actor = policy.rl_actor(ExplorationNoise(eta=0.0, min_std=0.1))
        chunk, chain = actor.act(on(obs), torch.zeros(4, dtype=torch.long, device=device))
        executed = torch.arange(policy.config.horizon, device=device).expand(4, -1) < 4  # the rows that ran
        scored = actor.score(on(obs), chain, executed)
        assert chunk.actions.device.type == device.type and torch.isfinite(scored.values).all()
        policy.add_latency_head(2, 0.5, ["front"])
        mid = {"observation.committed_actions": torch.zeros(4, 2, 2), "observation.committed_mask": torch.zeros(4, 2, dtype=torch.bool),
               "observation.delay_steps": torch.zeros(4, dtype=torch.long), "observation.mid.state": obs["observation.state"],
               "observation.mid.images.front": obs["observation.images.front"], "observation.mid.steps": torch.zeros(4, dtype=torch.long)}  # fmt: skip
        aware = policy.predict_chunk(on({**obs, **mid}), noise=noise.to(device)).actions
        assert torch.equal(aware, gpu), kind
    return {"max_gap_to_cpu": gaps, "max_gap_to_reference": to_reference}


def check_shell_on_gpu(device, num_envs: int = 64) -> dict:
    """The latency shell over MuJoCo Warp worlds on ``device``: every world holds its arm for 30 steps (an
    episode each, ended by truncation), the shell's tensors on the device."""

    try:
        import mujoco_warp  # noqa: F401
    except ImportError as err:
        raise NotRun(f"MuJoCo Warp is not installed ({err}); pip install the gpu extra") from err
    from sim.config import EnvConfig
    from sim.factory import make_env
    from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
    from vla_core.runtime.delayed_env import DelayedChunkEnv
    from vla_core.types import ActionChunk

    with make_env(EnvConfig(task="reach", backend="warp", device=str(device), num_envs=num_envs, cameras=[],
                            max_episode_steps=30)) as env:  # fmt: skip
        spec = LatencySpec(horizon=8, n_action_steps=4)
        shell = DelayedChunkEnv(env, spec, ChunkingConfig(), DelayModel(DelayConfig(kind="uniform", high=3)))
        shell.reset(seed=0)
        ended, start = 0, time.perf_counter()
        hold = env.hold_actions()
        steps = 0
        while ended < num_envs:
            chunk = ActionChunk(hold[:, None].expand(-1, 8, -1).contiguous(), shell.obs_step)
            _, _, terminated, truncated, info, need = shell.step(chunk)
            assert need.device.type == device.type and info["trace"].source.device.type == device.type
            ended += int((terminated | truncated).sum())
            steps += 1
    return {"episodes": ended, "steps": steps, "seconds": round(time.perf_counter() - start, 2)}


def check_ray_worker_on_gpu(device) -> dict:
    """A Ray rollout worker declaring one GPU (none on the CPU) runs its policy copy there, collects
    whole episodes, and hands back CPU tensors the learner can read."""
    try:
        import ray
    except ImportError as err:
        raise NotRun(f"Ray is not installed ({err}); pip install the ray extra") from err
    import torch

    from policies.denoising_chain import ExplorationNoise
    from policies.diffusion import DiffusionConfig
    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from sim.config import EnvConfig
    from sim.factory import make_env
    from vla_core import interrupt
    from vla_core.runtime import ChunkingConfig, DelayConfig
    from vla_rl.rl.ray_runtime import RolloutWorker

    env_cfg = EnvConfig(task="reach", num_envs=2, image_size=16, max_episode_steps=8, render_threads=1)
    with make_env(env_cfg) as env:
        state_dim, action_dim = env.reset(seed=0)["observation.state"].shape[1], env.action_dim
    torch.manual_seed(0)
    policy = DiffusionPolicy(DiffusionConfig(state_dim=state_dim, action_dim=action_dim, cameras=["front"], image_size=16,
                                             horizon=6, n_action_steps=2, vocabulary=["<pad>", "<unk>"], vision_channels=8,
                                             num_keypoints=4, text_dim=8, hidden_dim=32))  # fmt: skip
    policy.set_normalization([0.0] * state_dim, [1.0] * state_dim, [-1.0] * action_dim, [1.0] * action_dim)
    gpus = 1 if device.type == "cuda" else 0
    with interrupt.kept():  # ray.init leaves a SIGTERM handler of its own
        ray.init(address="local", num_cpus=2, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    try:
        worker = ray.remote(num_cpus=1, num_gpus=gpus)(RolloutWorker).remote(
            policy.eval(), env_cfg, ChunkingConfig(), DelayConfig(), 1, 0.99, ExplorationNoise(eta=0.0, min_std=0.1), 0
        )
        placed = ray.get(worker.ready.remote())
        assert placed["device"] == device.type, placed
        rollout, stats, _ = ray.get(worker.collect.remote(0, None, 0, 1, 0))
        log_prob = rollout.behaviour_log_prob.values
        assert log_prob.device.type == "cpu" and torch.isfinite(log_prob).all() and stats.episodes == 2
    finally:
        ray.shutdown()
    return {"worker_device": placed["device"], "decisions": len(rollout)}


def _lerobot_vlas(device):
    """The tests' tiny pi0 (seeded) loaded on the CPU and on ``device``, and its fixed observation and noise."""
    import tempfile
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_lerobot_vla import save_tiny_vla, tiny_backbones, word_tokenizer

    from vla_rl.checkpoint import load_policy

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = word_tokenizer(Path(tmp) / "tokenizer", ["lift", "the", "cube"])
        save_tiny_vla(Path(tmp) / "pi0", tokenizer)
        with tiny_backbones():
            cpu, on_device = (load_policy(Path(tmp) / "pi0", device=d, tokenizer_dir=str(Path(tmp) / "tokenizer"))[0]
                              for d in ("cpu", device))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    obs = {"observation.images.front": torch.rand(2, 3, 64, 64, generator=g),
           "observation.state": torch.randn(2, 11, generator=g), "task": ["lift the cube"] * 2}  # fmt: skip
    return cpu, on_device, obs, torch.randn(2, 8, 32, generator=g)


def write_reference(path: str = REFERENCE) -> dict:
    """Compute the kept chunks on the CPU and write them to ``path`` (`--write-reference`)."""
    obs, noise = _policy_inputs()
    chunks = {kind: _tiny_policy(kind).predict_chunk(obs, noise=noise).actions for kind in ("diffusion", "flow")}
    vla, _, vla_obs, vla_noise = _lerobot_vlas("cpu")
    chunks["lerobot_vla"] = vla.predict_chunk(vla_obs, noise=vla_noise).actions
    kept = {name: [[[round(float(v), 7) for v in row] for row in chunk] for chunk in actions.detach()]
            for name, actions in chunks.items()}  # fmt: skip
    with open(path, "w") as f:
        json.dump(kept, f)
    return kept


def check_lerobot_vla_on_gpu(device) -> dict:
    import torch

    from policies.denoising_chain import ExplorationNoise
    from policies.lerobot.adaptation import AdaptationConfig

    cpu, gpu, obs, noise = _lerobot_vlas(device)
    on_gpu = {k: v.to(device) if torch.is_tensor(v) else v for k, v in obs.items()}
    chunk = gpu.predict_chunk(on_gpu, noise=noise.to(device)).actions
    gap, to_reference = (
        cpu.predict_chunk(obs, noise=noise).actions - chunk.cpu(),
        gap_to_reference("lerobot_vla", chunk),
    )
    gpu.adapt(AdaptationConfig(trainable="expert", dtype="bfloat16", gradient_checkpointing=True))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _, chain, behaviour = gpu.sample_with_log_prob(on_gpu, noise=ExplorationNoise(min_std=0.1))
    score = gpu.log_prob(on_gpu, chain)
    score.sum().backward()
    grads = [p.grad for p in gpu.parameters() if p.grad is not None]
    assert float(gap.abs().max()) < 1e-3 and to_reference < REFERENCE_TOLERANCE, (float(gap.abs().max()), to_reference)
    assert score.dtype == torch.float32 and torch.isfinite(score).all() and torch.isfinite(behaviour).all()
    assert grads and all(torch.isfinite(gr).all() for gr in grads)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"max_gap_to_cpu": round(float(gap.abs().max()), 8), "max_gap_to_reference": round(to_reference, 8),
            "trained_tensors": len(grads), "peak_mib": peak}  # fmt: skip


def check_autoregressive_vla_on_gpu(device) -> dict:
    import types

    import torch

    from policies.autoregressive_vla import AutoregressiveVLAConfig
    from policies.autoregressive_vla.modeling_autoregressive_vla import AutoregressiveVLAPolicy
    from policies.denoising_chain import ExplorationNoise

    torch.manual_seed(0)
    policy = AutoregressiveVLAPolicy(AutoregressiveVLAConfig(
        state_dim=3, action_dim=2, cameras=["front"], image_size=16, horizon=8, n_action_steps=4,
        vocabulary=["<pad>", "<unk>", "go"], width=64, heads=2, kv_heads=1, vision_width=32,
    ))  # fmt: skip
    policy.set_normalization([0.0] * 3, [1.0] * 3, [-1.0, -1.0], [1.0, 1.0])
    g = torch.Generator().manual_seed(1)
    steps = torch.linspace(0, 1, 8)[None, :, None]
    chunks = (torch.rand(64, 1, 2, generator=g) * 2 - 1) * (1 - steps) + torch.rand(64, 1, 2, generator=g) * steps
    policy.fit_to_demonstrations(types.SimpleNamespace(action_chunks=lambda horizon, frames=None: chunks))
    policy.eval()
    obs = {"observation.images.front": torch.rand(8, 3, 16, 16, generator=g), "observation.state": torch.randn(8, 3, generator=g),
           "task": ["go"] * 8}  # fmt: skip
    on_gpu = {k: v.to(device) if torch.is_tensor(v) else v for k, v in obs.items()}
    cpu_tokens = policy.sample_tokens(obs, None, 0.0)[1]
    policy.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    cached = policy.sample_tokens(on_gpu, None, 0.0)[1]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    uncached = policy.sample_tokens(on_gpu, None, 0.0, use_cache=False)[1]
    for decoded in (cached, uncached):
        assert torch.equal(decoded.ids.cpu(), cpu_tokens.ids) and torch.equal(decoded.mask.cpu(), cpu_tokens.mask)
    actor = policy.rl_actor(ExplorationNoise(eta=0.0, min_std=0.1))
    chunk, decision = actor.act(on_gpu, torch.zeros(8, dtype=torch.long, device=device))
    scored = actor.score(on_gpu, decision, torch.arange(policy.config.horizon, device=device).expand(8, -1) < 4)
    scored.values[scored.mask].sum().backward()
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert chunk.actions.device.type == device.type and torch.isfinite(scored.values).all()
    assert grads and all(torch.isfinite(gr).all() for gr in grads)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"tokens_per_chunk": round(float(cached.mask.sum(1).float().mean()), 2), "decode_seconds": round(seconds, 4),
            "peak_mib": peak}  # fmt: skip


CHECKS = {
    "delay_streams": check_delay_streams,
    "policy_on_gpu": check_policy_on_gpu,
    "shell_on_gpu": check_shell_on_gpu,
    "ray_worker_on_gpu": check_ray_worker_on_gpu,
    "lerobot_vla_on_gpu": check_lerobot_vla_on_gpu,
    "autoregressive_vla_on_gpu": check_autoregressive_vla_on_gpu,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_smoke.json", help="where the JSON of every check goes")
    parser.add_argument("--write-reference", action="store_true",
                        help=f"compute the small policies' chunks on this CPU and keep them in {REFERENCE} (after a "
                             "change meant to change them), then exit")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    if args.write_reference:
        kept = write_reference()
        print(f"wrote {', '.join(kept)} to {REFERENCE}")
        return 0
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here; run this on a machine with one", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": {}}
    for name, check in CHECKS.items():
        try:
            results["checks"][name] = {"status": "pass", **check(device)}
        except NotRun as err:
            results["checks"][name] = {"status": "not_run", "reason": str(err)}
        except Exception as err:  # noqa: BLE001 (every check reports; one failing does not stop the others)
            results["checks"][name] = {"status": "fail", "error": f"{type(err).__name__}: {err}",
                                       "traceback": traceback.format_exc()}  # fmt: skip
        print(f"{name}: {results['checks'][name]['status']}", file=sys.stderr)
    statuses = [c["status"] for c in results["checks"].values()]
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    ok = "fail" not in statuses
    print(f"gpu_smoke={'pass' if ok else 'fail'} passed={statuses.count('pass')} failed={statuses.count('fail')} "
          f"not_run={statuses.count('not_run')}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
