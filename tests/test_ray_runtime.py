"""Asynchronous rollouts on Ray: two real rollout actors on CPU, the version bookkeeping, the staleness bound,
the overlap of collection with updates, the behaviour log-probs the correction reads, and dead workers."""

import json
import re
import signal
import time

import pytest
import torch
from extras import require

from sim.config import EnvConfig
from vla_rl.finetune import FinetuneConfig, finetune
from vla_rl.rl.grpo import GRPOConfig
from vla_rl.rl.ray_runtime import AsyncRollouts, RayConfig, check_capacity, check_reachable, usable

ray = require("ray", "ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (starting one takes seconds), shut down at the end, with the
    signal handlers ray.init replaced given back."""
    from vla_core import interrupt

    with interrupt.kept():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(checkpoint, out, max_staleness, iterations=4):
    return finetune(FinetuneConfig(
        checkpoint=str(checkpoint), env=EnvConfig(num_envs=2, max_episode_steps=8), iterations=iterations,
        update_epochs=1, minibatch_size=16, eval_every=0, output_dir=str(out), num_threads=1, log_with="none",
        runtime="ray", ray=RayConfig(num_workers=2, max_staleness=max_staleness),
    ))  # fmt: skip


def test_starting_ray_keeps_the_commands_stop_handling():
    """ray.init installs a SIGTERM handler of its own and leaves it; a run's SIGTERM must still reach the
    command's handler (`vla_core.interrupt`: checkpoint, then exit 128 + 15). Runs before the module's
    shared instance exists."""
    from vla_rl.rl.ray_runtime import connect

    def command_handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, command_handler)
    try:
        assert connect(RayConfig(num_workers=1)) and ray.is_initialized()
        assert signal.getsignal(signal.SIGTERM) is command_handler
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, previous)


def test_the_staleness_bound_counts_updates_between_sampling_and_learning():
    assert usable(5, 5, 0) and not usable(5, 4, 0)
    assert usable(5, 4, 1) and not usable(5, 3, 1)


def test_two_actors_collect_while_the_learner_updates_within_the_staleness_bound(tiny_checkpoint, tmp_path, local_ray):
    """max_staleness = 1: update i (the learner at version i - 1) takes the rollouts of both workers,
    none older than version i - 2, and the workers pick up the published weights as they go."""
    summary = _run(tiny_checkpoint[0], tmp_path / "async", max_staleness=1)
    history = summary["history"]
    assert [h["policy_version"] for h in history] == [0, 1, 2, 3]  # one version per update
    for h in history:
        assert h["policy_version"] - 1 <= h["data_version_min"] <= h["data_version_max"] <= h["policy_version"]
        assert h["episodes"] >= 2 * 2 * 2  # both workers' 2 worlds, 2 episodes each (dropped rollouts counted too)
    assert history[-1]["data_version_max"] >= 1  # rollouts of published weights arrived
    # Collection overlapped the updates: some rollout of version v was being collected while the
    # update that makes v + 1 ran (on the same clock: one machine).
    timeline = json.loads((tmp_path / "async" / "ray_timeline.json").read_text())
    updates = {u["version"]: u for u in timeline["updates"]}
    assert sorted(updates) == [0, 1, 2, 3] and timeline["nodes"] == 1 and timeline["lost_rollouts"] == []
    overlapping = [r for r in timeline["rollouts"] if r["version"] in updates
                   and r["started"] < updates[r["version"]]["ended"] and r["ended"] > updates[r["version"]]["started"]]  # fmt: skip
    assert overlapping, timeline
    assert all(r["cpu_seconds"] > 0 for r in timeline["rollouts"])


def test_with_no_staleness_allowed_every_rollout_is_on_policy(tiny_checkpoint, tmp_path, local_ray):
    history = _run(tiny_checkpoint[0], tmp_path / "sync", max_staleness=0, iterations=3)["history"]
    assert [(h["policy_version"], h["data_version_min"], h["data_version_max"]) for h in history] == [
        (0, 0, 0), (1, 1, 1), (2, 2, 2)
    ]  # fmt: skip
    assert all(h["dropped_rollouts"] == 0 for h in history)
    # Synchronous: no rollout of version v is collected while the update that makes v + 1 runs.
    timeline = json.loads((tmp_path / "sync" / "ray_timeline.json").read_text())
    for u in timeline["updates"]:
        assert all(r["ended"] <= u["started"] or r["started"] >= u["ended"] for r in timeline["rollouts"])


def test_an_unreachable_cluster_is_named_before_anything_starts(tiny_checkpoint, tmp_path):
    cfg = FinetuneConfig(checkpoint=str(tiny_checkpoint[0]), output_dir=str(tmp_path / "x"), runtime="ray",
                         ray=RayConfig(address="127.0.0.1:1"))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("cannot reach the Ray cluster at --ray.address=127.0.0.1:1")):
        finetune(cfg)
    assert not (tmp_path / "x").exists()


def _workers(checkpoint, tmp_path, **ray_fields) -> tuple:
    """The learner's policy and an `AsyncRollouts` of two workers with two worlds, as finetune builds them."""
    from vla_rl.checkpoint import load_policy

    cfg = FinetuneConfig(checkpoint=str(checkpoint), env=EnvConfig(num_envs=2, max_episode_steps=8),
                         output_dir=str(tmp_path), runtime="ray", ray=RayConfig(num_workers=2, **ray_fields))  # fmt: skip
    policy = load_policy(checkpoint)[0].eval()
    return policy, cfg, AsyncRollouts(policy, cfg, gamma=0.99, version=0, seeds=lambda k: (100 + 10 * k, 1, k))


def test_the_behaviour_log_probs_are_the_sampling_weights_and_the_correction_reads_them(
    tiny_checkpoint, tmp_path, local_ray
):
    """Version 0's rollouts carry the log-probs of version 0's weights (re-scored here); after the learner
    publishes perturbed weights, the correction's weight of a version-0 row is min(pi_new / pi_0, rho_bar)
    with pi_0 those carried log-probs, worked out here from two independent scorings."""
    from vla_rl.rl.update import UpdateSettings, anchors, batched_score

    policy, cfg, workers = _workers(tiny_checkpoint[0], tmp_path)
    try:
        actor = policy.rl_actor(cfg.noise, augmentation_width=0)
        batch, _, info = workers.next_batch()
        assert (info["data_version_min"], info["data_version_max"]) == (0, 0)
        version0 = batched_score(actor, batch, 64)
        torch.testing.assert_close(batch.behaviour_log_prob.values, version0.values, rtol=0, atol=1e-4)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01 * torch.randn_like(p))
        workers.publish(policy)
        batch, _, _ = workers.next_batch()  # the rollouts in flight were launched with version 0
        new = batched_score(actor, batch, 64).values
        settings = UpdateSettings(epochs=1, minibatch_size=16, clip_low=0.2, clip_high=0.2, factors=slice(None),
                                  pcgrad=False, max_grad_norm=1.0, lr=1e-4, head_lr=1e-4,
                                  generator=torch.Generator(), seed=0, rho_bar=1.0)  # fmt: skip
        weight = anchors(actor, batch, settings, rho_bar=1.0).weight
        stale = batch.version == 0
        assert stale.any()
        expected = (new - batch.behaviour_log_prob.values).exp().clamp(max=1.0)
        torch.testing.assert_close(weight, expected)
        assert (weight[stale] < 1).any()  # the perturbation moved the policy: some stale samples count less
    finally:
        workers.close()


@pytest.mark.slow  # kills and restarts Ray actors (10+ s each): -m slow
def test_a_worker_that_dies_is_restarted_and_its_rollout_collected_again(tiny_checkpoint, tmp_path, local_ray):
    """Worker 0 is killed as by a crash while its first rollout (launch 0) is in flight: the launch is
    collected again with its seeds by the next free worker, none is lost, Ray restarts worker 0 and it
    hands in rollouts again."""
    import ray

    _, _, workers = _workers(tiny_checkpoint[0], tmp_path, max_restarts=1)
    try:
        ray.kill(workers.workers[0], no_restart=False)
        restarts = 0
        for _ in range(200):  # worker 1 hands in more rollouts while worker 0 restarts (seconds)
            batch, stats, info = workers.next_batch()
            restarts += info["worker_restarts"]
            assert len(stats) == 2 and sorted(batch.world.unique().tolist()) == [0, 1, 2, 3]
            if restarts and 0 in {r["worker"] for r in workers.timeline["rollouts"]}:
                break
        launches = [r["launch"] for r in workers.timeline["rollouts"]]
        assert restarts == 1 and {d["launch"] for d in workers.timeline["interrupted"]} == {0}
        assert 0 in launches and len(launches) == len(set(launches))  # launch 0 handed in once, after all
        assert workers.lost() == [] and workers.alive == [True, True]
    finally:
        workers.close()


@pytest.mark.slow  # kills and restarts Ray actors (10+ s each): -m slow
def test_a_worker_killed_between_rollouts_counts_as_restarted(tiny_checkpoint, tmp_path, local_ray):
    """Worker 0 dies after finishing its rollout and is back before its next is launched (as while the
    learner updates): nothing is interrupted, its next rollout runs in the new process, that restart is
    counted, and that rollout is labelled with the weights the new process really holds."""
    import ray

    policy, _, workers = _workers(tiny_checkpoint[0], tmp_path, max_restarts=1)
    try:
        workers.next_batch()  # both relaunched with version 0's weights, which they hold
        workers.publish(policy)  # version 1 (the same numbers; what matters is the label)
        workers.next_batch()  # both relaunched with version 1's weights, sent to them
        ray.wait(list(workers.in_flight), num_returns=2)  # both done, none launched after them
        ray.kill(workers.workers[0], no_restart=False)
        for _ in range(600):  # the restart is over before the next launch: nothing fails, nothing is probed
            try:
                if ray.get(workers.workers[0].ready.remote())["pid"] != workers.processes[0][1]:
                    break
            except ray.exceptions.RayActorError:
                time.sleep(0.1)
        restarts = 0
        for _ in range(200):
            _, _, info = workers.next_batch()
            restarts += info["worker_restarts"]
            if restarts:
                break
        assert restarts == 1 and workers.lost() == [] and workers.alive == [True, True]
        assert workers.timeline["interrupted"] == []
        pids = [r["pid"] for r in workers.timeline["rollouts"] if r["worker"] == 0]
        assert len(set(pids)) == 2 and workers.timeline["restarts"][0]["pid"] == pids[-1]
        # Its first rollout in the new process was launched without weights (the learner thought it held
        # version 1); it sampled with the weights it was built with, and says so. Its next launch sends them.
        after = [r for r in workers.timeline["rollouts"] if r["worker"] == 0 and r["pid"] == pids[-1]]
        assert after[0]["version"] == 0 and workers.worker_version[0] == 1
    finally:
        workers.close()


def test_a_worker_that_cannot_start_ends_the_run_with_one_line(tiny_checkpoint, tmp_path, local_ray):
    with pytest.raises(ValueError, match=r"^a rollout worker failed to start: .*unknown task 'nowhere'.*install"):
        from vla_rl.checkpoint import load_policy

        cfg = FinetuneConfig(checkpoint=str(tiny_checkpoint[0]), env=EnvConfig(task="nowhere", num_envs=2),
                             runtime="ray", ray=RayConfig(num_workers=1))  # fmt: skip
        AsyncRollouts(load_policy(tiny_checkpoint[0])[0], cfg, gamma=0.99, version=0, seeds=lambda k: (k, 1, k))
    import ray

    assert ray.is_initialized() and not ray.util.list_named_actors()  # nothing left running


def test_addresses_and_capacity_are_checked_with_the_fix_named():
    check_reachable("auto")  # left to ray.init, which finds the cluster or says it found none
    with pytest.raises(ValueError, match=re.escape("--ray.address=ray://127.0.0.1:1 (") + ".*`ray start --head`"):
        check_reachable("ray://127.0.0.1:1")
    check_capacity(RayConfig(num_workers=2, worker_cpus=1.5), {"CPU": 3.0})
    with pytest.raises(
        ValueError, match=re.escape("has 2 CPUs but --ray.num_workers=2 workers of --ray.worker_cpus=1.5 need 3")
    ):
        check_capacity(RayConfig(num_workers=2, worker_cpus=1.5), {"CPU": 2.0})
    with pytest.raises(ValueError, match=re.escape("has 0 GPUs but")):
        check_capacity(RayConfig(num_workers=1, worker_gpus=1), {"CPU": 2.0})


def test_ray_refuses_what_it_does_not_run():
    with pytest.raises(ValueError, match=re.escape("--runtime=ray rolls out one task")):
        FinetuneConfig(runtime="ray", tasks=["lift", "reach"]).validate()
    with pytest.raises(ValueError, match="--ray.num_workers must be >= 1"):
        FinetuneConfig(runtime="ray", ray=RayConfig(num_workers=0)).validate()
    # Settings that would be ignored: GRPO's refills under Ray (it only drops), Ray's under the local runtime.
    with pytest.raises(ValueError, match=re.escape("--runtime=ray does not refill GRPO batches")):
        FinetuneConfig(runtime="ray", algo="grpo").validate()
    FinetuneConfig(runtime="ray", algo="grpo", grpo=GRPOConfig(max_refills=0)).validate()
    with pytest.raises(ValueError, match=re.escape("--ray.worker_cpus does nothing under --runtime=local")):
        FinetuneConfig(ray=RayConfig(worker_cpus=2)).validate()


class _Ref:
    """A fake ObjectRef: its answer (or error), and when it is done."""

    def __init__(self, answer=None, error=None):
        self.answer, self.error, self.done = answer, error, False


class _FakeRay:
    """The calls `AsyncRollouts` makes of Ray, with completions decided by the test (a ref's ``done``)."""

    class exceptions:  # mirrors ray.exceptions
        RayActorError = ray.exceptions.RayActorError
        ActorUnavailableError = ray.exceptions.ActorUnavailableError

    def wait(self, refs, num_returns=1, timeout=None):
        done = [r for r in refs if r.done]
        assert done, "the batch waits for something the test never finishes"
        return done[:1], []

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.answer

    def put(self, value):
        return value


class _FakeWorker:
    def __init__(self, index, calls):
        self.index, self.calls = index, calls
        self.collect = type("M", (), {"remote": lambda _, *args: self._call("collect", args)})()
        self.ready = type("M", (), {"remote": lambda _, *args: self._call("ready", args)})()

    def _call(self, kind, args):
        ref = _Ref()
        self.calls.append((self.index, kind, args, ref))
        return ref


def test_synchronous_a_free_worker_collects_an_interrupted_launch(monkeypatch):
    """max_staleness = 0, two workers, Ray faked so the order of events is the test's:
    worker 1 fails mid-rollout (restarting) while worker 0 still collects; when worker 0 hands in, it takes
    the interrupted launch at once (before: it waited for the update while the batch could not fill)."""
    from types import SimpleNamespace

    from vla_rl.rl import ray_runtime

    monkeypatch.setattr(ray_runtime, "Rollout", SimpleNamespace(cat=lambda parts, n: SimpleNamespace(version=torch.cat([p.version for p in parts]))))  # fmt: skip
    calls = []
    rollouts = object.__new__(AsyncRollouts)
    rollouts.ray, rollouts.cfg, rollouts.num_envs = _FakeRay(), RayConfig(num_workers=2, max_staleness=0), 2
    rollouts.seeds = lambda launch: (launch, 1, launch)
    rollouts.workers = [_FakeWorker(0, calls), _FakeWorker(1, calls)]
    rollouts.placement = [{"node": "n", "pid": 10}, {"node": "n", "pid": 11}]
    rollouts.initial_version = rollouts.version = 0
    rollouts.worker_version, rollouts.alive = [0, 0], [True, True]
    rollouts.probes, rollouts.probe_due, rollouts.processes = {}, [], [("n", 10), ("n", 11)]
    rollouts.weights, rollouts.launches, rollouts.in_flight, rollouts.idle, rollouts.orphans = None, 0, {}, [], []
    rollouts.timeline, rollouts.update_started = {"rollouts": [], "updates": [], "interrupted": [], "restarts": []}, 0.0
    rollouts._launch(0)
    rollouts._launch(1)

    def answer(pid, version):
        stats = SimpleNamespace(env_steps=4, episodes=1, successes=0)
        timing = {"node": "n", "pid": pid, "started": 0.0, "ended": 1.0, "cpu_seconds": 0.5}
        return SimpleNamespace(version=torch.tensor([version])), stats, timing

    (_, _, _, ref0), (_, _, _, ref1) = calls
    ref1.error, ref1.done = ray.exceptions.ActorUnavailableError("restarting", None), True  # worker 1 fails first
    original_wait = rollouts.ray.wait

    def wait(refs, num_returns=1, timeout=None):
        if not ref0.done and not any(r.done for r in refs):  # then worker 0 hands in launch 0
            ref0.answer, ref0.done = answer(10, 0), True
        relaunch = [c for c in calls[2:] if c[1] == "collect"]
        for _, _, _, ref in relaunch:  # whatever it was given next finishes too
            if not ref.done:
                ref.answer, ref.done = answer(10, 0), True
        return original_wait(refs, num_returns, timeout)

    rollouts.ray.wait = wait
    _, stats, _ = rollouts.next_batch()
    launches = [r["launch"] for r in rollouts.timeline["rollouts"]]
    assert sorted(launches) == [0, 1] and len(stats) == 2  # launch 1, interrupted on worker 1, came from worker 0
    assert [c[0] for c in calls if c[1] == "collect"] == [0, 1, 0] and rollouts.lost() == []


@pytest.mark.slow
def test_two_learner_processes_each_update_on_their_own_ray_workers(tiny_checkpoint, tmp_path):
    """`accelerate launch` with 2 learner processes (gloo) on one Ray cluster started by `ray start`: each
    process has its own worker, whose rollouts only it updates on (no images cross processes), and both
    end every update with the same, changing weights. Each worker's rollouts start from their own seeds."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from vla_rl.bench_ray import LocalCluster

    out = tmp_path / "dp_ray"
    with LocalCluster(nodes=1, cpus_per_node=2, log_dir=tmp_path / "cluster") as cluster:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": f"127.0.0.1:{cluster.port}"}
        launch = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
            "--mixed_precision=no", "--dynamo_backend=no", "-m", "vla_rl.cli", "finetune",
            f"--checkpoint={tiny_checkpoint[0]}", "--env.num_envs=2", "--env.max_episode_steps=8", "--iterations=2",
            "--update_epochs=1", "--minibatch_size=8", "--eval_every=0", "--log_with=none", "--num_threads=1",
            "--ppo.critic_warmup_iterations=0", "--ppo.episodes_per_world=1", "--runtime=ray", "--ray.address=auto",
            "--ray.num_workers=1", "--ray.max_staleness=0", f"--output_dir={out}",
        ]  # fmt: skip
        proc = subprocess.run(launch, check=False, capture_output=True, text=True, timeout=900, env=env,
                              cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((out / "finetune_summary.json").read_text())["history"]
    assert len(history) == 2
    for h in history:
        first, second = h["decisions_per_process"]
        assert first > 0 and second > 0 and h["decisions"] == first + second
        assert len(set(h["weights_checksum_per_process"])) == 1
    assert history[0]["weights_checksum_per_process"] != history[1]["weights_checksum_per_process"]
    timelines = [json.loads((out / name).read_text()) for name in ("ray_timeline.json", "ray_timeline.process1.json")]
    workers = [{p["pid"] for p in t["workers"]} for t in timelines]
    assert all(len(w) == 1 for w in workers) and workers[0] != workers[1]
