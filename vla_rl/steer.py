"""`vla-rl steer`: RL²'s latent steering of a frozen flow policy, from its own rollouts (`vla_rl.steering` holds
the method and its math). Stages, into ``output_dir``:

1. collect: ``episodes`` closed-loop episodes of the frozen policy in the batched sim (the task and its
   ``--env.variation``, or each of ``variations``), through the latency model as `vla-rl eval` runs them. For
   every request: its observation-only latents z (`vla_rl.steering.observation_latents`) and the sampler's end
   x_0 (its last Euler step undone from the velocity hook); each request keeps its episode's success once it
   ends. Each world counts its first ceil(episodes / N) episodes (so ``episodes`` rounds up to a multiple of the
   worlds), whatever their length. Written as a LeRobotDataset, ``rollouts/`` (`ROLLOUT_FEATURES`): one frame
   per request (its images and state, the chunk the policy sampled, the ``steer.*`` features), one LeRobot
   episode per rollout; a run resumed with another base, env or sizes is refused.
2. train: episodes split by a seeded draw (``held_out_fraction`` held out). On the training episodes' requests:
   the chunk-level critic (IQL), then the RL flow policy by advantage-weighted flow matching, and the failure
   predictor; its threshold on the held-out episodes' requests (Youden's J).
3. choose the weight w among ``weights`` and the candidates N among ``best_of`` (best-of-N selection by the critic
   in steered chunks; N = 1: none), together: the gated steered policy with each pair (w = 0 only with N > 1:
   the critic choosing among the base's own samples), ``choose_episodes`` episodes per setting from seed
   ``seed + 500`` (neither the collection's nor eval's); the highest episode success rate, of equal rates the
   cheapest: the smallest N, then the smallest w. The base runs on the same episodes for the record; ``base_better`` says when
   it beat the chosen pair (the steering then hurts where it was chosen).
4. write ``steering/`` (config.json with the threshold, the weight, N and the metrics; model.safetensors with the
   critic) and
   ``steer_summary.json``. Success is counted per episode (``episode_success_rate``) and per request
   (``request_success_rate``: the share of requests whose episode succeeded; failing episodes are longer, so
   this is lower). Evaluate with ``vla-rl eval --checkpoint=<base> --steer.dir=<output_dir>/steering
   --steer.mode=gated|always``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sim.config import EXECUTION_FIELDS, EnvConfig, outcome_fields
from vla_core import interrupt
from vla_core.data import discard_dataset, open_dataset, quiet_datasets
from vla_core.files import replace_directory
from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
from vla_core.types import OBS_IMAGES, OBS_STATE, TASK, ActionChunk
from vla_rl.checkpoint import load_policy
from vla_rl.config_json import chunking_made_with
from vla_rl.eval_record import weights_sha256
from vla_rl.steering import (
    SteeredPolicy,
    Steering,
    advantage_weights,
    check_steerable,
    choose_threshold,
    observation_latents,
    sampler_end,
    train_critic,
    train_flow_policy,
    train_predictor,
)


@dataclass
class SteerConfig:
    """Latent steering (RL²) of a frozen flow policy: collect its rollouts, train the critic, the RL flow policy and
    the failure predictor offline, choose the weight, write them for `vla-rl eval --steer.dir`."""

    checkpoint: str = "outputs/quickstart/train"  # the frozen flow policy (a checkpoint dir or a training run)
    env: EnvConfig = field(default_factory=lambda: EnvConfig(num_envs=16))  # the task, its variation, worlds
    # Collect under several settings, ``episodes`` each, pooled: env.variation = each of these ("" = in
    # distribution); empty = env.variation alone.
    variations: list[str] = field(default_factory=list)
    episodes: int = 200  # rollouts collected per setting (whole episodes; the ones cut at the end are dropped)
    seed: int = 7000  # initial states of the rollouts (apart from eval's 1000 and the recording seeds)
    held_out_fraction: float = 0.25  # episodes held out to choose the gate's threshold
    predictor_steps: int = 500
    critic_steps: int = 3000
    flow_steps: int = 3000  # the RL flow policy's
    batch_size: int = 256
    lr: float = 1e-3  # of the predictor and the flow policy
    critic_lr: float = 3e-4
    hidden: int = 256  # the width of every network
    gamma: float = 0.95  # discount per request
    expectile: float = 0.9  # IQL's tau: V tends to the best returns the data shows from a state
    beta: float = 0.05  # temperature of the advantage weights: sharp, so the chunks above the state's value dominate
    # the composition's w and the best-of-N candidates, chosen together in stage 3 (w = 0 is tried with N > 1 only)
    weights: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    best_of: list[int] = field(default_factory=lambda: [1, 8])
    choose_episodes: int = 32  # per setting and pair, in stage 3 (0: the last pair, unchosen: the largest N, then w)
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    delay: DelayConfig = field(default_factory=DelayConfig)
    device: str = "cpu"
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    output_dir: str = "outputs/steer"  # rollouts/ (a LeRobotDataset), steering/, steer_summary.json


def run_steer(cfg: SteerConfig) -> dict[str, Any]:
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if not 0 < cfg.held_out_fraction < 1 or cfg.episodes * max(1, len(cfg.variations)) < 4:
        raise ValueError("held_out_fraction must be in (0, 1) and the episodes over every setting >= 4 (some to "
                         "train on, some held out)")  # fmt: skip
    if (cfg.delay.kind, cfg.delay.steps) != ("fixed", 0):
        raise ValueError(
            "RL²'s critic reads the rows of a chunk that run at zero delay: run vla-rl steer without --delay"
        )
    if not candidates(cfg) or min(cfg.weights) < 0 or min(cfg.best_of, default=0) < 1 or cfg.choose_episodes < 0 \
            or not 0 < cfg.expectile < 1:  # fmt: skip
        raise ValueError("--weights must be weights >= 0 and --best_of counts >= 1 giving at least one pair other "
                         "than w = 0 with N = 1 (the base); --choose_episodes >= 0 and --expectile in (0, 1)")  # fmt: skip
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy, _ = load_policy(cfg.checkpoint, device=cfg.device)
    policy.eval()
    check_steerable(policy)
    start = time.time()
    rollouts = out / "rollouts"
    collection = {"base_sha256": weights_sha256(policy), "env": outcome_fields(cfg.env), "variations": list(cfg.variations),
                  "episodes": cfg.episodes, "seed": cfg.seed, "chunking": chunking_made_with(cfg.chunking, [cfg.env.task]),
                  "delay": asdict(cfg.delay), "version": COLLECTION_VERSION}  # fmt: skip
    if (rollouts / "meta" / "info.json").is_file():  # a run stopped after collecting goes on from its rollouts
        made_with = rollouts / "meta" / COLLECTION_FILE
        saved = json.loads(made_with.read_text()) if made_with.is_file() else {}
        if isinstance(saved.get("env"), dict):  # collected before outcome_fields: every field kept
            saved["env"] = {k: v for k, v in saved["env"].items() if k not in EXECUTION_FIELDS}
        for name, value in collection.items():
            if saved.get(name) != value:
                raise ValueError(f"{rollouts} was collected with another {name} ({saved.get(name)!r} against "
                                 f"{value!r}): pass another --output_dir, or delete it to collect again")  # fmt: skip
    else:
        collect_dataset(cfg, policy, rollouts, collection)
    data = load_rollouts(rollouts)
    collected_s = time.time() - start
    executed = (cfg.chunking.execute_steps or policy.config.n_action_steps, policy.config.action_dim)
    steering, metrics = train(cfg, data, tuple(policy.noise_shape), policy.latent_dim, executed)
    steering.base_sha256 = collection["base_sha256"]  # a steering refuses any other base (`SteeredPolicy`)
    metrics["weights"] = choose_weight(cfg, policy, steering)
    steering.metrics = metrics
    steering.save(out / "steering", {"checkpoint": cfg.checkpoint, "env": asdict(cfg.env)})
    summary = {"config": asdict(cfg), **metrics, "collect_seconds": round(collected_s, 1),
               "seconds": round(time.time() - start, 1)}  # fmt: skip
    tmp = out / "steer_summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "steer_summary.json")
    return summary


# -- collect -------------------------------------------------------------------------------------


@torch.no_grad()
def record_request(policy, obs: dict, obs_step: torch.Tensor, generator: torch.Generator):
    """Sample one chunk per row of ``obs`` from drawn noise. Returns (the chunk's actions (B, H, A), {z (B, L) the
    observation-only latents, x0 (B, *S) the sampler's end})."""
    batch = len(obs_step)
    noise = torch.randn(batch, *policy.noise_shape, generator=generator).to(policy.device)
    seen: dict[str, torch.Tensor] = {}

    def recording(x_t, t, latents, velocity):  # adds nothing; keeps where each step lands (the last's: the end)
        seen["x0"] = sampler_end(x_t.detach(), t.detach(), velocity.detach())
        return torch.zeros_like(x_t)

    recording.reads_velocity = True
    chunk = policy.predict_chunk(obs, obs_step, noise=noise, steer=recording)
    return chunk.actions, {"z": observation_latents(policy, obs).cpu(), "x0": seen["x0"].float().cpu()}


COLLECTION_FILE = "vla_rl_steer_collection.json"  # in the dataset's meta/: what the rollouts were collected with
COLLECTION_VERSION = 2  # 2: observation-only latents and the sampler's end (1: regression samples of a residual field)
# The extra features of a rollout frame (one request), with their shapes: S = the policy's noise shape, L = its
# latent width, (H, A) its chunk.
ROLLOUT_FEATURES = {
    "steer.chunk": "(H, A) the chunk the frozen policy sampled",
    "steer.z": "(L,) the observation-only latents (the gate's and the RL policy's input)",
    "steer.x0": "(*S) the sampler's end: the chunk in the policy's normalized units, before any clamp",
    "steer.obs_step": "(1,) the control step of the request's observation",
    "steer.success": "(1,) whether the request's episode succeeded",
    "steer.setting": "(1,) the index of its env.variation in the run's settings (`variations`, or env.variation)",
}


def rollout_features(env, policy) -> dict:
    """LeRobot's features of the rollouts dataset: the env's observations, then `ROLLOUT_FEATURES`."""
    noise, latent, horizon = tuple(policy.noise_shape), policy.latent_dim, policy.config.horizon
    shapes = {"steer.chunk": (horizon, env.action_dim), "steer.z": (latent,), "steer.x0": noise}
    feats = {k: dict(f) for k, f in env.features.items() if k == OBS_STATE or k.startswith(OBS_IMAGES + ".")}
    feats |= {k: {"dtype": "float32", "shape": shape, "names": None} for k, shape in shapes.items()}
    feats["steer.obs_step"] = feats["steer.setting"] = {"dtype": "int64", "shape": (1,), "names": None}
    feats["steer.success"] = {"dtype": "bool", "shape": (1,), "names": None}
    return feats


def collect_dataset(cfg: SteerConfig, policy, root: Path, collection: dict) -> None:
    """Stage 1 into the LeRobotDataset ``root``, each setting in turn, written beside it and moved into place
    only when complete (a stopped collection leaves nothing behind)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from sim.factory import make_env
    from vla_core.data import video_backend

    tmp = root.parent / f".{root.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    quiet_datasets()
    dataset = None
    try:
        with interrupt.deferred():
            for k, variation in enumerate(cfg.variations or [cfg.env.variation]):
                setting = replace(cfg, env=replace(cfg.env, variation=variation))
                with make_env(setting.env) as env:
                    if dataset is None:  # its fps: one frame a request, about one every executed chunk
                        per_request = env.control_dt * (cfg.chunking.execute_steps or policy.config.n_action_steps)
                        dataset = LeRobotDataset.create(
                            f"local/steer_{cfg.env.task}", fps=max(1, round(1 / per_request)),
                            features=rollout_features(env, policy), root=tmp,
                            robot_type="panda", use_videos=False, video_backend=video_backend(),
                        )  # fmt: skip
                    collect(setting, policy, env, dataset, setting_index=k)
            dataset.finalize()
        (tmp / "meta" / COLLECTION_FILE).write_text(json.dumps(collection, indent=2))
    except BaseException:
        discard_dataset(dataset, tmp)
        raise
    replace_directory(tmp, root)


def load_rollouts(root: Path) -> dict[str, torch.Tensor]:
    """The ``steer.*`` columns of the rollouts dataset (no images decoded), keyed without the prefix, and each
    frame's ``episode`` (LeRobot's episode index): what stage 2 trains on."""
    names = [k for k in ROLLOUT_FEATURES if k != "steer.chunk"]
    dataset = open_dataset(root)
    table = dataset.hf_dataset.select_columns([*names, "episode_index"]).with_format("torch")[:]
    # Each column to (frames, *its feature's shape): LeRobot stores a shape-(1,) feature as a scalar column.
    data = {name.removeprefix("steer."): table[name].reshape(-1, *dataset.meta.features[name]["shape"])
            for name in names}  # fmt: skip
    for name in ("success", "obs_step", "setting"):  # one value a frame
        data[name] = data[name].reshape(-1)
    data["episode"] = table["episode_index"].reshape(-1)
    return data


def collect(cfg: SteerConfig, policy, env, dataset, setting_index: int = 0) -> None:
    """The rollouts of stage 1 under ``cfg.env`` (``env`` made from it) into ``dataset``: one frame per request
    with its latents and the sampler's end (`record_request`), one LeRobot episode per counted rollout."""
    generator = torch.Generator().manual_seed(cfg.seed)
    frames: dict[int, list[dict]] = {}  # each world's requests in its current episode

    def act(sub: dict, worlds: list[int | None], obs_step: torch.Tensor) -> torch.Tensor:
        chunk, record = record_request(policy, sub, obs_step, generator)
        for j, w in enumerate(worlds):
            if w is not None:
                frames.setdefault(w, []).append(_frame(sub, j, chunk[j], record, int(obs_step[j]), setting_index))
        return chunk

    def ended(w: int, success: bool) -> None:
        # An episode that ended before its first request (a mid observation asked late) has nothing to learn from:
        # counted, not written.
        if frames.get(w):
            for frame in frames[w]:
                dataset.add_frame(frame | {"steer.success": np.array([success])})
            dataset.save_episode()
        frames[w] = []

    run_episodes(cfg, policy, env, act, ended, "collect")


def run_episodes(cfg: SteerConfig, policy, env, act, ended, desc: str) -> None:
    """Each world of ``env`` runs its first ceil(cfg.episodes / N) episodes from seed ``cfg.seed`` through the
    latency model as `vla-rl eval` runs them: ``act(obs, worlds, obs_step)`` gives the chunks (R, H, A) of the R
    worlds asking (``worlds``: each one's index, None for a world done counting, which only holds its place),
    ``ended(world, success)`` hears each counted episode's end. A world counts its first episodes whatever their
    length: keeping the first episodes to end would favour the short ones, and success ends an episode early."""
    from vla_core.runtime.delayed_env import DelayedChunkEnv, step_policy_of

    torch.manual_seed(cfg.seed)
    n = env.num_envs
    delayed = DelayedChunkEnv(env, LatencySpec.of(policy), cfg.chunking, DelayModel(cfg.delay, env.control_dt),
                              step_policy=step_policy_of(policy))  # fmt: skip
    obs, need = delayed.reset(seed=cfg.seed)
    per_world = -(-cfg.episodes // n)
    finished = np.zeros(n, dtype=np.int64)  # episodes each world has ended
    with tqdm(total=per_world * n, desc=desc, unit="ep") as bar:
        while (finished < per_world).any():
            actions = torch.zeros(n, policy.config.horizon, policy.config.action_dim)
            rows = torch.nonzero(need.cpu()).flatten()
            if len(rows):
                sub = {k: [v[i] for i in rows.tolist()] if k == TASK else v[rows.to(v.device)]
                       for k, v in obs.items() if k == TASK or torch.is_tensor(v)}  # fmt: skip
                counted = [w if finished[w] < per_world else None for w in rows.tolist()]
                chunk = act(sub, counted, delayed.obs_step[rows])
                actions = chunk.new_zeros(n, *chunk.shape[1:])
                actions[rows.to(actions.device)] = chunk
            obs, _, terminated, truncated, info, need = delayed.step(ActionChunk(actions, delayed.obs_step))
            for w in torch.nonzero((terminated | truncated).cpu()).flatten().tolist():
                if finished[w] < per_world:
                    ended(w, bool(info["success"][w]))
                    bar.update()
                finished[w] += 1
            interrupt.raise_if_stopped()


def _frame(obs: dict, j: int, chunk: torch.Tensor, record: dict, obs_step: int, setting: int) -> dict:
    """Row ``j`` of a request as a dataset frame (images HWC uint8, as `vla-rl record` writes them)."""
    frame = {k: v[j].permute(1, 2, 0).mul(255).round().to(torch.uint8).cpu().numpy()
             for k, v in obs.items() if k.startswith(OBS_IMAGES + ".")}  # fmt: skip
    frame[OBS_STATE] = obs[OBS_STATE][j].float().cpu().numpy()
    frame["steer.chunk"] = chunk.float().cpu().numpy()
    frame |= {f"steer.{k}": v[j].numpy() for k, v in record.items()}
    frame["steer.obs_step"], frame["steer.setting"] = np.array([obs_step]), np.array([setting])
    frame[TASK] = obs[TASK][j]
    return frame


# -- train ---------------------------------------------------------------------------------------


def decisions(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The requests as the critic's transitions (rows in the rollouts' order, each episode's requests in turn):
    reward (N,) 1 at a successful episode's last request, else 0; done (N,) at each episode's last; next_z (N, L)
    the next request's latents (its own at the last, unread there)."""
    episode = data["episode"]
    done = torch.ones(len(episode), dtype=torch.bool)
    done[:-1] = episode[1:] != episode[:-1]
    next_z = data["z"].clone()
    next_z[:-1] = torch.where(done[:-1, None], data["z"][:-1], data["z"][1:])
    return {"z": data["z"].float(), "x0": data["x0"].float(), "next_z": next_z.float(), "done": done,
            "reward": (done & data["success"].bool()).float()}  # fmt: skip


def train(cfg: SteerConfig, data: dict[str, torch.Tensor], noise_shape: tuple[int, ...], latent_dim: int,
          executed: tuple[int, int]):  # fmt: skip
    """Stage 2 on the collected ``data``: (the `Steering`, its metrics); ``executed``: (the rows of a chunk that run,
    the action's width), the part of x_0 the critic reads."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    torch.manual_seed(cfg.seed + 1)  # the networks' initial weights
    episodes = torch.unique(data["episode"])
    order = episodes[torch.randperm(len(episodes), generator=generator)]
    held = set(order[: max(1, round(len(order) * cfg.held_out_fraction))].tolist())
    is_held = torch.tensor([int(e) in held for e in data["episode"]])
    fail = ~data["success"].bool()
    steering = Steering(noise_shape, latent_dim, cfg.hidden, executed=executed)
    rows = decisions(data)
    train_rows = {k: v[~is_held] for k, v in rows.items()}
    critic = steering.critic  # saved with the steering: it ranks best-of-N candidates
    critic_loss = train_critic(critic, train_rows, cfg.critic_steps, cfg.critic_lr, cfg.batch_size, cfg.gamma,
                               cfg.expectile, generator)  # fmt: skip
    with torch.no_grad():
        advantage = critic.q(train_rows["z"], train_rows["x0"]) - critic.v(train_rows["z"])
    weights = advantage_weights(advantage, cfg.beta)
    flow_loss = train_flow_policy(steering.flow, train_rows["z"], train_rows["x0"], weights, cfg.flow_steps, cfg.lr,
                                  cfg.batch_size, generator)  # fmt: skip
    predictor_loss = train_predictor(steering.predictor, train_rows["z"], fail[~is_held], cfg.predictor_steps, cfg.lr,
                                     cfg.batch_size, generator)  # fmt: skip
    with torch.no_grad():
        held_prob = torch.sigmoid(steering.predictor(rows["z"][is_held]))
    gate = choose_threshold(held_prob, fail[is_held])
    steering.threshold = gate["threshold"]
    first = rows["done"].roll(1)  # each episode's first request (the one after the last's)
    metrics = {
        "requests": len(data["episode"]), "episodes": len(episodes), "held_out_episodes": len(held),
        "episode_success_rate": round(float(data["success"][first].float().mean()), 4),
        "request_success_rate": round(float(data["success"].float().mean()), 4),
        "gate": {**{key: None if v is None else round(v, 4) for key, v in gate.items()},
                 "steered_fraction_held_out": round(float((held_prob > steering.threshold).float().mean()), 4)},
        "critic_loss": {"first": round(critic_loss[0], 5), "last": round(critic_loss[-1], 5)},
        "flow_loss": {"first": round(flow_loss[0], 5), "last": round(flow_loss[-1], 5)},
        "predictor_loss": {"first": round(predictor_loss[0], 5), "last": round(predictor_loss[-1], 5)},
        "advantage_weights": {"mean": round(float(weights.mean()), 4), "max": round(float(weights.max()), 4),
                              "effective_share": round(float(weights.sum() ** 2 / (weights.pow(2).sum() * len(weights))), 4)},
    }  # fmt: skip
    steering.metrics = metrics
    return steering.eval(), metrics


# -- choose the weight ---------------------------------------------------------------------------


def candidates(cfg: SteerConfig) -> list[tuple[float, int]]:
    """The (w, N) pairs stage 3 tries, in the order of its tie-break: the cheapest first (the smallest N, then the
    smallest w); w = 0 with N = 1 is the base and never a candidate."""
    pairs = {(float(w), int(n)) for w in cfg.weights for n in cfg.best_of if w > 0 or n > 1}
    return sorted(pairs, key=lambda pair: (pair[1], pair[0]))


def pair_name(w: float, n: int) -> str:
    """A pair's key in the summary, e.g. ``w=0.5,best_of=8``."""
    return f"w={w:g},best_of={n}"


def choose_weight(cfg: SteerConfig, policy, steering: Steering) -> dict[str, Any]:
    """Stage 3: the episode success of the gated steered policy with each pair of `candidates` on ``choose_episodes``
    episodes per setting from seed ``cfg.seed + 500``; sets ``steering.weight`` and ``steering.best_of`` to the best
    (of equal rates the first in `candidates`' order) and returns {"chosen": w, "best_of": N, "success": {"base":
    rate, `pair_name`: rate}, "base_better"}. ``choose_episodes`` 0: the last pair, unchosen."""
    from sim.factory import make_env

    pairs = candidates(cfg)
    if not cfg.choose_episodes:
        steering.weight, steering.best_of = pairs[-1]
        return {"chosen": steering.weight, "best_of": steering.best_of, "success": {}}
    rates = {}
    steering.to(policy.device)
    for pair in [(0.0, 1), *pairs]:  # (0, 1): the base itself, for the record (never chosen)
        steered = SteeredPolicy(policy, steering, "gated", *pair)
        successes = episodes = 0
        for variation in cfg.variations or [cfg.env.variation]:
            setting = replace(cfg, env=replace(cfg.env, variation=variation), seed=cfg.seed + 500,
                              episodes=cfg.choose_episodes)  # fmt: skip
            with make_env(setting.env) as env:
                outcomes = rollout_outcomes(setting, steered, env)
            successes, episodes = successes + int(outcomes.sum()), episodes + len(outcomes)
        rates[pair] = successes / episodes
    best = max(pairs, key=lambda pair: (rates[pair], -pairs.index(pair)))
    steering.weight, steering.best_of = best
    return {"chosen": best[0], "best_of": best[1],
            "success": {("base" if p == (0.0, 1) else pair_name(*p)): round(r, 4) for p, r in rates.items()},
            "base_better": rates[(0.0, 1)] > rates[best]}  # fmt: skip


@torch.no_grad()
def rollout_outcomes(cfg: SteerConfig, policy, env) -> np.ndarray:
    """(episodes,) bool: the successes of each world's first ceil(cfg.episodes / N) episodes from seed ``cfg.seed``
    (`run_episodes`), in the order they ended."""
    outcomes: list[bool] = []
    run_episodes(cfg, policy, env, lambda sub, worlds, obs_step: policy.predict_chunk(sub, obs_step).actions,
                 lambda w, success: outcomes.append(success), "choose w")  # fmt: skip
    return np.array(outcomes)
