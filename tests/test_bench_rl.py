"""`bench rl --seeds=[...]`: each seed its own resumable run in its own folder, a finished seed read back
instead of run again, and the figures pooled over the seeds (counts summed, not rates averaged)."""

import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from vla_rl import stages
from vla_rl.bench_rl import BenchRLConfig, bench_rl, format_summary
from vla_rl.statistics import pooled_rate

SEED1_SUCCESSES = {"imitation": 20, "ppo": 50, "grpo": 30}  # of 100 held-out episodes each


@pytest.fixture
def seed1_stages(monkeypatch):
    """Every stage replaced by a recorder; the evaluations of seed 1's checkpoints give SEED1_SUCCESSES."""
    calls = []

    def evaluate(cfg):
        arm = Path(cfg.output_dir).name
        calls.append(("evaluate", Path(cfg.checkpoint).parent.name, arm))
        k = SEED1_SUCCESSES[arm]
        return {"episodes": 100, "successes": k, "success_rate": k / 100, "success_ci95": [0.0, 1.0],
                "mean_episode_length": 50.0}  # fmt: skip

    def finetune(cfg):
        calls.append(("finetune", cfg.seed, cfg.algo, Path(cfg.output_dir).parent.name))
        return {"env_steps": 150_500, "iterations": 80, "evals": [], "rollout_env_steps_per_s": 1.0,
                "skipped_updates": 0}  # fmt: skip

    monkeypatch.setattr(stages, "record", lambda cfg: calls.append(("record", cfg.seed)))
    monkeypatch.setattr(stages, "train", lambda cfg: calls.append(("train", cfg.seed)))
    monkeypatch.setattr(stages, "evaluate", evaluate)
    monkeypatch.setattr(stages, "finetune", finetune)
    return calls


def finished_seed0(cfg: BenchRLConfig, out: Path) -> None:
    """Seed 0's finished run, as `bench rl` writes it: imitation 40, PPO 60, GRPO 50 of 100, 10 minutes."""
    counts = {"imitation": 40, "ppo": 60, "grpo": 50}
    results = {arm: {"episodes": 100, "successes": k, "success_rate": k / 100, "success_ci95": [0.0, 1.0]}
               for arm, k in counts.items()}  # fmt: skip
    seed_cfg = replace(cfg, seed=0, seeds=[], num_threads=2, output_dir=str(out / "seed0"))
    report = {"config": asdict(seed_cfg), "results": results,
              "gains_points": {"ppo": 20.0, "grpo": 10.0}, "runs": {"ppo": {"curve": []}, "grpo": {"curve": []}},
              "minutes": 10.0,
              "env_steps": {"ppo": 150_000, "grpo": 150_100}}  # fmt: skip
    (out / "seed0").mkdir(parents=True)
    (out / "seed0" / "rl.json").write_text(json.dumps(report))


def test_a_finished_seed_is_read_back_the_next_one_runs_and_the_counts_are_pooled(tmp_path, seed1_stages):
    cfg = BenchRLConfig(seeds=[0, 1], output_dir=str(tmp_path))
    finished_seed0(cfg, tmp_path)
    pooled = bench_rl(cfg)
    # Nothing of seed 0 ran again (its threads differed: they change no result); seed 1 ran every stage, in its folder.
    assert seed1_stages == [
        ("record", 1), ("train", 1), ("evaluate", "seed1", "imitation"),
        ("finetune", 1, "ppo", "seed1"), ("evaluate", "seed1", "ppo"),
        ("finetune", 1, "grpo", "seed1"), ("evaluate", "seed1", "grpo"),
    ]  # fmt: skip
    # Pooled by hand: imitation (40 + 20) / 200 = 0.30, PPO (60 + 50) / 200 = 0.55, GRPO (50 + 30) / 200 = 0.40.
    assert {arm: r["successes"] for arm, r in pooled["results"].items()} == {"imitation": 60, "ppo": 110, "grpo": 80}
    assert pooled["gains_points"] == {"ppo": 25.0, "grpo": 10.0}
    assert pooled["env_steps"] == {"ppo": 150_500, "grpo": 150_500}
    assert json.loads((tmp_path / "pooled.json").read_text())["gains_points"] == pooled["gains_points"]
    assert json.loads((tmp_path / "seed1" / "rl.json").read_text())["gains_points"] == {"ppo": 30.0, "grpo": 10.0}
    lines = format_summary(pooled).splitlines()
    assert lines[0] == "seed 0: ppo_gain=+20.0 grpo_gain=+10.0 env_steps=150100 minutes=10.0"
    assert lines[1].startswith("seed 1: ppo_gain=+30.0 grpo_gain=+10.0 env_steps=150500 minutes=")
    # minutes: seed 0's 10 plus seed 1's few seconds of faked stages
    assert re.fullmatch(r"ppo_gain=\+25\.0 grpo_gain=\+10\.0 env_steps=150500 minutes=10\.\d seeds=0,1", lines[-1])


def test_a_seed_finished_under_another_setting_is_run_again(tmp_path, seed1_stages):
    cfg = BenchRLConfig(seeds=[0], output_dir=str(tmp_path))
    finished_seed0(replace(cfg, env_steps=100_000), tmp_path)  # another budget: its result is not this run's
    pooled = bench_rl(cfg)
    assert [c[:2] for c in seed1_stages[:2]] == [("record", 0), ("train", 0)]
    assert pooled["results"]["imitation"]["successes"] == SEED1_SUCCESSES["imitation"]  # the new run's, not 40


def test_seeds_refuse_a_seed_flag_and_repeated_seeds(tmp_path):
    with pytest.raises(ValueError, match="drop --seed=3"):
        bench_rl(BenchRLConfig(seeds=[0, 1], seed=3, output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="repeat no seed"):
        bench_rl(BenchRLConfig(seeds=[1, 1], output_dir=str(tmp_path)))


def test_pooled_rate_sums_the_counts_and_gives_their_wilson_interval():
    """80 of 200: p = 0.4; Wilson with z = 1.96: centre (0.4 + 1.96^2 / 400) / (1 + 1.96^2 / 200) = 0.40189,
    half-width 1.96 sqrt(0.4 * 0.6 / 200 + 1.96^2 / 160000) / 1.019208 = 0.06728."""
    pooled = pooled_rate([{"successes": 30, "episodes": 100}, {"successes": 50, "episodes": 100}])
    assert (pooled["successes"], pooled["episodes"], pooled["success_rate"]) == (80, 200, 0.4)
    assert pooled["success_ci95"] == pytest.approx([0.40189 - 0.06728, 0.40189 + 0.06728], abs=2e-5)


def test_the_autoregressive_vlas_imitation_steps_default_to_the_selected_setting_on_the_command_line():
    """The command line sets --policy_type after the config is built: the default train_steps (0) must still mean
    12,000 for the AR VLA (the 2026-12-04 selection) and 4,000 for diffusion; a given value stays."""
    from vla_rl.cli import parse_config

    assert parse_config("bench rl", ["--policy_type=autoregressive_vla"]).imitation_steps == 12000
    assert parse_config("bench rl", []).imitation_steps == 4000
    assert parse_config("bench rl", ["--policy_type=autoregressive_vla", "--train_steps=500"]).imitation_steps == 500


def test_the_curves_figure_plots_each_seeds_periodic_evaluations_of_each_arm(tmp_path):
    """Two seeds, two arms: four series, each the (env steps, success) pairs of that seed's arm, none mixed up."""
    from vla_rl.bench_rl import plot_curves

    def report(ppo, grpo):
        return {"runs": {"ppo": {"curve": [{"env_steps": s, "success_rate": r} for s, r in ppo]},
                         "grpo": {"curve": [{"env_steps": s, "success_rate": r} for s, r in grpo]}}}  # fmt: skip

    pooled = {
        "gains_points": {"ppo": 1.0, "grpo": 2.0},
        "results": {"imitation": {"success_rate": 0.3, "episodes": 200}},
        "seeds": {"0": report([(0, 0.1), (100, 0.2)], [(0, 0.1), (90, 0.4)]), "1": report([(0, 0.5)], [])},
    }
    series = plot_curves(pooled, tmp_path / "curves.png")
    assert series == {
        "ppo seed 0": ([0, 100], [0.1, 0.2]), "grpo seed 0": ([0, 90], [0.1, 0.4]),
        "ppo seed 1": ([0], [0.5]), "grpo seed 1": ([], []),
    }  # fmt: skip
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp*"))


def test_the_grpo_arm_samples_with_the_std_floor_the_pilots_chose_and_ppo_with_the_default(tmp_path, monkeypatch):
    """The 2026-12-07 amendment: GRPO fine-tunes with --noise.min_std=0.05, PPO with finetune's 0.1; eta 0 both. A
    token policy's GRPO arm keeps finetune's noise (it has no chain; finetune refuses a floor set for it)."""
    from vla_rl.bench_rl import _finetune_arm

    seen = {}

    def finetune(cfg):
        seen[cfg.algo] = (cfg.noise.eta, cfg.noise.min_std, cfg.noise.temperature)
        return {"env_steps": 1, "iterations": 1, "evals": [], "rollout_env_steps_per_s": 1.0, "skipped_updates": 0}

    monkeypatch.setattr(stages, "finetune", finetune)
    for arm in ("ppo", "grpo"):
        _finetune_arm(BenchRLConfig(), arm, tmp_path / "imitation", tmp_path)
    assert seen == {"ppo": (0.0, 0.1, 1.0), "grpo": (0.0, 0.05, 1.0)}
    _finetune_arm(BenchRLConfig(policy_type="autoregressive_vla"), "grpo", tmp_path / "imitation", tmp_path)
    assert seen["grpo"] == (0.0, 0.1, 1.0)
