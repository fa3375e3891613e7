import json
import math
from dataclasses import replace

import imageio.v2 as imageio
import pytest
import torch

from sim.config import EnvConfig
from vla_core.runtime import ChunkingConfig, DelayConfig
from vla_rl.eval import EvalConfig, evaluate
from vla_rl.statistics import wilson_interval


def test_wilson_interval_hand_values():
    # p = 0.5, n = 50, z = 1.96: centre = (0.5 + 0.0384) / 1.0768 = 0.5; half = 1.96*sqrt(0.005 + 0.00038416)/1.0768
    lo, hi = wilson_interval(25, 50)
    assert lo == pytest.approx(0.3664, abs=1e-4) and hi == pytest.approx(0.6336, abs=1e-4)
    lo, hi = wilson_interval(50, 50)  # all successes: upper bound 1, lower bound n / (n + z^2)
    assert hi == 1.0 and lo == pytest.approx(50 / (50 + 1.96**2), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    # 100 of 100: the formula's upper end rounds to 0.9999999999999999; the interval still holds p = 1
    # (a bar plot's error below the rate would be negative, and matplotlib refuses it)
    assert wilson_interval(100, 100)[1] == 1.0 and wilson_interval(0, 100)[0] == 0.0
    for k, n in [(0, 100), (100, 100), (200, 200), (1, 3), (7, 9), (37, 200)]:
        lo, hi = wilson_interval(k, n)
        assert lo <= k / n <= hi


def test_eval_writes_results_and_is_reproducible(tiny_checkpoint, tmp_path):
    out, _ = tiny_checkpoint
    cfg = EvalConfig(
        checkpoint=str(out), env=EnvConfig(num_envs=3, max_episode_steps=12), num_episodes=5, seed=5,
        video_episodes=2, video_size=64, output_dir=str(tmp_path / "a"),
    )  # fmt: skip
    result = evaluate(cfg)
    assert result["episodes"] == 5
    assert [(e["round"], e["world"], e["seed"]) for e in result["per_episode"]] == [
        (0, 0, 5), (0, 1, 5), (0, 2, 5), (1, 0, 6), (1, 1, 6)
    ]  # fmt: skip
    assert all(1 <= e["length"] <= 12 for e in result["per_episode"])
    assert result["success_rate"] == result["successes"] / 5
    saved = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert saved["success_ci95"] == list(wilson_interval(result["successes"], 5))
    assert f"| lift | {result['successes']}/5 |" in (tmp_path / "a" / "summary.md").read_text()
    assert [(t["task"], t["episodes"]) for t in result["per_task"]] == [("lift", 5)]
    lines = (tmp_path / "a" / "episodes.jsonl").read_text().splitlines()
    assert sorted((json.loads(line) for line in lines), key=lambda e: (e["round"], e["world"])) == result["per_episode"]
    frames = imageio.mimread(tmp_path / "a" / "rollouts.mp4", memtest=False)
    # One frame after the reset, then one per step until every counted world of round 0 has finished.
    assert len(frames) == 1 + max(e["length"] for e in result["per_episode"] if e["round"] == 0)
    assert frames[0].shape == (64, 128, 3)

    cfg.output_dir = str(tmp_path / "b")
    again = evaluate(cfg)
    assert again["per_episode"] == result["per_episode"]


def test_eval_ensemble_mode_replans_every_step(tiny_checkpoint, tmp_path, monkeypatch):
    from policies.diffusion.modeling_diffusion import DiffusionPolicy

    calls = []
    real = DiffusionPolicy.predict_chunk
    monkeypatch.setattr(
        DiffusionPolicy,
        "predict_chunk",
        lambda self, obs, step=None: calls.append(step.tolist()) or real(self, obs, step),
    )
    out, _ = tiny_checkpoint
    result = evaluate(EvalConfig(
        checkpoint=str(out), env=EnvConfig(num_envs=2, max_episode_steps=5), num_episodes=2,
        chunking=ChunkingConfig(execute_steps=1, merge="ensemble"), video_episodes=0, output_dir=str(tmp_path),
    ))  # fmt: skip
    assert result["merge"] == "ensemble" and result["execute_steps"] == 1
    assert calls == [[t, t] for t in range(5)]  # a new chunk at every one of the 5 steps
    assert not (tmp_path / "rollouts.mp4").exists()
    with pytest.raises(ValueError, match="chunking.merge='average' is not one of"):
        evaluate(EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=1), chunking=ChunkingConfig(merge="average"),
                            output_dir=str(tmp_path)))  # fmt: skip
    # The tiny policy's chunks are 16 steps long (policy.horizon): 17 cannot be executed from one.
    with pytest.raises(ValueError, match="chunking.execute_steps=17 exceeds the chunk length 16"):
        evaluate(EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=1), chunking=ChunkingConfig(execute_steps=17),
                            output_dir=str(tmp_path)))  # fmt: skip


def test_eval_rejects_mismatched_image_size(tiny_checkpoint, tmp_path):
    out, _ = tiny_checkpoint
    with pytest.raises(ValueError, match="--env.image_size=64"):
        evaluate(EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=1, image_size=96), output_dir=str(tmp_path)))


def test_eval_under_inference_delay(tiny_checkpoint, tmp_path, monkeypatch):
    """Requests happen every max(execute_steps, d) steps: 10 steps with s=2 ask 5 times at d=0, 4 at d=3."""
    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from vla_core.runtime import DelayConfig

    calls = []
    real = DiffusionPolicy.predict_chunk
    monkeypatch.setattr(
        DiffusionPolicy,
        "predict_chunk",
        lambda self, obs, step=None: calls.append(step.tolist()) or real(self, obs, step),
    )
    out, _ = tiny_checkpoint
    for d, expected in [(0, [0, 2, 4, 6, 8]), (3, [0, 3, 6, 9])]:
        calls.clear()
        result = evaluate(EvalConfig(
            checkpoint=str(out), env=EnvConfig(num_envs=2, max_episode_steps=10), num_episodes=2, video_episodes=0,
            chunking=ChunkingConfig(execute_steps=2), delay=DelayConfig(kind="fixed", steps=d),
            output_dir=str(tmp_path / str(d)),
        ))  # fmt: skip
        assert result["delay"]["steps"] == d
        # No lift fits in 10 steps (the expert needs about 40), so both worlds run all 10 in lockstep.
        assert [e["length"] for e in result["per_episode"]] == [10, 10]
        assert calls == [[t, t] for t in expected]


def test_eval_rtc_merge_guides_an_inpainting_policy_toward_the_queued_actions(tiny_checkpoint, tmp_path, monkeypatch):
    """d = 1, two steps per chunk, H = 16. The first request has nothing queued (all weights 0). Chunk 0
    arrives at step 1 and runs its index 1; at step 2 the second request's target row j is chunk 0's
    index 2 + j (j < 14, what is queued), with weight 1 on the committed row j = 0 and 0 past row 13."""
    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from vla_core.runtime import DelayConfig

    calls = []
    real = DiffusionPolicy.predict_chunk

    def spy(self, obs, obs_step=None, *, inpaint=None):
        chunk = real(self, obs, obs_step)
        calls.append((inpaint, chunk.actions.clone()))
        return chunk

    monkeypatch.setattr(DiffusionPolicy, "predict_chunk", spy)
    monkeypatch.setattr(DiffusionPolicy, "supports_inpainting", True)
    out, _ = tiny_checkpoint
    result = evaluate(EvalConfig(
        checkpoint=str(out), env=EnvConfig(num_envs=2, max_episode_steps=6), num_episodes=2, video_episodes=0,
        chunking=ChunkingConfig(execute_steps=2, merge="rtc"), delay=DelayConfig(kind="fixed", steps=1),
        output_dir=str(tmp_path),
    ))  # fmt: skip
    assert result["rtc_guidance"] is True
    (first, _), (second, _) = calls[0], calls[1]
    chunk0 = calls[0][1]
    assert first[1].shape == (2, 16) and (first[1] == 0).all()
    target, weights = second
    assert torch.allclose(target[:, :14], chunk0[:, 2:16]) and (target[:, 14:] == 0).all()
    assert (weights[:, 0] == 1).all() and (weights[:, 14:] == 0).all()
    assert ((weights[:, 1:14] > 0) & (weights[:, 1:14] < 1)).all()


def test_eval_refuses_delays_before_any_rollout(tiny_checkpoint, tmp_path, monkeypatch):
    from vla_core.runtime import DelayConfig

    out, _ = tiny_checkpoint
    cfg = EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=1), output_dir=str(tmp_path / "whole"))
    cfg.delay = DelayConfig(kind="fixed", steps=16)  # the chunk holds 16 steps
    with pytest.raises(ValueError, match="chunk holds 16"):
        evaluate(cfg)
    # A policy trained with the augmentation for delays up to 3 refuses 4.
    from vla_rl.checkpoint import load_policy

    policy, _ = load_policy(str(out))
    policy.config.max_delay_steps = 3
    monkeypatch.setattr("vla_rl.eval.load_policy", lambda *a, **k: (policy, out))
    cfg.delay = DelayConfig(kind="uniform", low=0, high=4)
    with pytest.raises(ValueError, match="trained for delays up to 3; .*--delay.kind=uniform --delay.high=4"):
        evaluate(cfg)
    assert not (tmp_path / "whole").exists()  # nothing written


# -- the plan of episodes, the record, resume --------------------------------------------------------


def test_a_protocol_plan_runs_exactly_the_asked_episodes_of_every_task_from_states_0_up():
    """Five worlds on three tasks (worlds 0, 2 run task 0; 1, 3 task 1; 4 task 2), 3 episodes each.
    Round 0: worlds 0, 2 take task 0's states 0, 1; worlds 1, 3 task 1's 0, 1; world 4 task 2's 0.
    Round 1: world 0 takes task 0's state 2, world 1 task 1's state 2, world 4 task 2's state 1; worlds
    2, 3 have nothing left (uncounted, reset to state 0). Round 2: only world 4, task 2's state 2."""
    from vla_rl.eval_record import EpisodePlan

    plan = EpisodePlan.per_task([0, 1, 0, 1, 2], ["a", "b", "c"], 3)
    shown = [[None if e is None else (e["task"], e["initial_state"]) for e in r.episodes] for r in plan.rounds]
    assert shown == [
        [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("c", 0)],
        [("a", 2), ("b", 2), None, None, ("c", 1)],
        [None, None, None, None, ("c", 2)],
    ]
    assert [r.seed for r in plan.rounds] == [[0, 0, 1, 1, 0], [2, 2, 0, 0, 1], [0, 0, 0, 0, 2]]
    assert plan.num_episodes == 9
    with pytest.raises(ValueError, match=r"no world runs task\(s\) \['c'\]: raise --env.num_envs to at least 3"):
        EpisodePlan.per_task([0, 1], ["a", "b", "c"], 3)


def test_a_plan_without_a_protocol_is_evals_rounds_of_batch_seeds():
    """5 episodes on 2 worlds from seed 7: rounds of seeds 7, 8, 9; in the last only world 0 counts."""
    from vla_rl.eval_record import EpisodePlan

    plan = EpisodePlan.seeded(5, 2, 7)
    assert [r.seed for r in plan.rounds] == [7, 8, 9]
    assert [r.episodes for r in plan.rounds][-1] == [{"seed": 9}, None] and plan.num_episodes == 5


def test_the_per_task_table_counts_each_tasks_episodes():
    """Task a: 2 of 3 successes (lengths 10, 20, 30); task b: 0 of 1 (length 5); task c has none: no row."""
    from vla_rl.eval_record import per_task_table

    episodes = [{"task": "a", "success": s, "length": n} for s, n in [(True, 10), (False, 20), (True, 30)]]
    rows = per_task_table([*episodes, {"task": "b", "success": False, "length": 5}], ["a", "b", "c"])
    assert [(r["task"], r["episodes"], r["successes"], r["mean_episode_length"]) for r in rows] == [
        ("a", 3, 2, 20.0), ("b", 1, 0, 5.0)
    ]  # fmt: skip
    assert rows[0]["success_ci95"] == list(wilson_interval(2, 3)) and rows[0]["success_rate"] == 2 / 3


def test_libero_protocol_flags_are_refused_where_they_mean_nothing():
    """--protocol off LIBERO; under a protocol, the flags it fixes; an unknown protocol; too many episodes."""
    with pytest.raises(ValueError, match="'lift' is not a LIBERO task: drop them"):
        EvalConfig(protocol="openpi").libero_protocol()
    libero = EnvConfig(task="libero_spatial", cameras=["image", "image2"], image_size=256)
    with pytest.raises(ValueError, match="fixes the episodes, step limits and settle steps: drop --num_episodes, "
                                         "--env.max_episode_steps"):  # fmt: skip
        EvalConfig(env=EnvConfig(**{**libero.__dict__, "max_episode_steps": 100}), num_episodes=10).libero_protocol()
    with pytest.raises(ValueError, match="unknown LIBERO protocol 'openvla'; choose --protocol= one of openpi, "):
        EvalConfig(env=libero, protocol="openvla").libero_protocol()
    with pytest.raises(ValueError, match=r"--episodes_per_task must be in \[0, 50\]"):
        EvalConfig(env=libero, episodes_per_task=51).libero_protocol()
    chosen = EvalConfig(env=libero).libero_protocol()  # the default: openpi, 220 steps on Spatial, 10 settle
    assert (chosen.name, chosen.limit("libero_spatial"), chosen.settle_steps, chosen.episodes_per_task) == (
        "openpi", 220, 10, 50
    )  # fmt: skip
    rlinf = EvalConfig(env=libero, protocol="rlinf").libero_protocol()
    assert (rlinf.limit("libero_10"), rlinf.settle_steps) == (512, 15)


def test_libero_gets_the_cameras_its_policies_expect_unless_others_are_asked():
    """The MuJoCo default (front at 64 px, a camera LIBERO lacks) becomes both LIBERO cameras at 256 px; a
    size given is kept; cameras given are kept as they are."""
    from sim.libero_protocol import with_libero_cameras

    preset = with_libero_cameras(EnvConfig(task="libero_goal"))
    assert (preset.cameras, preset.image_size) == (["image", "image2"], 256)
    assert with_libero_cameras(EnvConfig(task="libero_goal", image_size=128)).image_size == 128
    mine = with_libero_cameras(EnvConfig(task="libero_goal", cameras=["image"], image_size=64))
    assert (mine.cameras, mine.image_size) == (["image"], 64)


def test_an_evaluation_into_a_folder_holding_one_is_refused_unless_resumed_or_overwritten(tiny_checkpoint, tmp_path):
    out, _ = tiny_checkpoint
    cfg = EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=2, max_episode_steps=6), num_episodes=2,
                     video_episodes=0, output_dir=str(tmp_path / "e"))  # fmt: skip
    first = evaluate(cfg)
    with pytest.raises(FileExistsError, match="holds an evaluation already; pass --resume=true to go on with it, "
                                              "--overwrite=true"):  # fmt: skip
        evaluate(cfg)
    with pytest.raises(FileExistsError, match="holds a finished evaluation"):
        evaluate(EvalConfig(**{**cfg.__dict__, "resume": True}))
    with pytest.raises(ValueError, match="--overwrite=true replaces it: pass one"):
        evaluate(EvalConfig(**{**cfg.__dict__, "resume": True, "overwrite": True}))
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["per_episode"] == first["per_episode"]
    again = evaluate(EvalConfig(**{**cfg.__dict__, "overwrite": True}))
    assert again["per_episode"] == first["per_episode"]


def test_a_killed_evaluation_resumes_to_the_same_episodes(tiny_checkpoint, tmp_path):
    """`vla-rl eval` killed with SIGKILL once its second round has begun (random delays, the measured
    estimate: the delay draws and lags carry across rounds), then run again with --resume=true: the
    rounds done are kept, the cut one runs again, and every episode's outcome and length equal those of
    a run that was never stopped. Resuming with another seed is refused, naming it."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    out, _ = tiny_checkpoint
    args = [f"--checkpoint={out}", "--env.num_envs=2", "--env.max_episode_steps=10",
            "--num_episodes=8", "--video_episodes=0", "--delay.kind=uniform", "--delay.low=0", "--delay.high=3",
            "--delay.estimate=measured", "--seed=3"]  # fmt: skip
    whole = evaluate_cli(args + [f"--output_dir={tmp_path / 'whole'}"])
    assert whole.returncode == 0, whole.stderr[-2000:]
    cut = tmp_path / "cut"
    command = [sys.executable, "-m", "vla_rl.cli", "eval", *args, f"--output_dir={cut}"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        lines = (cut / "episodes.jsonl").read_text().splitlines() if (cut / "episodes.jsonl").exists() else []
        if len(lines) >= 3:  # round 0 done (2 episodes) and one of round 1's
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the evaluation finished before it could be killed"
    assert not (cut / "eval.json").exists() and (cut / "eval_progress.pt").exists()
    refused = evaluate_cli(args[:-1] + ["--seed=4", "--resume=true", f"--output_dir={cut}"])
    assert refused.returncode == 2 and "differs in seed" in refused.stderr
    resumed = evaluate_cli(args + ["--resume=true", f"--output_dir={cut}"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("whole", "cut"))
    assert b["per_episode"] == a["per_episode"] and len(a["per_episode"]) == 8
    # Chunks per delay: draws of the restored delay stream, sized by the restored lags, counted from the start.
    assert b["delay_histogram"] == a["delay_histogram"] and sum(a["delay_histogram"].values()) > 8
    assert not (cut / "eval_progress.pt").exists()
    lines = [json.loads(line) for line in (cut / "episodes.jsonl").read_text().splitlines()]
    assert sorted(lines, key=lambda e: (e["round"], e["world"])) == a["per_episode"]


def test_the_saved_random_state_gives_back_the_draws_that_would_have_come(tmp_path):
    """What a resumed round reads: torch's next draws, the delay model's next draws, the lags and the delay
    counts, after a save and a load into a process that has drawn other numbers since, are those that
    came next when saving."""
    from test_latency_protocol import protocol as make_protocol

    from vla_core.runtime import DelayConfig, DelayModel
    from vla_rl.eval_record import load_random_state, random_state

    torch.manual_seed(0)
    delay = DelayModel(DelayConfig(kind="uniform", low=0, high=5, seed=2))
    delay.sample(7)
    saving = make_protocol()
    saving.lags = torch.tensor([[1, 3]])
    saved = random_state(delay, saving, {2: 5})
    expected = (torch.rand(3), delay.sample(7))
    torch.manual_seed(9)
    other = DelayModel(DelayConfig(kind="uniform", low=0, high=5, seed=2))
    protocol, seen = make_protocol(), {}
    load_random_state(saved, other, protocol, seen, "eval_progress.pt")
    assert torch.equal(torch.rand(3), expected[0]) and torch.equal(other.sample(7), expected[1])
    assert protocol.lags.tolist() == [[1, 3]] and seen == {2: 5}


def test_a_record_reruns_to_the_same_episodes_and_refuses_other_weights(tiny_checkpoint, tmp_path):
    """`--rerun=<eval.json>` runs the record's own config (seed, delays, episodes) into a new folder: every
    episode's outcome and length, and the delay counts, come out the same. A record whose weights hash
    is not the checkpoint's, or one without provenance (an older vla-rl), is refused with one line."""
    out, _ = tiny_checkpoint
    first = evaluate(EvalConfig(
        checkpoint=str(out), env=EnvConfig(num_envs=2, max_episode_steps=8), num_episodes=3, seed=11, video_episodes=0,
        delay=DelayConfig(kind="uniform", low=0, high=2), output_dir=str(tmp_path / "a"),
    ))  # fmt: skip
    assert len(first["provenance"]["weights_sha256"]) == 64 and "torch" in first["provenance"]["versions"]
    record = tmp_path / "a" / "eval.json"
    again = evaluate(EvalConfig(rerun=str(record), output_dir=str(tmp_path / "b")))
    assert again["rerun"]["same_outcomes"] and again["per_episode"] == first["per_episode"]
    assert again["delay_histogram"] == first["delay_histogram"] and again["config"]["seed"] == 11
    with pytest.raises(FileExistsError, match="holds a finished evaluation"):  # --resume reaches the rerun
        evaluate(EvalConfig(rerun=str(record), output_dir=str(tmp_path / "b"), resume=True))
    tampered = json.loads(record.read_text())
    tampered["provenance"]["weights_sha256"] = "0" * 64
    (tmp_path / "t.json").write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match="does not hold the weights the record measured"):
        evaluate(EvalConfig(rerun=str(tmp_path / "t.json"), output_dir=str(tmp_path / "c")))
    del tampered["provenance"]
    (tmp_path / "old.json").write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match="written by an older vla-rl eval"):
        evaluate(EvalConfig(rerun=str(tmp_path / "old.json"), output_dir=str(tmp_path / "d")))


def test_the_weights_hash_changes_with_any_weight_and_not_with_the_order_of_the_dict():
    """One bit of one weight changes the hash; the same weights in another module instance give the same."""
    from vla_rl.eval_record import weights_sha256

    torch.manual_seed(0)
    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert weights_sha256(a) == weights_sha256(b)
    with torch.no_grad():
        b.bias[0] = torch.nextafter(b.bias[0], torch.tensor(1.0))
    assert weights_sha256(a) != weights_sha256(b)


def evaluate_cli(args):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([sys.executable, "-m", "vla_rl.cli", "eval", *args], check=False, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])  # fmt: skip


def test_several_tasks_in_one_run_and_their_record_reruns(tiny_checkpoint, tmp_path):
    """--tasks=[lift,reach]: each task into its own folder, one eval.json over all (per task, per suite,
    every episode with its task); resumed, a finished task is reused as it is; the combined record reruns
    to the same episodes. A task named twice is refused."""
    out, _ = tiny_checkpoint
    base = {"checkpoint": str(out), "env": EnvConfig(num_envs=2, max_episode_steps=6), "num_episodes": 2,
            "video_episodes": 0, "output_dir": str(tmp_path / "both"), "tasks": ["lift", "reach"]}  # fmt: skip
    with pytest.raises(ValueError, match="--env.task=push and --tasks both name what to evaluate"):
        evaluate(EvalConfig(**{**base, "env": EnvConfig(task="push")}))
    with pytest.raises(ValueError, match="names a task twice"):
        evaluate(EvalConfig(**{**base, "tasks": ["lift", "lift"]}))
    result = evaluate(EvalConfig(**base))
    assert result["episodes"] == 4 and [(t["task"], t["episodes"]) for t in result["per_task"]] == [
        ("lift", 2),
        ("reach", 2),
    ]
    assert [(s["suite"], s["episodes"]) for s in result["per_suite"]] == [("lift", 2), ("reach", 2)]
    assert (tmp_path / "both" / "lift" / "eval.json").exists()
    mtime = (tmp_path / "both" / "lift" / "eval.json").stat().st_mtime_ns
    resumed = evaluate(EvalConfig(**{**base, "resume": True}))
    assert resumed["per_episode"] == result["per_episode"]
    assert (tmp_path / "both" / "lift" / "eval.json").stat().st_mtime_ns == mtime  # reused, not run again
    again = evaluate(EvalConfig(rerun=str(tmp_path / "both" / "eval.json"), output_dir=str(tmp_path / "again")))
    assert again["rerun"]["same_outcomes"] and again["per_episode"] == result["per_episode"]


def test_eval_records_each_episodes_variation_as_the_env_drew_it(tiny_checkpoint, tmp_path):
    """--env.variation=colour: each episode's line in episodes.jsonl carries the colour its world drew at the
    round's reset; the same seed in a bare env draws the same, world by world."""
    from sim.factory import make_env

    out, _ = tiny_checkpoint
    env_cfg = EnvConfig(num_envs=2, max_episode_steps=5, variation="colour")
    evaluate(EvalConfig(checkpoint=str(out), env=env_cfg, num_episodes=2, video_episodes=0, seed=21,
                        output_dir=str(tmp_path / "eval")))  # fmt: skip
    lines = [json.loads(line) for line in (tmp_path / "eval" / "episodes.jsonl").read_text().splitlines()]
    with make_env(env_cfg) as env:
        env.reset(seed=21)
        drawn = {i: env.variation_record(i) for i in range(2)}
    assert sorted((e["world"], e["variation"]["rgb"]) for e in lines) == [(i, drawn[i]["rgb"]) for i in range(2)]


def test_the_rate_ratio_interval_is_katzs_log_interval_worked_by_hand():
    """60/100 against 50/100: ratio 1.2, log standard error sqrt(0.4/60 + 0.5/50) = 0.129099, so
    exp(0.182322 -+ 0.253035) = (0.93173, 1.54551). With no success on one side the bounds stay finite
    (0.5 added): 0/100 against 50/100 -> ratio (0.5/101)/(50.5/101) = 0.0099."""
    from vla_rl.statistics import rate_ratio_interval

    low, high = rate_ratio_interval(60, 100, 50, 100)
    assert low == pytest.approx(0.93173, abs=1e-5) and high == pytest.approx(1.54551, abs=1e-5)
    low, high = rate_ratio_interval(0, 100, 50, 100)
    assert 0 < low < 0.5 / 50.5 < high < 1 and math.isfinite(high)
    assert all(math.isnan(v) for v in rate_ratio_interval(3, 0, 5, 10))


def test_the_best_of_draws_counts_a_state_once_it_succeeds_in_any_draw():
    from vla_rl.eval_record import best_of_draws

    outcomes = {0: [1, 0, 0, 0], 1: [0, 0, 0, 0], 2: [1, 1, 1, 1]}
    episodes = [{"initial_state": k, "success": bool(s)} for k, v in outcomes.items() for s in v]
    b = best_of_draws(episodes[::-1])  # in any order
    # mean 5 of 12; states 0 and 2 succeed at least once: 2 of 3; headroom 100 * (8/12 - 5/12) = 25 points
    assert (b["states"], b["draws"], b["mean"], b["best_of_draws"]) == (3, 4, 5 / 12, 2 / 3)
    assert (b["states_never"], b["headroom_points"], b["per_state"]) == (1, 25.0, [1, 0, 4])
    with pytest.raises(ValueError, match="same number of draws"):
        best_of_draws(episodes[:-1])


def test_a_repeated_plan_resets_each_states_draws_to_one_initial_state():
    """3 states x 2 draws on 4 worlds from seed 10: world seeds 10 10 11 11, then 12 12 and two uncounted."""
    from sim.factory import make_env
    from vla_rl.eval_record import EpisodePlan

    plan = EpisodePlan.repeated(3, 2, 4, 10)
    assert [r.seed for r in plan.rounds] == [[10, 10, 11, 11], [12, 12, 10, 10]]
    assert plan.rounds[1].episodes == [{"world_seed": 12, "initial_state": 2, "draw": 0},
                                       {"world_seed": 12, "initial_state": 2, "draw": 1}, None, None]  # fmt: skip
    assert plan.num_episodes == 6 and plan.episode_numbers(1) == [4, 5, -1, -1]
    with make_env(EnvConfig(num_envs=4, cameras=[])) as env:
        state = env.reset(seed=plan.rounds[0].seed)["observation.state"]
        cube = env.privileged_state()["cube"]
    assert torch.equal(state[0], state[1]) and torch.equal(state[2], state[3])
    assert (cube[0] == cube[1]).all() and (cube[2] == cube[3]).all() and not (cube[0] == cube[2]).all()


def test_eval_with_draws_per_state_reports_the_best_of_them(tiny_checkpoint, tmp_path):
    out, _ = tiny_checkpoint
    cfg = EvalConfig(checkpoint=str(out), env=EnvConfig(num_envs=4, max_episode_steps=6), num_episodes=8,
                     draws_per_state=4, seed=3, video_episodes=0, output_dir=str(tmp_path / "best"))  # fmt: skip
    result = evaluate(cfg)
    assert [(e["initial_state"], e["draw"], e["world_seed"]) for e in result["per_episode"]] == [
        (k, j, 3 + k) for k in range(2) for j in range(4)]  # fmt: skip
    from vla_rl.eval_report import episode_key

    assert len({episode_key(e) for e in result["per_episode"]}) == 8  # each draw its own episode when compared
    wins = [sum(e["success"] for e in result["per_episode"] if e["initial_state"] == k) for k in range(2)]
    b = result["best_of_draws"]
    assert (b["per_state"], b["best_of_draws"], b["mean"]) == (wins, sum(w > 0 for w in wins) / 2, sum(wins) / 8)
    assert f"best of 4 draws per initial state: **{b['best_of_draws']:.1%}** of 2 states" in (
        tmp_path / "best" / "summary.md").read_text()  # fmt: skip
    assert evaluate(replace(cfg, draws_per_state=1, output_dir=str(tmp_path / "one")))["best_of_draws"] is None
    for bad, match in ((0, "must be >= 1"), (3, "multiple of it")):
        with pytest.raises(ValueError, match=match):
            evaluate(replace(cfg, draws_per_state=bad, output_dir=str(tmp_path / "bad")))
    assert not (tmp_path / "bad").exists()


def test_eval_with_a_noise_scale_samples_from_that_multiple_of_each_requests_noise(tmp_path, monkeypatch):
    """--noise_seed=0 --noise_scale=1.5: request k of episode 0 starts its sampler from 1.5 request_noise(0, 0, k)
    (8 steps, 4 executed a chunk: requests 0 and 1 at least), bit for bit; with steering too it is refused."""
    from tiny_policies import save_lift_flow_policy

    from policies.diffusion.modeling_diffusion import DiffusionPolicy
    from vla_core.runtime import request_noise
    from vla_rl.eval import SteerEvalConfig

    save_lift_flow_policy(tmp_path / "policy", image_size=32)
    seen, original = [], DiffusionPolicy.predict_chunk

    def recording(self, obs, obs_step=None, **kwargs):
        seen.append(kwargs["noise"].clone())
        return original(self, obs, obs_step, **kwargs)

    monkeypatch.setattr(DiffusionPolicy, "predict_chunk", recording)
    cfg = EvalConfig(checkpoint=str(tmp_path / "policy"), num_episodes=1, noise_seed=0, noise_scale=1.5,
                     env=EnvConfig(num_envs=1, max_episode_steps=8, image_size=32, num_threads=1, render_threads=1),
                     video_episodes=0, output_dir=str(tmp_path / "eval"))  # fmt: skip
    result = evaluate(cfg)
    assert len(seen) >= 2 and result["config"]["noise_scale"] == 1.5
    for k in range(2):
        assert torch.equal(seen[k], 1.5 * request_noise(0, 0, k, 8, 4))
    with pytest.raises(ValueError, match="--noise_scale probes the base's own noise and --steer.dir steers it"):
        evaluate(replace(cfg, steer=SteerEvalConfig(dir=str(tmp_path)), output_dir=str(tmp_path / "both")))


def test_a_record_from_before_the_noise_scale_and_the_steer_weight_default_resumes():
    """An unsteered evaluation at noise scale 1 has neither field in its identity, as records from before them (whose
    steer weight default was 1.0) hold none; a scale other than 1, or a steering, is part of it."""
    from vla_rl.eval import SteerEvalConfig, identity

    plain = identity(EvalConfig(), "sha")
    assert "noise_scale" not in plain and "steer" not in plain and plain["weights_sha256"] == "sha"
    assert identity(EvalConfig(noise_scale=1.5), "sha")["noise_scale"] == 1.5
    assert identity(EvalConfig(steer=SteerEvalConfig(dir="s")), "sha")["steer"]["dir"] == "s"
