"""Camera images rendered on several threads or worker processes: the same frames as one thread, and as
`env.render`."""

import numpy as np
import pytest
import torch

from sim.config import EnvConfig
from sim.mujoco_env import MujocoBatchedEnv
from vla_core.types import OBS_STATE

IMAGE = "observation.images.front"


def _actions(env, t):
    """(N, 4) moves that differ per world and step, so the worlds' frames differ."""
    offsets = 0.03 * np.sin(np.arange(env.num_envs)[:, None] + t + np.arange(3)[None, :])
    grip = np.full((env.num_envs, 1), t % 2, dtype=np.float64)
    return torch.from_numpy(np.concatenate([env.ee_positions() + offsets, grip], axis=1))


def test_threaded_frames_equal_one_thread_frames_through_resets():
    """5 worlds on 3 threads (uneven slices) against 1 thread, over steps that end episodes:
    every image of every observation is bit-identical."""
    cfg = {"num_envs": 5, "max_episode_steps": 3}
    with (
        MujocoBatchedEnv(EnvConfig(**cfg, render_threads=1, render_isolation="thread")) as serial,
        MujocoBatchedEnv(EnvConfig(**cfg, render_threads=3, render_isolation="thread")) as threaded,
    ):
        assert torch.equal(serial.reset(seed=4)[IMAGE], threaded.reset(seed=4)[IMAGE])
        ended = torch.zeros(5, dtype=torch.bool)
        for t in range(5):
            a = _actions(serial, t)
            obs_s, _, _, trunc, info_s = serial.step(a)
            obs_t, _, _, _, info_t = threaded.step(a)
            assert torch.equal(obs_s[IMAGE], obs_t[IMAGE])
            assert torch.equal(info_s["final_obs"][IMAGE], info_t["final_obs"][IMAGE])
            ended |= trunc
        assert ended.all()  # step 3 ended every episode, so resets were observed too


def test_images_are_the_worlds_frames_over_255():
    """Each world's image is its own frame (rendered alone, on the caller's thread, through
    `env.render`) as float32 channels-first in [0, 1]."""
    with MujocoBatchedEnv(EnvConfig(num_envs=4, render_threads=2)) as env:
        env.reset(seed=1)
        obs, *_ = env.step(_actions(env, 0))
        for world in range(4):
            frame = env.render(world, "front", size=64)  # (64, 64, 3) uint8
            expected = torch.tensor(frame, dtype=torch.float32).permute(2, 0, 1) / 255.0
            assert torch.equal(obs[IMAGE][world], expected)
        assert not torch.equal(obs[IMAGE][0], obs[IMAGE][1])  # different worlds, different frames


def test_only_reset_worlds_are_observed_again():
    """Worlds 1-2 end their episode, world 0 (reset one step later) does not: the returned
    observation keeps world 0's final frame and shows the fresh episodes of worlds 1-2."""
    with MujocoBatchedEnv(EnvConfig(num_envs=3, max_episode_steps=2, render_threads=2)) as env:
        env.reset(seed=0)
        env.step(_actions(env, 0))
        env.reset(seed=[7], worlds=[0])
        obs, _, _, trunc, info = env.step(_actions(env, 1))
        assert trunc.tolist() == [False, True, True]
        final = info["final_obs"]
        fresh = env._observe()  # every world as it is now, rendered in full
        for key in (IMAGE, OBS_STATE):
            assert torch.equal(obs[key], fresh[key])
            assert torch.equal(obs[key][0], final[key][0])
            assert not torch.equal(obs[key][1:], final[key][1:])  # the new episodes, not the ended ones
        assert obs[IMAGE].data_ptr() != final[IMAGE].data_ptr()  # final_obs is not overwritten


def test_negative_render_threads_and_an_unknown_isolation_are_refused_with_the_flag():
    with pytest.raises(ValueError, match=r"--env.render_threads must be >= 0"):
        MujocoBatchedEnv(EnvConfig(num_envs=2, render_threads=-1))
    with pytest.raises(ValueError, match=r"--env.render_isolation must be thread or process, got 'threads'"):
        MujocoBatchedEnv(EnvConfig(num_envs=2, render_isolation="threads"))


@pytest.mark.parametrize("variation", ["", "colour"])
def test_frames_rendered_in_worker_processes_equal_threads_and_survive_a_killed_worker(variation):
    """5 worlds in 2 render worker processes (`--env.render_isolation=process`) against 1 thread, over steps that
    end episodes (with a variation, each world's own colours): every image is bit-identical. A worker killed by
    SIGSEGV (what a driver crash is) and one killed by SIGKILL between steps are each started again, one line on
    stderr names the signal, and the next observation's frames are still the thread's."""
    import os
    import signal

    cfg = {"num_envs": 5, "max_episode_steps": 3, "variation": variation, "task": "lift"}
    with (
        MujocoBatchedEnv(EnvConfig(**cfg, render_threads=1, render_isolation="thread")) as serial,
        MujocoBatchedEnv(EnvConfig(**cfg, render_threads=2, render_isolation="process")) as isolated,
    ):
        assert torch.equal(serial.reset(seed=4)[IMAGE], isolated.reset(seed=4)[IMAGE])
        workers = isolated._camera_renderers
        for t, kill in enumerate([None, signal.SIGSEGV, None, signal.SIGKILL, None]):
            if kill is not None:
                os.kill(workers._workers[t % 2][0].pid, kill)
            a = _actions(serial, t)
            obs_s, _, _, _, info_s = serial.step(a)
            obs_p, _, _, _, info_p = isolated.step(a)
            assert torch.equal(obs_s[IMAGE], obs_p[IMAGE])
            assert torch.equal(info_s["final_obs"][IMAGE], info_p["final_obs"][IMAGE])
        assert workers.restarts == isolated.render_restarts == 2 and serial.render_restarts == 0  # threads: none
    assert workers._workers == []  # closed with the env


def test_a_worker_that_dies_on_every_request_stops_the_run_naming_the_fix(capfd):
    """A worker that dies again and again on one request is no rare crash: dying again after 3 restarts in a row,
    the call raises, naming the signal and --env.render_isolation=thread."""
    import os
    import signal

    import mujoco

    from sim.render import MAX_RESTARTS_IN_A_ROW, ProcessRenderers

    env = MujocoBatchedEnv(EnvConfig(num_envs=2, task="lift", cameras=[]))
    renderers = ProcessRenderers(env.model, 1)
    start = renderers._start

    def doomed():  # every worker started from now on is killed before it answers
        process, conn = start()
        os.kill(process.pid, signal.SIGKILL)
        return process, conn

    try:
        os.kill(renderers._workers[0][0].pid, signal.SIGKILL)
        renderers._start = doomed
        with pytest.raises(RuntimeError, match=r"died again after 3 restarts in a row .*signal SIGKILL.*"
                                               r"render_isolation=thread"):  # fmt: skip
            renderers.frames([mujoco.MjData(env.model)], "front", 16, np.empty((1, 16, 16, 3), np.uint8))
        assert renderers.restarts == MAX_RESTARTS_IN_A_ROW == 3
        assert capfd.readouterr().err.count("died (signal SIGKILL); started again") == MAX_RESTARTS_IN_A_ROW
    finally:
        renderers._start = start
        renderers.close()
        env.close()


def test_a_failed_request_leaves_no_answer_for_the_next_one():
    """A request one worker fails (a camera the scene lacks) raises; the other worker's answer to it is dropped with
    that worker, so the next request's frames are the next request's (those `ParallelRenderers` renders)."""
    from sim.render import ParallelRenderers, ProcessRenderers

    env = MujocoBatchedEnv(EnvConfig(num_envs=4, task="lift", cameras=[]))
    env.reset(seed=2)
    datas = env.data[:4]
    isolated, threads = ProcessRenderers(env.model, 2), ParallelRenderers(env.model, 1)
    try:
        with pytest.raises(RuntimeError, match="render worker 0 failed"):
            isolated.frames(datas, "no_such_camera", 16, np.empty((4, 16, 16, 3), np.uint8))
        frames = isolated.frames(datas, "front", 16, np.empty((4, 16, 16, 3), np.uint8))
        assert np.array_equal(frames, threads.frames(datas, "front", 16, np.empty((4, 16, 16, 3), np.uint8)))
    finally:
        isolated.close()
        threads.close()
        env.close()
