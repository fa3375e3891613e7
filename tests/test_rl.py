"""RL fine-tuning: the algorithms' math against hand-worked values, and `vla-rl finetune` end to end."""

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from policies.denoising_chain import DenoisingChain, ExplorationNoise
from sim.config import EnvConfig
from sim.tasks import TASKS, ReachTask
from vla_core.runtime import ChunkingConfig, DelayConfig
from vla_rl.finetune import FinetuneConfig, finetune
from vla_rl.latency_warmup import LatencyWarmupConfig
from vla_rl.rl.grpo import GRPOConfig, group_advantages, group_seeds
from vla_rl.rl.ppo import PPOConfig, gae
from vla_rl.rl.rollout import Rollout
from vla_rl.rl.update import Anchors, GradientStep, Processes, clipped_surrogate

ROOT = Path(__file__).resolve().parents[1]


def rollout_of(world, episode, reward, discount, done):
    m = len(world)
    return Rollout(
        obs={}, obs_step=torch.zeros(m, dtype=torch.long),
        decision=DenoisingChain(latents=torch.zeros(m, 2, 1, 1), std=torch.ones(1), known=None),
        executed=torch.ones(m, 1, dtype=torch.bool),
        world=torch.tensor(world), episode=torch.tensor(episode), task=torch.zeros(m, dtype=torch.long),
        reward=torch.tensor(reward),
        discount=torch.tensor(discount), steps=torch.ones(m, dtype=torch.long), done=torch.tensor(done),
        truncated=torch.zeros(m, dtype=torch.bool), success=torch.zeros(m, dtype=torch.bool),
        diverged=torch.zeros(m, dtype=torch.bool),
    )  # fmt: skip


def test_gae_discounts_per_control_step_and_stops_at_each_episode_end():
    """World 0: three decisions, the last one ends the episode with reward 1; world 1: one decision.

    With lambda = 0.5, values V = [0.2, 0.4, 0.6 | 0.5], chunk discounts g = [0.9, 0.81, 0.9 | 0.9]:
      delta_2 = 1 - 0.6 = 0.4                     A_2 = 0.4
      delta_1 = 0 + 0.81 * 0.6 - 0.4 = 0.086      A_1 = 0.086 + 0.81 * 0.5 * 0.4 = 0.248
      delta_0 = 0 + 0.9 * 0.4 - 0.2 = 0.16        A_0 = 0.16 + 0.9 * 0.5 * 0.248 = 0.2716
      world 1: delta = 0 - 0.5 = -0.5             A = -0.5 (nothing after its episode's end)
    """
    r = rollout_of([0, 0, 0, 1], [0, 0, 0, 0], [0.0, 0.0, 1.0, 0.0], [0.9, 0.81, 0.9, 0.9], [False, False, True, True])
    values = torch.tensor([0.2, 0.4, 0.6, 0.5])
    advantages, targets = gae(r, values, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([0.2716, 0.248, 0.4, -0.5]))
    torch.testing.assert_close(targets, torch.tensor([0.4716, 0.648, 1.0, 0.0]))


def test_gae_never_reads_across_two_episodes_of_one_world():
    """Episode 0 ends at decision 0 (done): its advantage is r - V, whatever episode 1 holds."""
    r = rollout_of([0, 0], [0, 1], [1.0, 0.0], [0.5, 0.5], [True, True])
    advantages, _ = gae(r, torch.tensor([0.25, 100.0]), lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([0.75, -100.0]))


def test_clipped_surrogate_takes_the_pessimistic_side_of_an_asymmetric_clip():
    """Ratio e^0.5 = 1.649 with A = +1 is cut at 1 + 0.28; ratio e^-0.5 = 0.607 with A = -1 is
    pessimistic at the clip 1 - 0.2 = 0.8 (-0.8 < -0.607); ratio 1 leaves A itself."""
    new = torch.tensor([[0.5], [-0.5], [0.0]])
    old = torch.zeros(3, 1)
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, stats = clipped_surrogate(new, old, adv, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-(1.28 - 0.8 + 2.0) / 3, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    # approx KL: mean of (r - 1) - log r = (e^.5 - 1.5 + e^-.5 - 0.5 + 0) / 3
    assert stats["approx_kl"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 3, abs=1e-6)


def test_group_advantages_normalize_within_each_group_and_drop_uniform_groups():
    """Groups of 4: [1, 0, 0, 1] -> mean 0.5, std 0.5 -> [1, -1, -1, 1]; [1, 1, 1, 1] is dropped by
    dynamic sampling; [1, 0, 0, diverged] -> over the 3 valid: mean 1/3, std sqrt(2)/3."""
    success = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1], dtype=torch.bool)
    group = torch.arange(12) // 4
    valid = torch.ones(12, dtype=torch.bool)
    valid[11] = False
    adv, kept, counts = group_advantages(success, group, valid, dynamic_sampling=True)
    torch.testing.assert_close(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    assert not kept[4:8].any() and counts["groups_dropped"] == 1
    s = math.sqrt(2) / 3
    torch.testing.assert_close(adv[8:11], torch.tensor([2 / 3 / s, -1 / 3 / s, -1 / 3 / s]), atol=1e-5, rtol=0)
    assert kept.tolist() == [True] * 4 + [False] * 4 + [True] * 3 + [False]
    _, kept_all, counts = group_advantages(success, group, valid, dynamic_sampling=False)
    assert kept_all[4:8].all() and counts["groups_dropped"] == 0


def test_group_seeds_are_equal_within_a_group_and_differ_between_groups():
    assert group_seeds(6, 3, 10) == [10, 10, 10, 11, 11, 11]


def test_a_non_finite_loss_or_gradient_leaves_the_weights_as_they_were():
    layer = torch.nn.Linear(2, 1)
    before = [p.detach().clone() for p in layer.parameters()]
    step = GradientStep(torch.optim.SGD(layer.parameters(), lr=0.1), max_grad_norm=1.0)
    assert not step(layer(torch.ones(1, 2)).sum() * float("nan"))
    # a finite loss (0) whose gradient is not: d/dw sqrt(0 * |w|) = inf * 0 = NaN
    assert not step(torch.sqrt(layer.weight.abs() * 0).sum())
    assert step.skipped == 2
    for p, q in zip(layer.parameters(), before, strict=True):
        torch.testing.assert_close(p, q)
    assert step(layer(torch.ones(1, 2)).sum())  # a finite one goes through
    assert not torch.equal(layer.weight, before[0])


def _settings(minibatch_size: int, factors: slice = slice(None)):
    """One epoch of one minibatch (the ratio is 1, nothing is clipped), the default clips."""
    from vla_rl.rl.update import UpdateSettings

    return UpdateSettings(
        epochs=1, minibatch_size=minibatch_size, clip_low=0.2, clip_high=0.28, factors=factors, pcgrad=False,
        max_grad_norm=0.0, lr=1e-4, head_lr=1e-4, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip


def test_a_grpo_step_raises_the_log_prob_of_the_chains_that_succeeded(tiny_checkpoint):
    """One plain gradient step (SGD, one minibatch, so the ratio is 1 and nothing is clipped) moves
    the weights along the gradient of mean_ik r_ik A_i, so to first order sum_i A_i * (change in
    log pi(chain_i)) > 0: the chains of the episodes marked successful become likelier, the others
    less likely. Real rollouts of the tiny policy; success marked by hand (worlds 0 and 2 of groups
    {0, 1} and {2, 3})."""
    from sim.factory import make_env
    from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
    from vla_core.runtime.delayed_env import DelayedChunkEnv
    from vla_rl.checkpoint import load_policy
    from vla_rl.rl import grpo
    from vla_rl.rl.rollout import collect
    from vla_rl.rl.update import batched_score

    policy, _ = load_policy(tiny_checkpoint[0])
    actor = policy.rl_actor(FinetuneConfig().noise)
    with make_env(EnvConfig(num_envs=4, max_episode_steps=8)) as env:
        denv = DelayedChunkEnv(env, LatencySpec.of(policy), ChunkingConfig(execute_steps=4), DelayModel(DelayConfig()))
        rollout, _ = collect(actor, denv, episodes_per_world=1, seed=grpo.group_seeds(4, 2, 0))
    # No lift succeeds in 8 steps: each world's episode ends at the time limit, truncated, with its last decision.
    assert not rollout.success.any() and not rollout.diverged.any()
    assert rollout.truncated.equal(rollout.done) and int(rollout.truncated.sum()) == 4
    rollout.success = rollout.world % 2 == 0
    before = batched_score(actor, rollout, 64)
    step = GradientStep(torch.optim.SGD(policy.parameters(), lr=1e-4), max_grad_norm=0)
    stats = grpo.update(actor, rollout, Anchors(before), cfg=GRPOConfig(group_size=2), actor_step=step,
                        settings=_settings(len(rollout)))  # fmt: skip
    assert stats["groups_dropped"] == 0 and stats["decisions"] == len(rollout)
    change = (batched_score(actor, rollout, 64).values - before.values).sum(1)  # (M,)
    advantage = torch.where(rollout.success, 1.0, -1.0)  # each group: one success, one failure
    assert (advantage * change).sum() > 0
    assert change[rollout.success].mean() > change[~rollout.success].mean()


def test_training_only_the_last_denoising_steps_follows_only_their_gradient(tiny_checkpoint):
    """GRPO with the loss on the last 2 of K denoising steps, one SGD step on one minibatch (ratio 1,
    nothing clipped): the loss is -mean_{i, k >= K-2} A_i r_ik, so the weights move by
    lr / (M * 2) * sum_i A_i * grad(log pi_{i,K-2} + log pi_{i,K-1}), worked out here from the
    policy's per-step log-probabilities (the final step's over the rows that ran). All K steps would move
    them elsewhere."""
    from sim.factory import make_env
    from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
    from vla_core.runtime.delayed_env import DelayedChunkEnv
    from vla_rl.checkpoint import load_policy
    from vla_rl.rl import grpo
    from vla_rl.rl.rollout import collect
    from vla_rl.rl.update import batched_score

    policy, _ = load_policy(tiny_checkpoint[0])
    actor = policy.rl_actor(FinetuneConfig().noise)
    k_total = policy.config.num_inference_steps
    last = slice(k_total - 2, k_total)
    with make_env(EnvConfig(num_envs=4, max_episode_steps=6)) as env:
        denv = DelayedChunkEnv(env, LatencySpec.of(policy), ChunkingConfig(execute_steps=4), DelayModel(DelayConfig()))
        rollout, _ = collect(actor, denv, episodes_per_world=1, seed=grpo.group_seeds(4, 2, 0))
    rollout.success = rollout.world % 2 == 0
    advantage = torch.where(rollout.success, 1.0, -1.0)  # group-normalized: one success, one failure per group
    params = [p for p in policy.parameters() if p.requires_grad]

    def gradient_of(steps: slice) -> list[torch.Tensor]:
        chain = rollout.decision.with_executed(rollout.executed)
        per_step = policy.log_prob(rollout.obs, chain, per_step=True)[:, steps]
        objective = (advantage[:, None] * per_step).sum() / per_step.numel()
        return torch.autograd.grad(objective, params, allow_unused=True)

    expected, everything = gradient_of(last), gradient_of(slice(None))
    before = [p.detach().clone() for p in params]
    lr = 1e-3
    step = GradientStep(torch.optim.SGD(params, lr=lr), max_grad_norm=0)
    old = batched_score(actor, rollout, 64).columns(last)
    grpo.update(actor, rollout, Anchors(old), cfg=GRPOConfig(group_size=2), actor_step=step,
                settings=_settings(len(rollout), factors=last))  # fmt: skip
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before, strict=True)])
    want = torch.cat(
        [(lr * g).flatten() if g is not None else torch.zeros(p.numel()) for g, p in zip(expected, params)]
    )
    every = torch.cat(
        [(lr * g).flatten() if g is not None else torch.zeros(p.numel()) for g, p in zip(everything, params)]
    )
    rounding = 4 * torch.cat([b.flatten() for b in before]).abs().clamp_min(1e-3) * torch.finfo(torch.float32).eps
    assert ((moved - want).abs() <= 1e-4 * want.abs() + rounding).all()  # float32 weights: a few ulp each
    assert ((moved - every).abs() > rounding).sum() > 0.1 * len(moved)  # the other steps' gradient differs


def test_the_curriculum_favours_unsolved_and_changing_tasks_and_resumes_its_draws():
    """Tasks a, b. a succeeds once (1.0): both averages 1, priority 0 + 0 + 0.05; b unseen counts as
    unsolved, 1 + 0 + 0.05. Then a fails (0.0): fast 1 + 0.5 (0 - 1) = 0.5, slow 1 + 0.1 (0 - 1) =
    0.9, priority 0.5 + 2 * 0.4 + 0.05 = 1.35."""
    from vla_rl.rl.curriculum import TaskCurriculum

    cur = TaskCurriculum(["a", "b"], seed=3)
    cur.update(0, 1.0)
    torch.testing.assert_close(cur.priorities(), torch.tensor([0.05, 1.05]) / 1.1)
    cur.update(0, 0.0)
    torch.testing.assert_close(cur.priorities(), torch.tensor([1.35, 1.05]) / 2.4)
    saved = cur.state_dict()
    draws = [cur.choose(1) for _ in range(20)]
    assert {d[0] for d in draws} == {0, 1}
    again = TaskCurriculum(["a", "b"], seed=99)
    again.load_state_dict(saved)
    assert [again.choose(1) for _ in range(20)] == draws
    assert cur.choose(2) == [0, 1]  # all of them: nothing to draw


# -- the command --------------------------------------------------------------------------------


def small_run(checkpoint, out, **overrides) -> FinetuneConfig:
    fields = {
        "checkpoint": str(checkpoint), "env": EnvConfig(num_envs=4, max_episode_steps=12), "iterations": 2,
        "update_epochs": 1, "minibatch_size": 16, "eval_every": 0, "output_dir": str(out), "num_threads": 2, "log_with": "none",
    }  # fmt: skip
    fields.update(overrides)
    return FinetuneConfig(**fields)


@dataclass
class EasyReach(ReachTask):
    """Reach with a 15 cm success radius: the tiny policy's GRPO groups then differ in outcome."""

    success_distance: float = 0.15


# Two of three tasks per iteration: the curriculum draws, and PCGrad has two tasks to project.
MULTITASK = {"tasks": ["lift", "reach", "push"], "curriculum_tasks": 2, "pcgrad": True}


@pytest.fixture(scope="module")
def tiny_suite_checkpoint(tmp_path_factory):
    """A diffusion policy trained for a few steps on two demonstrations of each of the three tasks."""
    from vla_rl.record import RecordConfig, record
    from vla_rl.train import DatasetConfig, TrainConfig, train

    root = tmp_path_factory.mktemp("suite")
    record(RecordConfig(env=EnvConfig(num_envs=2), tasks=MULTITASK["tasks"], num_episodes=2,
                        output_dir=str(root / "data"), seed=3))  # fmt: skip
    train(TrainConfig(dataset=DatasetConfig(root=str(root / "data")), output_dir=str(root / "train"), steps=10,
                      batch_size=8, save_every=10, log_with="none", num_threads=2, warmup_steps=2))  # fmt: skip
    return root / "train"


@pytest.mark.parametrize(
    ("algo", "multitask", "warmed"), [("ppo", False, False), ("grpo", False, False), ("ppo", True, False),
                                      ("ppo", False, True)],
)  # fmt: skip
def test_a_resumed_run_reaches_the_same_weights_as_an_uninterrupted_one(
    tiny_checkpoint, tiny_suite_checkpoint, tiny_dataset, tmp_path, monkeypatch, algo, multitask, warmed
):
    """Two iterations straight, against one iteration, stop, and --resume=true for the second:
    the same weights (the rollout seeds, sampling noise, minibatch order, optimizer state and, with
    several tasks, the curriculum and PCGrad's stream all continue). The checkpoint it stops at is
    what a kill after a checkpoint leaves. ``warmed``: a latency-aware run whose head was warmed up
    on demonstrations, with a KL term, so the resumed run must take its KL reference from the
    warmed policy (the imitation checkpoint has no head). GRPO learns only from groups whose
    episodes differ, which a policy this small never succeeds at on a real task, so its run reaches
    a ball 15 cm away (not 2 cm): its groups differ, its refills find more, and its weights move."""
    checkpoint = tiny_suite_checkpoint if multitask or algo == "grpo" else tiny_checkpoint[0]
    extra = {"algo": algo, **(MULTITASK if multitask else {})}
    if algo == "grpo":  # each algorithm gets only its own settings: the other's would be refused
        monkeypatch.setitem(TASKS, "reach", EasyReach)
        extra |= {"grpo": GRPOConfig(group_size=2), "env": EnvConfig(task="reach", num_envs=4, max_episode_steps=12)}
    else:
        extra["ppo"] = PPOConfig(critic_warmup_iterations=0, episodes_per_world=1, kl_coef=0.5 if warmed else 0.0)
    if warmed:
        extra |= {"latency_aware": True, "delay": DelayConfig(kind="fixed", steps=2),
                  "latency_warmup": LatencyWarmupConfig(steps=10, dataset=str(tiny_dataset[0]), batch_size=8)}  # fmt: skip
    straight = finetune(small_run(checkpoint, tmp_path / "straight", **extra))
    finetune(small_run(checkpoint, tmp_path / "resumed", iterations=1, **extra))
    resumed = finetune(small_run(checkpoint, tmp_path / "resumed", resume=True, **extra))
    assert straight["iterations"] == resumed["iterations"] == 2
    assert straight["env_steps"] == resumed["env_steps"]
    if multitask:  # the curriculum rolled out one task per iteration, and chose the same ones again
        chosen = [list(h["rollout_success_by_task"]) for h in straight["history"]]
        assert [len(c) for c in chosen] == [2, 2]
        assert chosen == [list(h["rollout_success_by_task"]) for h in resumed["history"]]
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "straight/checkpoints/last/pretrained_model/model.safetensors"))
    b = load_file(str(tmp_path / "resumed/checkpoints/last/pretrained_model/model.safetensors"))
    initial = load_file(str(checkpoint / "checkpoints/last/pretrained_model/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert any(not torch.equal(a[k], initial[k]) for k in a)  # the run did learn something
    if algo == "grpo":  # from informative groups, found by refilling
        assert all(h["groups"] > h["groups_dropped"] and h["refills"] > 0 for h in straight["history"])


def test_a_run_saved_before_the_executed_rows_credit_resumes_and_says_from_when(tiny_checkpoint, tmp_path, capsys):
    """A run whose state carries no credit marker scored every row and credited from request to request; it
    resumes with one line saying that its updates from that iteration on use today's estimator, and its state
    records the iteration. A marked run resumes silently."""
    from vla_rl.rl.checkpointing import CREDIT, STATE_FILE

    extra = {"ppo": PPOConfig(critic_warmup_iterations=0, episodes_per_world=1)}
    finetune(small_run(tiny_checkpoint[0], tmp_path / "old", iterations=1, **extra))
    state_file = next((tmp_path / "old" / "checkpoints").glob(f"step-*/training_state/{STATE_FILE}"))
    saved = torch.load(state_file, weights_only=False)
    assert saved["credit"] == CREDIT == "executed_rows"
    del saved["credit"]
    torch.save(saved, state_file)
    capsys.readouterr()
    summary = finetune(small_run(tiny_checkpoint[0], tmp_path / "old", iterations=2, resume=True, **extra))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "from iteration 1 on it scores only the rows that ran" in notes[0]
    assert summary["iterations"] == 2 and summary["executed_rows_credit_from"] == 1
    finetune(small_run(tiny_checkpoint[0], tmp_path / "old", iterations=3, resume=True, **extra))
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]


@pytest.mark.parametrize("latency_aware", [False, True], ids=["plain", "latency-aware"])
def test_a_finetuned_checkpoint_loads_in_eval_and_its_summary_has_the_curve(tiny_checkpoint, tmp_path, latency_aware):
    """The latency-aware run adds its fast head and fine-tunes under a 3-step delay; eval rebuilds the
    head from the checkpoint and feeds it the mid-inference observation, as finetune did."""
    from vla_core.runtime import DelayConfig
    from vla_rl.eval import EvalConfig, evaluate

    out = tmp_path / "ft"
    delay = DelayConfig(kind="fixed", steps=3) if latency_aware else DelayConfig()
    run = small_run(tiny_checkpoint[0], out, eval_every=1, eval_episodes=4, latency_aware=latency_aware, delay=delay,
                    ppo=PPOConfig(critic_warmup_iterations=1))  # fmt: skip
    summary = finetune(run)
    assert [e["iteration"] for e in summary["evals"]] == [0, 1, 2]
    assert all(e["episodes"] == 4 for e in summary["evals"])
    saved = json.loads((out / "finetune_summary.json").read_text())
    assert saved["history"][-1]["env_steps"] == summary["env_steps"] > 0
    # Throughput: executed steps over each iteration's wall-clock (rollout + update), and overall.
    for h in saved["history"]:
        assert h["iteration_seconds"] >= h["rollout_seconds"] + h["update_seconds"] - 0.002
        assert h["env_steps_per_s"] == pytest.approx(h["executed_env_steps"] / h["iteration_seconds"], rel=0.01)
    assert sum(h["executed_env_steps"] for h in saved["history"]) == summary["env_steps"]
    assert (out / "success.png").stat().st_size > 0
    env = EnvConfig(num_envs=4, max_episode_steps=12)
    result = evaluate(EvalConfig(checkpoint=str(out), env=env, num_episodes=4, delay=delay,
                                 video_episodes=0, output_dir=str(tmp_path / "eval")))  # fmt: skip
    # eval's result of the last checkpoint equals finetune's own evaluation of those weights, episode
    # by episode, and those are not the imitation policy's weights
    own = json.loads((out / "eval" / "iter-0002" / "eval.json").read_text())
    strip = lambda episodes: [(e["seed"], e["world"], e["success"], e["length"]) for e in episodes]
    assert strip(result["per_episode"]) == strip(own["per_episode"])
    from safetensors.torch import load_file

    tuned = load_file(str(out / "checkpoints/last/pretrained_model/model.safetensors"))
    initial = load_file(str(tiny_checkpoint[0] / "checkpoints/last/pretrained_model/model.safetensors"))
    assert any(not torch.equal(tuned[k], initial[k]) for k in tuned if k in initial)
    head = sorted(k for k in tuned if k.startswith("latency_head."))
    assert bool(head) == latency_aware and set(tuned) - set(head) == set(initial)
    if latency_aware:  # the head's last layer left zero: it learned something from the rollouts
        assert tuned["latency_head.mlp.4.weight"].abs().max() > 0
        config = json.loads((out / "checkpoints/last/pretrained_model/config.json").read_text())
        assert (config["latency_aware"], config["latency_max_delay"], config["mid_cameras"]) == (True, 3, ["front"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"chunking": ChunkingConfig(merge="ensemble")}, "fine-tune with --chunking.merge=latest"),
        ({"algo": "grpo", "grpo": GRPOConfig(group_size=3)}, "set --env.num_envs to a multiple of 3"),
        ({"algo": "sac"}, "choose --algo=ppo or --algo=grpo"),
        ({"pcgrad": True}, "give --tasks=[a,b,...]"),
        ({"tasks": ["lift", "reach"], "curriculum_tasks": 3}, "--curriculum_tasks must be in [0, 2]"),
        ({"tasks": ["lift", "reach"], "curriculum_tasks": 1, "pcgrad": True}, "set --curriculum_tasks=0 or >= 2"),
        ({"eval_every": 1, "eval_episodes": 0}, "--eval_episodes >= 1 when evaluating"),
        ({"env": EnvConfig(num_envs=4, cameras=[])}, "set --env.cameras=[front]"),
        ({"tasks": ["lift", "reach"]}, "the policy was not trained on 'reach'"),
        ({"env": EnvConfig(num_envs=4, image_size=32)}, "set --env.image_size=64"),
        ({"train_last_steps": 99}, "is more than the policy's"),
        ({"train_last_steps": -1}, "--train_last_steps=-1 must be >= 0"),
        ({"noise": ExplorationNoise(eta=0.0, min_std=0.1, temperature=0.5)}, "drop --noise.temperature"),
        ({"latency_aware": True, "mid_fraction": 1.0}, "--mid_fraction=1.0 must be in [0, 1)"),
        ({"latency_aware": True, "latency_warmup": LatencyWarmupConfig(steps=5)}, "--latency_warmup.dataset=<"),
        ({"latency_warmup": LatencyWarmupConfig(steps=5, dataset="d")}, "add --latency_aware=true"),
        ({"latency_aware": True, "latency_warmup": LatencyWarmupConfig(steps=-1)}, "--latency_warmup.steps=-1 must"),
        # The other algorithm's settings would do nothing.
        (
            {"algo": "grpo", "grpo": GRPOConfig(group_size=2), "ppo": PPOConfig(kl_coef=0.5)},
            "--ppo.kl_coef does nothing under --algo=grpo; drop the --ppo.* flags (kl_coef) or set --algo=ppo",
        ),
        ({"grpo": GRPOConfig(group_size=2)}, "--grpo.group_size does nothing under --algo=ppo"),
    ],
)
def test_bad_config_gets_one_line_naming_the_fix(tiny_checkpoint, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        finetune(small_run(tiny_checkpoint[0], tmp_path / "bad", **overrides))
    assert not (tmp_path / "bad").exists()  # refused before any output


def test_a_latency_aware_checkpoint_refuses_the_flags_it_would_ignore(tiny_checkpoint, tmp_path):
    """A checkpoint with a fast head acts and trains latency-aware whatever the flags say, at the mid point
    it was built for: asking for a plain run, or another mid point, is refused before any output."""
    from vla_rl.checkpoint import load_policy

    policy, _ = load_policy(tiny_checkpoint[0])
    policy.add_latency_head(3, 0.5, ["front"])
    policy.save_pretrained(tmp_path / "aware")
    delay = DelayConfig(kind="fixed", steps=3)
    for overrides, message in [
        ({}, "the checkpoint is latency-aware (it has a fast head); fine-tune it with --latency_aware=true"),
        ({"latency_aware": True, "mid_fraction": 0.25}, "--mid_fraction=0.25 does nothing: the checkpoint's fast head"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            finetune(small_run(tmp_path / "aware", tmp_path / "bad", delay=delay, **overrides))
        assert not (tmp_path / "bad").exists()


def test_a_warmed_up_fast_head_starts_the_run_and_leaves_the_imitation_weights_alone(
    tiny_checkpoint, tiny_dataset, tmp_path
):
    """--latency_warmup fits the head on the demonstrations first: the run starts from (and its first
    evaluation scores) that policy, saved in the run, whose other weights are the imitation checkpoint's."""
    from safetensors.torch import load_file

    from vla_rl.checkpoint import resolve_checkpoint

    out = tmp_path / "warm"
    warm = LatencyWarmupConfig(steps=20, dataset=str(tiny_dataset[0]), batch_size=8)
    finetune(small_run(tiny_checkpoint[0], out, iterations=1, eval_every=1, eval_episodes=2, latency_aware=True,
                       delay=DelayConfig(kind="fixed", steps=2), latency_warmup=warm))  # fmt: skip
    warmed_dir = out / "latency_warmup" / "last" / "pretrained_model"
    warmed = load_file(str(warmed_dir / "model.safetensors"))
    initial = load_file(str(tiny_checkpoint[0] / "checkpoints/last/pretrained_model/model.safetensors"))
    assert all(torch.equal(warmed[k], initial[k]) for k in initial)
    assert warmed["latency_head.mlp.4.weight"].abs().max() > 0  # it left zero on the demonstrations alone
    assert Path((out / "initial_checkpoint.txt").read_text()) == (out / "latency_warmup").resolve()
    first_eval = json.loads((out / "eval" / "iter-0000" / "eval.json").read_text())
    assert resolve_checkpoint(first_eval["checkpoint"]) == warmed_dir.parent.resolve()
    meta = json.loads((out / "latency_warmup" / "last" / "metadata.json").read_text())["latency_warmup"]
    assert meta["steps"] == 20 and meta["dataset"] == str(tiny_dataset[0])


def test_a_warm_up_dataset_recorded_at_another_rate_is_refused(tiny_checkpoint, tiny_dataset, tmp_path):
    warm = LatencyWarmupConfig(steps=5, dataset=str(tiny_dataset[0]))
    run = small_run(tiny_checkpoint[0], tmp_path / "bad", latency_aware=True, latency_warmup=warm,
                    delay=DelayConfig(kind="fixed", steps=2), env=EnvConfig(num_envs=4, substeps=50))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("record the dataset at the env's rate")):
        finetune(run)
    assert not (tmp_path / "bad" / "latency_warmup").exists()


@pytest.mark.slow  # trains and fine-tunes end to end: about 30 s
def test_quick_benchmark_runs_every_stage_and_prints_the_final_line(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rl_finetune.py"), "--quick=true", f"--output_dir={out}"],
        check=False, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.match(r"^ppo_gain=[+-]\d+\.\d grpo_gain=[+-]\d+\.\d env_steps=\d+ minutes=\d+\.\d$", last), last
    report = json.loads((out / "quick" / "rl.json").read_text())
    for algo in ("ppo", "grpo"):
        assert report["runs"][algo]["env_steps"] >= 200  # the budget was spent, then the run stopped
        assert report["results"][algo]["episodes"] == 4
        points = 100 * (report["results"][algo]["success_rate"] - report["results"]["imitation"]["success_rate"])
        assert report["gains_points"][algo] == pytest.approx(points, abs=0.05)


@pytest.mark.slow
def test_quick_benchmark_of_the_autoregressive_vla_adds_the_process_reward_arm(tmp_path):
    """`bench rl --policy_type=autoregressive_vla --process_reward=true` at toy sizes: the token policy in its own
    folder, a process reward model fitted on the benchmark's demonstrations, and a third arm whose PPO run
    read it; the final line appends its gain."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rl_finetune.py"), "--quick=true", f"--output_dir={out}",
         "--policy_type=autoregressive_vla", "--process_reward=true"],
        check=False, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.match(
        r"^ppo_gain=[+-]\d+\.\d grpo_gain=[+-]\d+\.\d env_steps=\d+ minutes=\d+\.\d prm_gain=[+-]\d+\.\d$", last
    )
    run = out / "quick" / "autoregressive_vla"
    report = json.loads((run / "rl.json").read_text())
    saved = json.loads((run / "imitation" / "checkpoints" / "last" / "pretrained_model" / "config.json").read_text())
    assert saved["type"] == "vla_rl_autoregressive_vla"
    summary = json.loads((run / "ppo_prm" / "finetune_summary.json").read_text())
    assert summary["process_reward"]["model"] == str(run / "prm") and (run / "prm" / "prm_summary.json").is_file()
    assert report["runs"]["ppo_prm"]["env_steps"] >= 200 and "process_reward" not in json.loads(
        (run / "ppo" / "finetune_summary.json").read_text())  # fmt: skip
    points = 100 * (report["results"]["ppo_prm"]["success_rate"] - report["results"]["imitation"]["success_rate"])
    assert report["gains_points"]["ppo_prm"] == pytest.approx(points, abs=0.05)


def test_pcgrad_projects_a_conflicting_pair_onto_each_others_normal_plane():
    """g1 = (1, 0), g2 = (-1, 1): g1 . g2 = -1 < 0, so
    g1' = g1 - (-1 / 2) g2 = (0.5, 0.5) and g2' = g2 - (-1 / 1) g1 = (0, 1);
    each is orthogonal to the other's original, and the update is their sum (0.5, 1.5)."""
    from vla_rl.rl.pcgrad import pcgrad

    g1, g2 = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])
    torch.testing.assert_close(pcgrad([g1, g2]), torch.tensor([0.5, 1.5]))


def test_pcgrad_leaves_a_pair_that_does_not_conflict_untouched():
    from vla_rl.rl.pcgrad import pcgrad

    g1, g2 = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 1.0, 0.0])  # g1 . g2 = 1 > 0
    torch.testing.assert_close(pcgrad([g1, g2]), g1 + g2, rtol=0, atol=0)


def test_pcgrad_gradients_round_trip_through_the_parameters():
    from vla_rl.rl.pcgrad import flat_grad, set_flat_grad

    layer = torch.nn.Linear(3, 2)
    params = list(layer.parameters())
    flat = flat_grad((layer.weight * torch.arange(6.0).view(2, 3)).sum(), params)
    torch.testing.assert_close(flat, torch.cat([torch.arange(6.0), torch.zeros(2)]))  # bias unused: zeros
    set_flat_grad(params, flat * 2)
    torch.testing.assert_close(layer.weight.grad, 2 * torch.arange(6.0).view(2, 3))


class ThreadedProcesses(Processes):
    """Process ``index`` of ``count``, each a thread of this test: the collectives meet at a barrier."""

    def __init__(self, index: int, count: int, hub: dict):
        self.accelerator, self.index, self.count, self.hub = None, index, count, hub

    def reduce(self, tensor, op):
        slots, barrier = self.hub["slots"], self.hub["barrier"]
        slots[self.index] = tensor.clone()
        barrier.wait()
        stacked = torch.stack(slots)
        out = stacked.sum(0) if op == "sum" else stacked.max(0).values
        barrier.wait()  # nobody writes the next round's slot before everyone read this one
        return out


def in_processes(count: int, work) -> list:
    """``work(processes)`` in ``count`` threads, each one process of a data-parallel run; their results."""
    import threading

    hub = {"slots": [None] * count, "barrier": threading.Barrier(count, timeout=30)}
    results, errors = [None] * count, []

    def run(i):
        try:
            results[i] = work(ThreadedProcesses(i, count, hub))
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's own thread
            errors.append(err)
            hub["barrier"].abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_each_process_cuts_only_its_own_rows_into_every_minibatch():
    """Two processes holding 5 and 3 rows, minibatches of 4: K = ceil(8 / 4) = 2 minibatches in both;
    process 0 takes pieces of ceil(4 * 5 / 8) = 3 rows (3, then 2), process 1 of ceil(4 * 3 / 8) = 2 (2,
    then 1), so the minibatches hold 5 and 3 rows. Each process's pieces are a permutation of its own
    rows, and its generator ends where the other's does. One process: pieces of 4, 4 as before."""

    def epoch(processes):
        g = torch.Generator().manual_seed(0)
        count = (5, 3)[processes.index]
        pieces = [(rows.tolist(), total) for rows, total in processes.minibatches(count, 4, g)]
        return pieces, g.get_state()

    (p0, g0), (p1, g1) = in_processes(2, epoch)
    assert [len(r) for r, _ in p0] == [3, 2] and [len(r) for r, _ in p1] == [2, 1]
    assert [t for _, t in p0] == [t for _, t in p1] == [5, 3]
    assert sorted(i for r, _ in p0 for i in r) == [0, 1, 2, 3, 4] and sorted(i for r, _ in p1 for i in r) == [0, 1, 2]
    assert torch.equal(g0, g1)
    # Four processes of 5 rows, minibatches of 5: K = 4, pieces of ceil(5 * 5 / 20) = 2, so 2, 2, 1, 0 rows
    # each; the fourth minibatch is empty everywhere and not taken (no optimizer step on nothing).
    totals = in_processes(4, lambda p: [t for _, t in p.minibatches(5, 5, torch.Generator().manual_seed(0))])
    assert totals == [[8, 8, 4]] * 4
    one = list(Processes().minibatches(8, 4, torch.Generator().manual_seed(0)))
    assert [len(r) for r, _ in one] == [4, 4] and sorted(torch.cat([r for r, _ in one]).tolist()) == list(range(8))


def _sharded_and_whole(algo: str, pcgrad: bool, split: int):
    """``algo``'s update on a 4-world rollout in one process, and on worlds [:split] and [split:] in two;
    one minibatch per epoch, so both take the gradient of the same whole-batch loss. Returns the
    parameters after (one process, then each of the two)."""
    from vla_core.rl import FactorLogProb
    from vla_rl.rl import grpo, ppo
    from vla_rl.rl.update import UpdateSettings

    x, reward, tasks = torch.tensor([1.0, 2.0, -1.0, 0.5]), [1.0, 0.0, 1.0, 0.0], torch.tensor([0, 1, 0, 1])

    def part(worlds):
        r = rollout_of(list(range(len(worlds))), [0] * len(worlds), [reward[w] for w in worlds], [0.9] * len(worlds),
                       [True] * len(worlds))  # fmt: skip
        r.obs, r.decision = {"observation.state": torch.zeros(len(worlds), 1)}, _Draws(x[worlds])
        r.task, r.success = tasks[worlds], torch.tensor([reward[w] > 0 for w in worlds])
        return r

    def run(rollout, processes):
        actor, critic = _LinearActor(0.3), _ConstantValue()
        settings = UpdateSettings(epochs=2, minibatch_size=8, clip_low=0.2, clip_high=0.28, factors=slice(None),
                                  pcgrad=pcgrad, max_grad_norm=0, lr=0.1, head_lr=0.1,
                                  generator=torch.Generator())  # fmt: skip
        old = Anchors(FactorLogProb(0.3 * rollout.decision.x[:, None]))
        step = GradientStep(torch.optim.SGD(actor.module.parameters(), lr=0.1), 0, processes=processes)
        if algo == "ppo":
            critic_step = GradientStep(torch.optim.SGD(critic.parameters(), lr=0.5), 0, processes=processes)
            ppo.update(actor, critic, rollout, old, None, cfg=PPOConfig(kl_coef=0.0), settings=settings,
                       actor_step=step, critic_step=critic_step, train_actor=True, max_episode_steps=10,
                       processes=processes)  # fmt: skip
        else:
            grpo.update(actor, rollout, old, cfg=GRPOConfig(group_size=2, dynamic_sampling=False), settings=settings,
                        actor_step=step, processes=processes)  # fmt: skip
        return actor.module.theta.item(), critic.b.item()

    if algo == "grpo":  # groups of 2 worlds: each process holds whole groups
        assert split % 2 == 0
    whole = run(Rollout.cat([part([0, 1, 2, 3])], 4), Processes())
    halves = [list(range(split)), list(range(split, 4))]
    return whole, in_processes(2, lambda processes: run(part(halves[processes.index]), processes))


@pytest.mark.parametrize("algo, pcgrad, split", [("ppo", False, 3), ("ppo", True, 1), ("grpo", False, 2),
                                                 ("grpo", True, 2)])  # fmt: skip
def test_processes_updating_on_their_own_rollouts_take_the_whole_batchs_step(algo, pcgrad, split):
    """Two processes, each with only its own worlds (3 and 1, or 2 and 2), end with the weights one
    process reaches on all four: advantages normalized over both (PPO), each row's loss weighted by its
    share of the minibatch, each task's by its share of the task (PCGrad), gradients summed. The actor
    does move (theta leaves 0.3), so equal weights are not equal starting points."""
    whole, (first, second) = _sharded_and_whole(algo, pcgrad, split)
    assert abs(whole[0] - 0.3) > 1e-3
    assert first == pytest.approx(whole, abs=1e-6) and second == pytest.approx(whole, abs=1e-6)


def test_two_processes_update_on_their_own_rollouts_and_stay_identical(tiny_checkpoint, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo): each rolls out its own 2 worlds and updates on
    them; an update counts the decisions of both, and both processes end each update with the same
    weights (their checksums, gathered after every update, are equal) which did change."""
    out = tmp_path / "dp"
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
        "--mixed_precision=no", "--dynamo_backend=no", "-m", "vla_rl.cli", "finetune",
        f"--checkpoint={tiny_checkpoint[0]}", "--env.num_envs=2", "--env.max_episode_steps=8", "--iterations=2",
        "--update_epochs=1", "--minibatch_size=8", "--eval_every=0", "--log_with=none", "--num_threads=1",
        "--ppo.critic_warmup_iterations=0", "--ppo.episodes_per_world=1", f"--output_dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(launch, check=False, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((out / "finetune_summary.json").read_text())["history"]
    assert len(history) == 2
    for h in history:
        first, second = h["decisions_per_process"]
        assert first > 0 and second > 0 and h["decisions"] == first + second  # no world diverged here
        assert len(set(h["weights_checksum_per_process"])) == 1
    assert history[0]["weights_checksum_per_process"] != history[1]["weights_checksum_per_process"]


# -- ppo.update against hand-worked numbers (a one-parameter actor and a constant critic) -------------


class _Draws:
    """A decision kind of one number per decision (the `vla_core.rl.Decision` protocol)."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def select(self, rows):
        return _Draws(self.x[rows])

    def to(self, device):
        return self

    @staticmethod
    def cat(parts):
        return _Draws(torch.cat([p.x for p in parts]))


class _LinearActor:
    """log pi(decision x) = theta * x, one factor; value features a constant 0."""

    def __init__(self, theta: float):
        from vla_core.rl import FactorLogProb

        self.module = torch.nn.Module()
        self.module.theta = torch.nn.Parameter(torch.tensor(theta))
        self.policy, self.num_factors, self.value_dim, self.device = self.module, 1, 1, torch.device("cpu")
        self._factor = FactorLogProb

    def score(self, obs, decision, executed=None):
        return self._factor((self.module.theta * decision.x)[:, None])

    def value_features(self, obs):
        return torch.zeros(len(obs["observation.state"]), 1)


class _ConstantValue(torch.nn.Module):
    """V(s) = b for every state."""

    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, features, progress, obs=None):
        return self.b.expand(len(features))


def _two_world_rollout(x=(1.0, 2.0)) -> Rollout:
    """Two worlds, one decision each that ends its episode, rewards 1 and 0."""
    r = rollout_of([0, 1], [0, 0], [1.0, 0.0], [0.9, 0.9], [True, True])
    r.obs = {"observation.state": torch.zeros(2, 1)}
    r.decision = _Draws(torch.tensor(x))
    return r


def test_ppo_value_loss_is_clipped_around_the_old_values():
    """V = b, b_old = 0; targets G = R = [1, 0] (one decision each, done). Epoch 1 at b = 0: loss
    0.5 * mean(1, 0) = 0.25, gradient mean(b - G) = -0.5, SGD lr 1 -> b = 0.5. Epoch 2, value_clip 0.1:
    unclipped (0.5 - G)^2 = [0.25, 0.25], clipped (0.1 - G)^2 = [0.81, 0.01], max [0.81, 0.25]: loss
    0.265; the first row's max is the clipped term, flat in b, so the gradient is 0.5 * (0.5 - 0) = 0.25
    -> b = 0.25 (unclipped, the gradient would be mean(0.5 - G) = 0 and b would stay 0.5)."""
    from vla_core.rl import FactorLogProb
    from vla_rl.rl import ppo
    from vla_rl.rl.update import UpdateSettings

    for value_clip, b_after, loss in [(0.1, 0.25, (0.25 + 0.265) / 2), (0.0, 0.5, (0.25 + 0.125) / 2)]:
        actor, critic = _LinearActor(0.5), _ConstantValue()
        settings = UpdateSettings(epochs=2, minibatch_size=2, clip_low=0.2, clip_high=0.28, factors=slice(None),
                                  pcgrad=False, max_grad_norm=0, lr=1, head_lr=1, generator=torch.Generator())  # fmt: skip
        stats = ppo.update(
            actor, critic, _two_world_rollout(), Anchors(FactorLogProb(torch.zeros(2, 1))), None,
            cfg=PPOConfig(value_clip=value_clip), settings=settings,
            actor_step=GradientStep(torch.optim.SGD(actor.module.parameters(), lr=1), 0),
            critic_step=GradientStep(torch.optim.SGD(critic.parameters(), lr=1), 0),
            train_actor=False, max_episode_steps=10,
        )  # fmt: skip
        assert critic.b.item() == pytest.approx(b_after) and stats["value_loss"] == pytest.approx(loss)
        assert stats["advantage_mean"] == pytest.approx(0.5) and stats["value_mean"] == 0.0


def test_ppo_actor_step_normalizes_advantages_and_pulls_toward_the_reference():
    """log pi = theta x with x = [1, 2], theta = theta_old = 0.5, reference theta 0; A = R - V = [1, 0],
    normalized [1, -1]. The ratio is 1: surrogate 0, its gradient -mean(A_n x) = 0.5. KL(pi || ref), k3
    on d = ref - new = [-0.5, -1]: mean(e^d - 1 - d) = mean(0.106531, 0.367879) = 0.237205, gradient
    mean(-(e^d - 1) x) = mean(0.393469, 1.264241) = 0.828855. kl_coef 0.5: loss 0.118603, gradient
    0.5 + 0.414428 = 0.914428; SGD lr 0.1 -> theta = 0.5 - 0.0914428."""
    from vla_core.rl import FactorLogProb
    from vla_rl.rl import ppo
    from vla_rl.rl.update import UpdateSettings

    actor, critic = _LinearActor(0.5), _ConstantValue()
    old = FactorLogProb(torch.tensor([[0.5], [1.0]]))
    reference = FactorLogProb(torch.zeros(2, 1))
    settings = UpdateSettings(epochs=1, minibatch_size=2, clip_low=0.2, clip_high=0.28, factors=slice(None),
                              pcgrad=False, max_grad_norm=0, lr=0.1, head_lr=0.1, generator=torch.Generator())  # fmt: skip
    stats = ppo.update(
        actor, critic, _two_world_rollout(), Anchors(old), reference, cfg=PPOConfig(kl_coef=0.5), settings=settings,
        actor_step=GradientStep(torch.optim.SGD(actor.module.parameters(), lr=0.1), 0),
        critic_step=GradientStep(torch.optim.SGD(critic.parameters(), lr=0.0), 0), train_actor=True,
        max_episode_steps=10,
    )  # fmt: skip
    assert stats["kl_to_imitation"] == pytest.approx(0.237205, abs=1e-6)
    assert stats["policy_loss"] == pytest.approx(0.5 * 0.237205, abs=1e-6)
    assert stats["clip_fraction"] == 0.0 and stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert actor.module.theta.item() == pytest.approx(0.5 - 0.0914428, abs=1e-6)


def test_the_kl_and_the_per_task_losses_by_hand():
    """k3 KL of new = [0, 0] to reference [log 2, 0]: mean(2 - 1 - log 2, 0) = 0.153426. PCGrad's per-task
    losses at ratio 1 for tasks [0, 0, 1], advantages [1, 3, -2]: each task's own mean, -mean(1, 3) = -2
    and -(-2) = 2. A data-parallel process holding only row 0 adds its share of task 0, -1 * 1/2; the
    other, holding rows 1 and 2, adds -3 * 1/2 and 2: summed across processes, each task's mean again."""
    from vla_rl.rl.update import actor_loss, actor_loss_per_task, kl_to_reference

    kl = kl_to_reference(torch.zeros(2, 1), torch.tensor([[math.log(2)], [0.0]]))
    assert kl.item() == pytest.approx(0.153426, abs=1e-6)
    tasks, adv, zero = torch.tensor([0, 0, 1]), torch.tensor([1.0, 3.0, -2.0]), torch.zeros(3, 1)
    rows = torch.tensor([2, 1])  # the minibatch's rows of task 0 and task 1
    assert [t.item() for t in actor_loss_per_task(tasks, rows, zero, zero, adv, 0.2, 0.28)] == [-2.0, 2.0]
    first = actor_loss_per_task(tasks[:1], rows, zero[:1], zero[:1], adv[:1], 0.2, 0.28)
    second = actor_loss_per_task(tasks[1:], rows, zero[1:], zero[1:], adv[1:], 0.2, 0.28)
    assert first[0].item() == -0.5 and first[1] is None
    assert (second[0].item(), second[1].item()) == (-1.5, 2.0)
    # A factor a decision lacks (mask False) is left out of every mean: as if its row had one factor.
    mask = torch.tensor([[True, False]] * 3)
    assert actor_loss(torch.zeros(3, 2), torch.zeros(3, 2), adv, 0.2, 0.28, mask=mask)[0].item() == pytest.approx(
        -2 / 3
    )


def test_the_value_head_sees_the_committed_actions():
    """Two states that differ only in the actions already committed (a plain policy: it reads the
    augmentation nowhere): its condition, all a value head read before, is the same for both, so a head
    fitted to give them the values 0 and 1 gives both 0.5. The actor built for the run's 3-wide
    augmentation adds it to the value features, and the same head then tells them apart."""
    from tiny_policies import TASK, make_policy

    from policies.denoising_chain import ExplorationNoise
    from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_DELAY_STEPS
    from vla_rl.rl.ppo import ValueHead

    policy = make_policy("diffusion")
    g = torch.Generator().manual_seed(0)
    state = {"observation.images.front": torch.rand(1, 3, 16, 16, generator=g).expand(2, -1, -1, -1),
             "observation.state": torch.randn(1, 3, generator=g).expand(2, -1), "task": [TASK] * 2}  # fmt: skip
    committed = torch.zeros(2, 3, 2)
    committed[1, :2] = torch.tensor([[1.5, 0.8], [1.5, 0.8]])  # the second state's arm is about to move
    obs = {**state, OBS_COMMITTED_ACTIONS: committed, OBS_COMMITTED_MASK: torch.tensor([[True, True, False]] * 2),
           OBS_DELAY_STEPS: torch.tensor([2, 2])}  # fmt: skip
    noise = ExplorationNoise(eta=0.0, min_std=0.1)
    target = torch.tensor([0.0, 1.0])

    def fitted_values(actor) -> torch.Tensor:
        with torch.no_grad():
            features = actor.value_features(obs)
        assert features.shape == (2, actor.value_dim)
        torch.manual_seed(0)
        head = ValueHead(actor.value_dim, 16)
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(300):
            loss = ((head(features, torch.zeros(2)) - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return head(features, torch.zeros(2)).detach()

    blind = fitted_values(policy.rl_actor(noise))
    assert blind[0] == blind[1] and abs(float(blind[0]) - 0.5) < 0.05  # one value for both
    seeing = fitted_values(policy.rl_actor(noise, augmentation_width=3))
    assert (seeing - target).abs().max() < 0.05


# -- stale rollouts: decoupled PPO with truncated importance weights --------------------------------------


def test_a_stale_rollout_is_weighed_against_the_proximal_policy_and_truncated():
    """log pi = theta x, theta = 0.5, x = [1, 2]: the proximal policy scores [0.5, 1]. The weights that
    sampled the rollout scored [-0.5, 1.5], so log(pi_prox / pi_behaviour) = [1, -0.5], weights
    [e, e^-0.5] = [2.718, 0.607], truncated at rho_bar 1: [1, 0.607]. Staleness, apart from the update's
    own statistics: k3 KL = mean(e - 1 - 1, e^-0.5 - 1 + 0.5) = mean(0.718282, 0.106531), one factor of
    two truncated. At r = 1 with advantages [1, -1] the loss is -mean(1 * 1, 0.607 * -1) = -0.196735."""
    from vla_core.rl import FactorLogProb
    from vla_rl.rl.update import actor_loss, anchors

    actor, rollout = _LinearActor(0.5), _two_world_rollout()
    rollout.behaviour_log_prob = FactorLogProb(torch.tensor([[-0.5], [1.5]]))
    a = anchors(actor, rollout, _settings(2), rho_bar=1.0)
    assert a.proximal.values.flatten().tolist() == [0.5, 1.0]
    assert a.weight.flatten().tolist() == pytest.approx([1.0, math.exp(-0.5)])
    assert a.decision_ratio.tolist() == pytest.approx([1.0, math.exp(-0.5)])
    assert a.stats["staleness_kl"] == pytest.approx((0.718282 + 0.106531) / 2, abs=1e-6)
    assert a.stats["staleness_truncated"] == 0.5
    adv = torch.tensor([1.0, -1.0])
    loss, stats = actor_loss(a.proximal.values, a.proximal.values, adv, 0.2, 0.28, weight=a.weight)
    assert loss.item() == pytest.approx(-(1 - math.exp(-0.5)) / 2, abs=1e-6) and stats["approx_kl"] == 0.0
    assert anchors(actor, _two_world_rollout(), _settings(2)).weight is None  # on-policy: no weights at all


def test_a_negative_advantage_on_a_stale_sample_is_bounded():
    """The failure of taking ratios against the behaviour policy: a sample whose probability rose 20-fold
    (e^3) since it was drawn, with A = -1, gives min(20 A, 1.28 A) = -20: the loss weighs it 20 times.
    Against the proximal policy (r = 1) with the weight truncated at 1 it weighs 1."""
    from vla_rl.rl.update import clipped_surrogate

    now, behaviour, adv = torch.tensor([[3.0]]), torch.tensor([[0.0]]), torch.tensor([-1.0])
    assert clipped_surrogate(now, behaviour, adv, 0.2, 0.28)[0].item() == pytest.approx(math.exp(3))
    weight = (now - behaviour).exp().clamp(max=1.0)
    assert clipped_surrogate(now, now, adv, 0.2, 0.28, weight=weight)[0].item() == pytest.approx(1.0)


def test_gae_traces_a_stale_episode_with_truncated_weights():
    """One world, two decisions, V = 0.5 everywhere, rewards [0, 1], done at the second, g = 0.9, lambda
    0.5, weights rho = c = [0.5, 1]. A_1 = 1 * (1 - 0.5) = 0.5; delta_0 = 0 + 0.9 * 0.5 - 0.5 = -0.05,
    A_0 = 0.5 * -0.05 + 0.9 * 0.5 * 0.5 * 0.5 = 0.0875 (on-policy GAE: -0.05 + 0.225 = 0.175)."""
    r = rollout_of([0, 0], [0, 0], [0.0, 1.0], [0.9, 0.9], [False, True])
    values = torch.tensor([0.5, 0.5])
    advantages, returns = gae(r, values, 0.5, torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(advantages, torch.tensor([0.0875, 0.5]))
    torch.testing.assert_close(returns, advantages + values)
    torch.testing.assert_close(gae(r, values, 0.5)[0], torch.tensor([0.175, 0.5]))
    assert torch.equal(gae(r, values, 0.5, torch.ones(2))[0], gae(r, values, 0.5)[0])  # weights 1: GAE exactly


def test_grpo_refills_until_the_batch_holds_informative_groups(monkeypatch):
    """DAPO's dynamic sampling, with a stand-in for the rollout: 4 worlds in groups of 2, so a batch asks
    for 2 informative groups. The first rollout's groups both succeed or both fail; the first refill
    finds one mixed group (its group 0), the second another (its group 1): the batch keeps those two,
    numbered as one batch, and counts the env steps of all three rollouts. Refills draw from seeds of
    their own."""
    from vla_rl.rl import sources
    from vla_rl.rl.curriculum import TaskCurriculum
    from vla_rl.rl.rollout import RolloutStats
    from vla_rl.rl.update import Processes

    outcomes = iter([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    seeds = []

    def fake_collect(actor, shell, *, episodes_per_world, seed, task, gamma, privileged):
        assert not privileged  # GRPO has no critic to read the privileged state
        seeds.append(seed)
        success = torch.tensor(next(outcomes), dtype=torch.bool)
        r = rollout_of([0, 1, 2, 3], [0, 0, 0, 0], success.float().tolist(), [1.0] * 4, [True] * 4)
        r.success, r.obs_step = success, torch.arange(4) + 10 * len(seeds)  # tells the rollouts apart
        return r, RolloutStats(episodes=4, successes=int(success.sum()), diverged=0, env_steps=10, simulated_steps=12,
                               seconds=1.0)  # fmt: skip

    monkeypatch.setattr(sources, "collect", fake_collect)
    cfg = FinetuneConfig(algo="grpo", env=EnvConfig(num_envs=4), grpo=GRPOConfig(group_size=2, max_refills=2))
    local = sources.LocalRollouts(None, [None], cfg, 1.0, TaskCurriculum(["lift"]), Processes())
    batch = local.next(0)
    r = batch.rollout
    assert r.world.tolist() == [0, 1, 2, 3] and r.success.tolist() == [True, False, True, False]
    assert r.obs_step.tolist() == [20, 21, 32, 33]  # the first refill's group 0, the second's group 1
    assert batch.info == {"refills": 2}
    assert (batch.stats[0].episodes, batch.stats[0].env_steps, batch.stats[0].simulated_steps) == (12, 30, 36)
    base = cfg.seed + sources.REFILL_SEED_OFFSET
    assert seeds[0][0] == cfg.seed + sources.TRAINING_SEED_OFFSET and seeds[1] == [base, base, base + 1, base + 1]
    assert seeds[2][0] == base + 4  # the second refill of run 0
    # A first rollout with enough informative groups is taken as it is.
    outcomes = iter([[1, 0, 0, 1]])
    batch = local.next(1)
    assert batch.info == {"refills": 0} and batch.rollout.success.tolist() == [True, False, False, True]


# -- the asymmetric critic ------------------------------------------------------------------------------


def test_explained_variance_by_hand():
    """values (1, 2, 3), returns (1, 2, 4): Var(G) = 14/9, Var(G - V) = 2/9, so 1 - 1/7."""
    from vla_rl.rl.ppo import explained_variance

    assert explained_variance(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0])) == pytest.approx(6 / 7)
    assert math.isnan(explained_variance(torch.zeros(3), torch.ones(3)))


def test_a_rollout_records_the_privileged_state_at_each_decision_for_the_critic_only(tiny_checkpoint):
    """The track task's privileged state is the ball's centre and velocity (names in order: target, target_vel),
    then the end effector: 9 numbers a world. A rollout's first decision of each world is made at the reset, so
    it records exactly what the env reports after a reset with the same seed; the actor never reads the key."""
    from sim.factory import make_env
    from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencySpec
    from vla_core.runtime.delayed_env import DelayedChunkEnv
    from vla_core.types import OBS_PRIVILEGED
    from vla_rl.checkpoint import load_policy
    from vla_rl.rl.ppo import ValueHead
    from vla_rl.rl.rollout import collect, privileged_features

    policy, _ = load_policy(tiny_checkpoint[0])
    actor = policy.rl_actor(FinetuneConfig().noise)
    with make_env(EnvConfig(task="track", num_envs=3, max_episode_steps=8, cameras=list(policy.config.cameras),
                            image_size=policy.config.image_size)) as env:  # fmt: skip
        env.reset(seed=11)
        state, ee = env.privileged_state(), env.ee_positions()
        expected = torch.from_numpy(np.concatenate([state["target"], state["target_vel"], ee], 1)).float()
        torch.testing.assert_close(privileged_features(env), expected)
        shell = DelayedChunkEnv(env, LatencySpec.of(policy), ChunkingConfig(execute_steps=4), DelayModel(DelayConfig()))
        rollout, _ = collect(actor, shell, episodes_per_world=1, seed=11, privileged=True)
    first = rollout.obs_step == 0
    torch.testing.assert_close(rollout.obs[OBS_PRIVILEGED][first], expected[rollout.world[first]])
    critic = ValueHead(actor.value_dim, 16, privileged_dim=9)
    features, progress = torch.zeros(2, actor.value_dim), torch.zeros(2)
    moved = {OBS_PRIVILEGED: expected[:2] + torch.tensor([0.1] + [0.0] * 8)}
    assert not torch.allclose(
        critic(features, progress, {OBS_PRIVILEGED: expected[:2]}), critic(features, progress, moved)
    )
    with pytest.raises(ValueError, match="reads observation.privileged"):
        critic(features, progress, {})


def test_a_privileged_critic_run_records_its_explained_variance_and_resumes_only_with_the_flag(
    tiny_checkpoint, tmp_path
):
    extra = {"ppo": PPOConfig(critic_warmup_iterations=0, episodes_per_world=1, privileged_critic=True),
             "env": EnvConfig(num_envs=4, max_episode_steps=12)}  # fmt: skip
    summary = finetune(small_run(tiny_checkpoint[0], tmp_path / "run", iterations=1, **extra))
    assert math.isfinite(summary["history"][0]["explained_variance"])  # its value: test_explained_variance_by_hand
    plain = {**extra, "ppo": PPOConfig(critic_warmup_iterations=0, episodes_per_world=1)}
    with pytest.raises(ValueError, match=r"was fine-tuned with --ppo.privileged_critic=true; resume it with"):
        finetune(small_run(tiny_checkpoint[0], tmp_path / "run", resume=True, **plain))
    assert finetune(small_run(tiny_checkpoint[0], tmp_path / "run", resume=True, **extra))["iterations"] == 2
