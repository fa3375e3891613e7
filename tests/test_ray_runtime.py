"""Asynchronous rollouts on Ray: two real rollout actors on CPU, the version bookkeeping and the staleness bound."""

import re

import pytest
from extras import require

from sim.config import EnvConfig
from vla_rl.finetune import FinetuneConfig, finetune
from vla_rl.rl.ray_runtime import RayConfig, usable

ray = require("ray", "ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (starting one takes seconds), shut down at the end."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(checkpoint, out, max_staleness, iterations=4):
    return finetune(FinetuneConfig(
        checkpoint=str(checkpoint), env=EnvConfig(num_envs=2, max_episode_steps=8), iterations=iterations,
        update_epochs=1, minibatch_size=16, eval_every=0, output_dir=str(out), num_threads=1, log_with="none",
        runtime="ray", ray=RayConfig(num_workers=2, max_staleness=max_staleness),
    ))  # fmt: skip


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


def test_with_no_staleness_allowed_every_rollout_is_on_policy(tiny_checkpoint, tmp_path, local_ray):
    history = _run(tiny_checkpoint[0], tmp_path / "sync", max_staleness=0, iterations=3)["history"]
    assert [(h["policy_version"], h["data_version_min"], h["data_version_max"]) for h in history] == [
        (0, 0, 0), (1, 1, 1), (2, 2, 2)
    ]  # fmt: skip
    assert all(h["dropped_rollouts"] == 0 for h in history)


def test_an_unreachable_cluster_is_named_before_anything_starts(tiny_checkpoint, tmp_path):
    cfg = FinetuneConfig(checkpoint=str(tiny_checkpoint[0]), output_dir=str(tmp_path / "x"), runtime="ray",
                         ray=RayConfig(address="127.0.0.1:1"))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("cannot reach the Ray cluster at --ray.address=127.0.0.1:1")):
        finetune(cfg)
    assert not (tmp_path / "x").exists()


def test_ray_refuses_what_it_does_not_run():
    with pytest.raises(ValueError, match=re.escape("--runtime=ray rolls out one task")):
        FinetuneConfig(runtime="ray", tasks=["lift", "reach"]).validate()
    with pytest.raises(ValueError, match="--ray.num_workers must be >= 1"):
        FinetuneConfig(runtime="ray", ray=RayConfig(num_workers=0)).validate()
