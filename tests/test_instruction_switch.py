"""Instructions that change mid-task (SwitchVLA): the latency protocol's reaction, the simulation's shell around
it, and the `reach_switch` task whose instruction switches, each against hand-worked values."""

import numpy as np
import pytest
import torch
from shells import CountingEnv, make_shell

from vla_core.runtime import ChunkingConfig, DelayConfig, DelayModel, LatencyProtocol, LatencySpec
from vla_core.types import ActionChunk


def run_counting(rule: str, steps: int) -> tuple[list[float], list[bool], list]:
    """One world, H = 8, 4 steps per chunk, a fixed delay of 3, the instruction switching in the observation after
    5 steps, episodes of 13 steps; every chunk's row r is worth 10 * (its request's step) + r. Returns the actions
    applied, per step whether the observation after it carried a new instruction, and the first episode's
    `Reaction`."""
    from vla_core.runtime.transition import SwitchReactions

    env = CountingEnv(switch_at=5, length=13)
    shell = make_shell(env, 8, 4, DelayModel(DelayConfig(kind="fixed", steps=3)), on_new_instruction=rule)
    shell.reset()
    flags: list[bool] = []
    reactions, ended = SwitchReactions(1), []
    while len(env.applied[0]) < steps:
        chunk = torch.arange(8, dtype=torch.float32)[None, :, None] + 10.0 * shell.obs_step[:, None, None]
        info = shell.step(ActionChunk(chunk, shell.obs_step))[4]
        flags += info["trace"].new_instruction[0].tolist()
        ended += reactions.add(info["trace"])
    return env.applied[0][:steps], flags[:steps], ended[:1]


def test_replan_drops_the_old_plan_and_what_is_in_flight_and_requests_at_once():
    """Requests at 0 (lands at 3) and 4 (in flight when the switch is seen after step 4). replan: the rows of
    chunk 0 for steps 5-7 are dropped and request 4 is abandoned (its answer would land at 7); a request goes out
    at step 5, under the new instruction, and lands at 8: the arm holds (-1) at 5, 6, 7, and from 8 runs chunk 5's
    rows 3-6, then chunk 9's row 3 at 12. The reaction (switch at 5, first new row at 8) is the delay, 3.
    next_chunk (the earlier rule): chunk 0 runs out (5, 6), chunk 4, planned under the old instruction, runs at
    7-10, and the first chunk under the new one (asked at 8) runs from 11: a reaction of 6. The episode's end (13
    steps) reports both."""
    from vla_core.runtime.transition import Reaction

    applied, flags, ended = run_counting("replan", 13)
    assert applied == [-1, -1, -1, 3, 4, -1, -1, -1, 53, 54, 55, 56, 93]
    assert flags == [False] * 4 + [True] + [False] * 8
    assert ended == [Reaction(world=0, switch_step=5, reaction_steps=3)]
    applied, flags, ended = run_counting("next_chunk", 13)
    assert applied == [-1, -1, -1, 3, 4, 5, 6, 43, 44, 45, 46, 83, 84]
    assert flags == [False] * 4 + [True] + [False] * 8
    assert ended == [Reaction(world=0, switch_step=5, reaction_steps=6)]


@pytest.mark.parametrize("switch_at,expected", [(2, [False, True, False] * 2), (3, [False, False, True] * 2)])
def test_an_episode_start_is_no_switch_and_a_switch_at_its_last_step_is_one(switch_at, expected):
    """Episodes of 3 steps whose observation says "count again" from step ``switch_at`` on, each new episode back to
    "count". At 2: a switch after the 2nd step of each episode; the end (3rd step) and the next episode's "count"
    are none. At 3: the switch is in the episode's final observation (the env's ``final_obs``), so it counts there;
    the next episode's first observation is still no switch."""
    env = CountingEnv(length=3, switch_at=switch_at)
    shell = make_shell(env, 4, 2, DelayModel(DelayConfig(kind="fixed", steps=0)))
    shell.reset()
    flags = []
    while len(flags) < 6:
        chunk = torch.zeros(1, 4, 1)
        flags += shell.step(ActionChunk(chunk, shell.obs_step))[4]["trace"].new_instruction[0].tolist()
    assert flags[:6] == expected


def test_the_protocol_keeps_the_committed_lead_and_never_merges_the_abandoned_chunk():
    """H = 6, lead 2: a chunk merged at step 0 runs from step 2 (its lead). At step 1 new_instruction keeps the
    queue's first 2 slots, steps 1 (nothing queued) and 2 (the chunk's row 2: a trajectory controller holds them),
    drops the rest, ends the request in flight, and makes a request due at once; the
    abandoned request's chunk, if it still comes back, does not merge. next_chunk changes nothing."""
    spec = LatencySpec(horizon=6, n_action_steps=3)
    for rule in ("replan", "next_chunk"):
        chunking = ChunkingConfig(execute_steps=3, lead_steps=2, on_new_instruction=rule)
        p = LatencyProtocol(spec, chunking, use="eval", num_worlds=1, action_dim=1, max_delay=1, estimate="measured")
        one = torch.ones(1, dtype=torch.bool)
        p.open(one)
        p.take_asked()
        chunk = ActionChunk(torch.arange(6, dtype=torch.float32)[None, :, None], torch.zeros(1, dtype=torch.long))
        assert p.receive(chunk, one).tolist() == [True]
        p.next_action()  # step 0 runs
        p.open(one)  # a request at step 1, in flight
        p.new_instruction(one)
        _, queued, _ = p.executor.upcoming(6)
        if rule == "next_chunk":
            assert p.in_flight.tolist() == [True] and not p.due().any() and int(queued.sum()) > 2
            continue
        assert queued[0].tolist() == [False, True, False, False, False, False]
        assert p.in_flight.tolist() == [False] and p.due().tolist() == [True]
        late = ActionChunk(torch.full((1, 6, 1), 9.0), torch.ones(1, dtype=torch.long))
        assert p.receive(late, one).tolist() == [False]  # planned under the old instruction: never runs


def test_a_bad_rule_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--chunking.on_new_instruction=replan"):
        ChunkingConfig(on_new_instruction="later").validate()


def test_reach_switch_switches_once_in_its_range_and_every_observation_says_the_instruction_in_force():
    """Holding still for 24 steps (no ball within reach of a still hand): each world's observation names its first
    ball until the step S its schedule switches at (in 8..20), the other from S on; the privileged target follows."""
    from sim.config import EnvConfig
    from sim.mujoco_env import MujocoBatchedEnv
    from sim.tasks.reach_switch import ReachSwitchTask

    texts = ReachSwitchTask().instructions
    with MujocoBatchedEnv(EnvConfig(task="reach_switch", num_envs=8, cameras=[])) as env:
        obs = env.reset(seed=5)
        switch = [int(state["events"]["steps"][1]) for state in env.get_state()]  # past 10**9: no switch
        said, targets = [list(obs["task"])], [env.privileged_state()["instruction"][:, 0].copy()]
        for _ in range(24):
            obs, _, terminated, truncated, _ = env.step(env.hold_actions())
            assert not (terminated | truncated).any()
            said.append(list(obs["task"]))
            targets.append(env.privileged_state()["instruction"][:, 0].copy())
    assert 0 < sum(s < 10**9 for s in switch) < 8  # some switch, some keep their first instruction
    for world, at in enumerate(switch):
        first = texts.index(said[0][world])
        expected = [texts[1 - first] if at < 10**9 and t >= at else texts[first] for t in range(25)]
        assert [step[world] for step in said] == expected
        assert [texts[int(t[world])] for t in targets] == expected
        assert at >= 10**9 or 8 <= at <= 20


def test_reach_switch_succeeds_at_the_named_ball_and_fails_at_the_other():
    """A hand 1 cm from a ball: success when the instruction in force names it, failure (an end without success)
    when it names the other; 4 cm from both: neither. The env ends the failing episode, unsolved."""
    import mujoco

    from sim.batched_success import HostWorlds
    from sim.config import EnvConfig
    from sim.mujoco_env import MujocoBatchedEnv
    from sim.tasks.reach_switch import BALLS, instruction_qpos
    from sim.tasks.scene import place_mocap_body

    with MujocoBatchedEnv(EnvConfig(task="reach_switch", num_envs=3, cameras=[])) as env:
        env.reset(seed=0)
        model, task = env.model, env.task
        for world, (named, ball, offset) in enumerate([(0, "red", 0.01), (1, "red", 0.01), (1, "blue", 0.04)]):
            data = env.data[world]
            data.qpos[instruction_qpos(model)] = float(named)
            place_mocap_body(model, data, ball, data.site("grasp").xpos + [0.0, 0.0, offset])
            other = BALLS[1 - BALLS.index(ball)]
            place_mocap_body(model, data, other, data.site("grasp").xpos + [0.0, 0.15, 0.0])
            mujoco.mj_forward(model, data)
        worlds = HostWorlds(model, env.data)
        assert task.success(model, worlds).tolist() == [True, False, False]
        assert task.failure(model, worlds).tolist() == [False, True, False]
        # the env judges after its own step: world 1's hand-built state, stepped holding still
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        physics = np.empty(mujoco.mj_stateSize(model, spec))
        mujoco.mj_getState(model, env.data[1], physics, spec)
        state = env.get_state([0])[0]
        env.set_state([{**state, "physics": physics}], worlds=[0])
        _, _, terminated, _, info = env.step(env.hold_actions())
    assert terminated.tolist()[0] and not info["success"].tolist()[0]


@pytest.mark.parametrize("rule", ["replan", "next_chunk"])
def test_eval_records_each_switch_and_the_reaction_to_it(rule, tmp_path):
    """`vla-rl eval` of a random policy on reach_switch (chunks of 16 running 8, a fixed delay of 4): requests at
    0, 8, 16, ... until a switch at step S. replan meets it in exactly the delay, 4 steps; next_chunk at the next
    scheduled request's arrival, ceil(S / 8) * 8 + 4 - S (a request at S itself is already on the new instruction).
    Episodes that end before a row of the new plan runs have -1; the summary counts what switched."""
    import math

    from tiny_policies import save_lift_flow_policy

    from sim.config import EnvConfig
    from vla_rl.eval import EvalConfig, evaluate

    save_lift_flow_policy(tmp_path / "policy", image_size=32, horizon=16, n_action_steps=8)
    result = evaluate(EvalConfig(
        checkpoint=str(tmp_path / "policy"), num_episodes=8, video_episodes=0, seed=7,
        env=EnvConfig(task="reach_switch", num_envs=8, image_size=32, num_threads=1, render_threads=1),
        delay=DelayConfig(kind="fixed", steps=4), chunking=ChunkingConfig(on_new_instruction=rule),
        output_dir=str(tmp_path / rule)))  # fmt: skip
    switched = [e for e in result["per_episode"] if "switch_step" in e]
    assert switched and result["switch"]["episodes"] == len(switched)
    met = [e for e in switched if e["reaction_steps"] >= 0]
    assert met and result["switch"]["reacted"] == len(met)
    for e in met:
        s = e["switch_step"]
        assert e["reaction_steps"] == (4 if rule == "replan" else math.ceil(s / 8) * 8 + 4 - s), e


def test_runs_saved_before_the_rule_existed_resume_where_the_instruction_never_changes():
    """The rule is part of what a resumed evaluation must share only on a task whose instruction can change: there
    the two rules run differently; elsewhere they run alike, and a record saved before the field holds none."""
    from sim.config import EnvConfig
    from vla_rl.config_json import chunking_made_with
    from vla_rl.eval import EvalConfig, identity

    lift, switching = EvalConfig(env=EnvConfig(task="lift")), EvalConfig(env=EnvConfig(task="reach_switch"))
    assert "on_new_instruction" not in identity(lift, "sha")["chunking"]
    assert identity(switching, "sha")["chunking"]["on_new_instruction"] == ""  # the shell's own rule
    assert "on_new_instruction" in identity(EvalConfig(tasks=["lift", "reach_switch"]), "sha")["chunking"]
    assert chunking_made_with(ChunkingConfig(), ["lift"]) == {
        "execute_steps": 0,
        "merge": "latest",
        "ensemble_coeff": 0.01,
        "estimate_window": 4,
        "lead_steps": 0,
    }


def test_a_task_whose_events_are_drawn_for_one_control_period_refuses_another():
    """A switch moves the instruction joint by 1 over one control period of 0.05 s: at 10 substeps (0.02 s) it would
    stop at 0.4 and never switch, so the env is refused, naming the setting."""
    from sim.config import EnvConfig
    from sim.mujoco_env import MujocoBatchedEnv

    with pytest.raises(ValueError, match="--env.substeps=25"):
        MujocoBatchedEnv(EnvConfig(task="reach_switch", num_envs=1, cameras=[], substeps=10))


def test_the_sim_robot_refuses_a_task_whose_instruction_changes():
    """It publishes one instruction per run: a switching task would be served the wrong one half the time."""
    from sim.config import EnvConfig
    from vla_rl.sim_robot import SimRobotConfig, run_sim_robot

    with pytest.raises(ValueError, match="pick a task whose instruction stays"):
        run_sim_robot(SimRobotConfig(env=EnvConfig(task="reach_switch")))


def test_a_robot_follows_the_next_chunk_rule_and_refuses_replan():
    """The robot's shell does not react to a new instruction yet: its protocol takes "" (the shell's own rule) as
    next_chunk, where nothing changes at a switch, and refuses an explicit replan in one line; simulation's "" is
    replan."""
    spec = LatencySpec(horizon=6, n_action_steps=3)

    def protocol(rule: str, use: str) -> LatencyProtocol:
        chunking = ChunkingConfig(execute_steps=3, on_new_instruction=rule)
        return LatencyProtocol(spec, chunking, use=use, num_worlds=1, action_dim=1, estimate="measured")

    assert protocol("", "robot").on_new_instruction == "next_chunk"
    assert protocol("", "eval").on_new_instruction == protocol("", "finetune").on_new_instruction == "replan"
    with pytest.raises(ValueError, match="robot's shell does not react to a new instruction yet"):
        protocol("replan", "robot")
