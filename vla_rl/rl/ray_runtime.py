"""Asynchronous rollouts on Ray (``vla-rl finetune --runtime=ray``): workers keep collecting while the learner updates.

Layout: ``ray.num_workers`` rollout workers, each a Ray actor declaring ``ray.worker_cpus`` CPUs and
``ray.worker_gpus`` GPUs, with its own batch of ``env.num_envs`` worlds behind the same delay shell
as the local runtime (`vla_core.runtime.delayed_env.DelayedChunkEnv`: the latency protocol of
``vla-rl eval`` and of the robot), and its own copy of the policy and its RL actor. A worker sizes
itself from the resources Ray assigned it on its own node: its torch and render threads are its CPUs,
and with a GPU its policy copy runs there. The learner, the ``vla-rl finetune`` process, owns the
weights, the optimizer and the critic. Without ``--ray.address`` the run starts a local Ray instance
and stops it at the end; ``--ray.address`` (``auto``, ``host:port`` or ``ray://host:port``, as
``ray.init`` takes it) joins a running cluster instead, the same code. ``--ray.runtime_env`` is Ray's
runtime environment for the workers (``pip``, ``working_dir``, ``env_vars``); the renderer's
``MUJOCO_GL`` and ``PYOPENGL_PLATFORM`` are passed on from the learner's environment.

Versions: the learner's policy version counts its updates (a resumed run starts at its iteration).
A worker rolls out with the newest weights the learner has published when the rollout starts, and
every decision of that rollout carries that version (`Rollout.version`) and the per-denoising-step
log-probabilities of its decisions under those weights (`Rollout.behaviour_log_prob`).

Staleness, bounded and corrected. Bounded: the update that makes version v + 1 takes rollouts of
version >= v - ``max_staleness`` and drops older ones, counted (``dropped_rollouts`` in the history).
Corrected (decoupled PPO, Hilton et al. 2021; `vla_rl.rl.update.Anchors`): the update's ratios are
taken against the learner's weights at the start of the update (the proximal policy), so PPO's clip
bounds how far the update moves the policy, however old the data; a stale sample is weighted by
pi_prox / pi_behaviour per factor, truncated at ``rho_bar`` (1: a stale sample never weighs more
than a fresh one, whatever the sign of its advantage), and PPO's GAE traces its episode with the
same truncated weights of whole decisions (V-trace). ``staleness_kl`` and ``staleness_truncated``
in the history measure the staleness apart from the update's own ``approx_kl`` and ``clip_fraction``.

Flow: with ``max_staleness`` >= 1 a worker starts its next rollout the moment it hands one in, so it
collects while the learner updates; an update takes the first ``num_workers`` usable rollouts to
arrive. With ``max_staleness`` = 0 that overlap would make every rollout stale, so the workers wait
for each update and collect on-policy, in parallel.

Failures: a worker whose process dies (a crash, a lost node) is restarted by Ray up to
``ray.max_restarts`` times, and the rollout it had in flight is collected again with the same seeds,
by it or, once it is gone for good, by the next free worker (``worker_restarts`` in the history;
the interrupted rollouts in ``ray_timeline.json``). A worker that cannot start (the project missing
on a node, a failing import) ends the run before its first rollout with one line naming the fix.
Ray's ``ActorPool`` is not used: when a task fails it does not say which submission it was, so the
dead worker's rollout could not be collected again.

``ray_timeline.json`` in the run's directory records, for the run (or its resumed part), every
rollout's worker, node, version, wall-clock interval and CPU seconds, every update's interval, and
the rollouts lost (launched, their worker dead, never handed in).

Not reproducible bit for bit: which rollout arrives first depends on timing. A resumed run goes on
from its checkpoint with fresh workers.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from vla_core.files import write_text_atomic
from vla_rl.rl.rollout import Rollout, RolloutStats

WORKER_NAME_PREFIX = "vla-rl-rollout-"  # named actors, so a benchmark (or an operator) can find them
READY_TIMEOUT_S = 600.0  # a worker not started by then: the cluster lacks what the workers declare
RETRY_S = 1.0  # how often a restarting worker is asked whether it is back


@dataclass
class RayConfig:
    """Where the rollout workers run, what each declares, and how stale their data may be."""

    # What ray.init takes: "" = a local instance started for the run; auto, host:port or
    # ray://host:port join a running cluster.
    address: str = ""
    num_workers: int = 2  # rollout actors, each with env.num_envs worlds
    worker_cpus: float = 1.0  # CPUs each worker declares, and uses: its torch and render threads
    worker_gpus: float = 0.0  # GPUs each worker declares; > 0 runs its policy copy on its GPU
    max_restarts: int = 2  # times Ray restarts a dead worker; its rollout in flight is collected again
    # Ray's runtime_env for the workers (pip, working_dir, py_modules, env_vars), e.g.
    # '{"pip": ["vla-rl[sim]"]}' on a cluster whose nodes lack the project.
    runtime_env: dict[str, Any] = field(default_factory=dict)
    max_staleness: int = 1  # an update takes rollouts at most this many versions old (0 = synchronous)
    # The largest importance weight pi_now / pi_behaviour a stale sample gets in the update (V-trace's
    # rho-bar; decoupled PPO, `vla_rl.rl.update.Anchors`).
    rho_bar: float = 1.0

    def validate(self) -> None:
        if self.num_workers < 1 or self.max_staleness < 0:
            raise ValueError(
                f"--ray.num_workers must be >= 1 and --ray.max_staleness >= 0, got {self.num_workers}, {self.max_staleness}"
            )
        if not self.rho_bar > 0:
            raise ValueError(f"--ray.rho_bar must be > 0 (the largest weight of a stale sample), got {self.rho_bar}")
        if not self.worker_cpus > 0 or self.worker_gpus < 0 or self.max_restarts < 0:
            raise ValueError(
                f"--ray.worker_cpus must be > 0, --ray.worker_gpus and --ray.max_restarts >= 0, got "
                f"{self.worker_cpus}, {self.worker_gpus}, {self.max_restarts}"
            )


def usable(learner_version: int, rollout_version: int, max_staleness: int) -> bool:
    """Whether a rollout sampled at ``rollout_version`` may enter the update of ``learner_version``."""
    return learner_version - rollout_version <= max_staleness


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Raise ValueError naming the fix unless a TCP connection to ``address`` (host:port, or the
    client server of ray://host:port) opens. ``auto`` is left to ``ray.init``, which finds the
    cluster this machine belongs to or says it found none (`connect`)."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or address, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as err:
        start = "`ray start --head" + ("`" if address.startswith("ray://") else f" --port={port or 6379}`")
        raise ValueError(
            f"cannot reach the Ray cluster at --ray.address={address} ({err}); start it there with "
            f"{start}, or drop --ray.address to run on a local instance"
        ) from err


def runtime_env(cfg: RayConfig) -> dict[str, Any]:
    """``cfg.runtime_env`` with the learner's headless-rendering variables added to its env_vars."""
    env = copy.deepcopy(cfg.runtime_env)
    passed = {k: os.environ[k] for k in ("MUJOCO_GL", "PYOPENGL_PLATFORM") if k in os.environ}
    env["env_vars"] = {**passed, **env.get("env_vars", {})}
    return env


def connect(cfg: RayConfig) -> bool:
    """Join ``cfg.address`` or start a local instance (unless this process already joined one); returns
    whether this call connected (the caller then disconnects at the end; a started local instance stops
    with it). A cluster that does not answer raises one line naming the fix."""
    import ray

    if ray.is_initialized():
        return False
    from vla_core import interrupt

    try:
        # ray.init leaves a SIGTERM handler of its own; the command's stop handling (a checkpoint at the
        # iteration boundary, exit 128 + signal) must stay.
        with interrupt.kept():
            if cfg.address:
                ray.init(address=cfg.address, runtime_env=runtime_env(cfg), log_to_driver=False)
            else:
                cpus = max(os.cpu_count() or 1, math.ceil(cfg.num_workers * cfg.worker_cpus))
                # "local": a new instance even when this machine's `ray start` left an address file behind.
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                         runtime_env=runtime_env(cfg))  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ValueError(
            f"cannot join the Ray cluster at --ray.address={cfg.address or '(local)'}: {_first_line(err)}; start "
            "one with `ray start --head` (and `ray start --address=<head>:6379` on each other node), or drop "
            "--ray.address to run on a local instance"
        ) from err
    return True


def check_capacity(cfg: RayConfig, total: dict[str, float], learners: int = 1) -> None:
    """Refuse workers the cluster (``total``: ``ray.cluster_resources()``) could never place all at once,
    ``cfg.num_workers`` for each of ``learners`` learner processes."""
    need = {"CPU": learners * cfg.num_workers * cfg.worker_cpus, "GPU": learners * cfg.num_workers * cfg.worker_gpus}
    for kind, amount in need.items():
        if amount > total.get(kind, 0.0) + 1e-9:
            each = f" for each of {learners} learner processes" if learners > 1 else ""
            raise ValueError(
                f"the Ray cluster has {total.get(kind, 0.0):g} {kind}s but --ray.num_workers={cfg.num_workers} workers "
                f"of --ray.worker_{kind.lower()}s={getattr(cfg, f'worker_{kind.lower()}s'):g}{each} need {amount:g}; "
                "add nodes, or lower either flag"
            )


def _first_line(err: BaseException) -> str:
    """The line of a (remote) traceback that names the exception, e.g. "ModuleNotFoundError: No module named 'sim'"."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return (named[-1] if named else lines[0] if lines else type(err).__name__)[:300]


class RolloutWorker:
    """One rollout worker (made a Ray actor by `AsyncRollouts`): an env batch, its delay shell, a policy copy,
    sized by the resources Ray assigned it."""

    def __init__(
        self, policy, env_config, chunking, delay_config, delay_stream: int, gamma: float, noise, version: int,
        privileged: bool = False,
    ):  # fmt: skip
        import ray

        from sim.factory import make_env
        from vla_core.runtime import DelayModel, LatencySpec
        from vla_core.runtime.delayed_env import DelayedChunkEnv

        context = ray.get_runtime_context()
        assigned = context.get_assigned_resources()
        self.threads = max(1, int(assigned.get("CPU", 1)))
        torch.set_num_threads(self.threads)
        self.device = "cuda" if assigned.get("GPU", 0) > 0 else "cpu"
        self.node = context.get_node_id()
        self.policy = policy.to(self.device).eval()
        self.env = make_env(replace(env_config, render_threads=env_config.render_threads or self.threads))
        delay = DelayModel(delay_config, control_dt=self.env.control_dt, stream=delay_stream)
        spec = LatencySpec.of(policy)
        self.shell = DelayedChunkEnv(self.env, spec, chunking, delay, use="finetune")
        self.gamma = gamma  # the credit windows' discount per control step
        self.privileged = privileged  # record the simulator's privileged state for an asymmetric critic
        self.actor = policy.rl_actor(noise, augmentation_width=self.shell.protocol.width)
        self.version = version  # of the weights it holds: the ones it was built with, until new ones come
        self.collected = 0  # rollouts this process finished

    def ready(self) -> dict[str, Any]:
        """Where it runs: its node, threads and device (answered once it is built)."""
        return {"node": self.node, "threads": self.threads, "device": self.device, "pid": os.getpid()}

    def collect(self, version: int, weights: dict | None, seed, episodes_per_world: int, sampling_seed: int):
        """Roll out with the weights of ``version`` (``weights`` when they are new to this worker). Returns
        the rollout, its stats and its timing (wall-clock interval, CPU seconds of this process). The
        rollout carries the version of the weights that sampled it: after Ray restarted this worker
        between two rollouts it holds the weights it was built with, whatever the learner thought."""
        from vla_rl.rl.rollout import collect
        from vla_rl.rl.update import batched_score

        started, cpu = time.time(), time.process_time()
        if weights is not None:
            self.policy.load_state_dict(weights)
            self.version = version
        torch.manual_seed(sampling_seed)
        rollout, stats = collect(self.actor, self.shell, episodes_per_world=episodes_per_world, seed=seed,
                                 gamma=self.gamma, privileged=self.privileged)  # fmt: skip
        rollout.version = torch.full((len(rollout),), self.version, dtype=torch.long)
        rollout.behaviour_log_prob = batched_score(self.actor, rollout, 64)
        timing = {"node": self.node, "pid": os.getpid(), "started": started, "ended": time.time(),
                  "cpu_seconds": time.process_time() - cpu}  # fmt: skip
        self.collected += 1
        return rollout, stats, timing

    def rollouts_collected(self) -> int:
        """Rollouts this process finished (a call queued behind a running rollout answers after it)."""
        return self.collected

    def close(self) -> None:
        self.env.close()


class AsyncRollouts:
    """The learner's side: starts the workers, hands out seeds and weights, collects usable rollouts,
    re-collects those of dead workers.

    seeds(launch) -> (reset seed, episodes_per_world, sampling seed) of the launch-th rollout since
    the run started or resumed (every launch its own seeds, as the local runtime's iterations have).
    """

    def __init__(self, policy, cfg, gamma: float, version: int, seeds, learner: tuple[int, int] = (0, 1)):
        import ray

        ray_cfg = cfg.ray
        self.ray, self.cfg, self.seeds, self.num_envs = ray, ray_cfg, seeds, cfg.env.num_envs
        self.started_ray = connect(ray_cfg)
        index, learners = learner  # this learner process, of a data-parallel run's (each its own workers)
        try:
            check_capacity(ray_cfg, ray.cluster_resources(), learners)
            worker = ray.remote(num_cpus=ray_cfg.worker_cpus, num_gpus=ray_cfg.worker_gpus,
                                max_restarts=ray_cfg.max_restarts)(RolloutWorker)  # fmt: skip
            # Kept referenced for the run: a restarted worker is built again from it.
            self.initial_policy = copy_on_cpu = ray.put(copy.deepcopy(policy).to("cpu"))
            # Each worker its own delay stream, a new one on resume (version = the iteration resumed at).
            streams = [1 + i + 1000 * version + 1_000_000_000 * index for i in range(ray_cfg.num_workers)]
            run = uuid.uuid4().hex[:8]
            self.workers = [
                worker.options(name=f"{WORKER_NAME_PREFIX}{run}-{i}").remote(
                    copy_on_cpu,
                    cfg.env,
                    cfg.chunking,
                    cfg.delay,
                    stream,
                    gamma,
                    cfg.noise,
                    version,
                    cfg.algo == "ppo" and cfg.ppo.privileged_critic,
                )
                for i, stream in enumerate(streams)
            ]
            self.placement = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.initial_version = self.version = version
        self.worker_version = [version] * len(self.workers)  # the weights each worker holds
        self.alive = [True] * len(self.workers)
        self.probes: dict[Any, int] = {}  # ObjectRef of a `ready` call -> the restarting worker it asks
        self.probe_due: list[tuple[float, int]] = []  # (when, worker): the next ask of a restarting worker
        # The process behind each worker: a new one means Ray restarted it.
        self.processes = [(p["node"], p["pid"]) for p in self.placement]
        self.weights = None  # ObjectRef of the newest published weights
        self.launches = 0
        self.in_flight: dict[Any, tuple[int, int]] = {}  # ObjectRef of a rollout -> (its worker, its launch)
        self.idle: list[int] = []
        self.orphans: list[int] = []  # interrupted launches, for the next free worker
        self.timeline: dict[str, list] = {"rollouts": [], "updates": [], "interrupted": [], "restarts": []}
        self.update_started = 0.0
        for i in range(len(self.workers)):
            self._launch(i)

    def _wait_ready(self) -> list[dict[str, Any]]:
        """Every worker's placement once it is built; one line naming the fix if one cannot start."""
        ray = self.ray
        try:
            return ray.get([w.ready.remote() for w in self.workers], timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            raise ValueError(
                f"the rollout workers did not start within {READY_TIMEOUT_S:.0f} s; the cluster cannot place "
                "--ray.num_workers workers of --ray.worker_cpus / --ray.worker_gpus (see `ray status`)"
            ) from err
        except ray.exceptions.RayError as err:
            raise ValueError(
                f"a rollout worker failed to start: {_first_line(err)}; every Ray node needs vla-rl and its "
                "extras installed (pip install there, or ship them with "
                '--ray.runtime_env=\'{"pip": [...]}\' or \'{"working_dir": "."}\')'
            ) from err

    def _launch(self, i: int, launch: int | None = None) -> None:
        """Worker ``i`` collects ``launch`` (a dead worker's, collected again) or the next new launch."""
        if launch is None and self.orphans:
            launch = self.orphans.pop(0)
        elif launch is None:
            launch, self.launches = self.launches, self.launches + 1
        weights = self.weights if self.worker_version[i] != self.version else None
        seed, episodes, sampling_seed = self.seeds(launch)
        ref = self.workers[i].collect.remote(self.version, weights, seed, episodes, sampling_seed)
        self.worker_version[i] = self.version
        self.in_flight[ref] = (i, launch)

    def _failed(self, i: int, err: BaseException, launch: int | None = None) -> None:
        """Worker ``i`` failed (with ``launch`` in flight, or answering a probe). The launch is collected
        again, with its seeds, by the next free worker. Restarting (Ray's ``ActorUnavailableError``): the
        worker is asked every ``RETRY_S`` whether it is back, with the weights it was built with. Dead for
        good (its restarts spent): the others go on without it."""
        if launch is not None:
            self.timeline["interrupted"].append(
                {"worker": i, "launch": launch, "at": time.time(), "error": _first_line(err)}
            )
            self.orphans.append(launch)
        if isinstance(err, self.ray.exceptions.ActorUnavailableError):
            self.worker_version[i] = self.initial_version
            self.probe_due.append((time.time() + RETRY_S, i))
        else:
            self.alive[i] = False
            if not any(self.alive):
                raise RuntimeError(
                    f"every rollout worker died ({_first_line(err)}); see the workers' logs with `ray logs` on "
                    "the cluster, and resume with --resume=true once it is healthy (the last checkpoint is intact)"
                ) from err
        if self.orphans and self.idle:  # on-policy: a waiting worker takes it now
            self._launch(self.idle.pop(0))

    def _free(self, i: int, dropped: bool = False) -> None:
        """Worker ``i`` has nothing in flight. It collects an interrupted launch if one waits; otherwise,
        asynchronous, its next rollout; synchronous, it waits for the update, unless the rollout it just
        handed in was dropped as stale (then the batch still needs one, and a new one is on-policy)."""
        if self.orphans or self.cfg.max_staleness >= 1 or dropped:
            self._launch(i)
        else:
            self.idle.append(i)

    def _note_process(self, i: int, answer: dict[str, Any]) -> None:
        """Worker ``i`` answered from process (node, pid): a new one means Ray restarted it (also when it died
        between two rollouts, with nothing in flight)."""
        process = (answer["node"], answer["pid"])
        if process != self.processes[i]:
            self.timeline["restarts"].append({"worker": i, "at": time.time(), "node": process[0], "pid": process[1]})
            self.processes[i] = process
            self.worker_version[i] = self.initial_version  # it was built again: its next launch gets the weights

    def _back(self, i: int, answer: dict[str, Any]) -> None:
        """Restarting worker ``i`` answered its probe: it is back."""
        self._note_process(i, answer)
        self._free(i)

    def _next_ready(self) -> tuple[Any | None, bool]:
        """The next rollout or probe answer to arrive (ref, whether a probe), probing restarting workers when
        due; (None, False) when a probe fell due first."""
        now = time.time()
        for _, i in [d for d in self.probe_due if d[0] <= now]:
            self.probes[self.workers[i].ready.remote()] = i
        self.probe_due = [d for d in self.probe_due if d[0] > now]
        waiting = [*self.in_flight, *self.probes]
        timeout = min((when for when, _ in self.probe_due), default=math.inf) - now
        if not waiting:
            if math.isinf(timeout):
                raise RuntimeError("no rollout in flight and no restarting worker to ask: the batch cannot fill")
            time.sleep(max(0.0, timeout))
            return None, False
        ready, _ = self.ray.wait(waiting, num_returns=1, timeout=None if math.isinf(timeout) else max(0.0, timeout))
        return (ready[0], ready[0] in self.probes) if ready else (None, False)

    def next_batch(self) -> tuple[Rollout, list[RolloutStats], dict[str, Any]]:
        """The next update's rollouts: one per live worker, the first usable ones to arrive. Returns them
        concatenated (each rollout's worlds numbered after the previous one's), the stats of every
        rollout handed in (dropped ones too: their env steps were spent) and the bookkeeping."""
        parts: list[Rollout] = []
        stats: list[RolloutStats] = []
        dropped, restarts = 0, len(self.timeline["restarts"])
        while len(parts) < sum(self.alive):
            ref, probe = self._next_ready()
            if ref is None:
                continue
            i, launch = (self.probes.pop(ref), None) if probe else self.in_flight.pop(ref)
            try:
                answer = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as err:
                self._failed(i, err, launch)
                continue
            if probe:
                self._back(i, answer)
                continue
            rollout, st, timing = answer
            self._note_process(i, timing)
            stats.append(st)
            use = usable(self.version, int(rollout.version[0]), self.cfg.max_staleness)
            if use:
                parts.append(rollout)
            else:
                dropped += 1
            self.timeline["rollouts"].append({"launch": launch, "worker": i, "version": int(rollout.version[0]),
                                              "used": use, "env_steps": st.env_steps, **timing})  # fmt: skip
            self._free(i, dropped=not use)  # asynchronous: collects while the learner updates
        batch = Rollout.cat(parts, self.num_envs)
        versions = batch.version
        info = {"policy_version": self.version, "dropped_rollouts": dropped,
                "data_version_min": int(versions.min()), "data_version_max": int(versions.max()),
                "worker_restarts": len(self.timeline["restarts"]) - restarts}  # fmt: skip
        self.update_started = time.time()
        return batch, stats, info

    def publish(self, policy) -> None:
        """The learner's new weights: version + 1, taken by every rollout launched from now on."""
        self.timeline["updates"].append({"version": self.version, "started": self.update_started, "ended": time.time()})
        self.version += 1
        self.weights = self.ray.put({k: v.detach().to("cpu") for k, v in policy.state_dict().items()})
        while self.idle:
            self._launch(self.idle.pop(0))

    def lost(self) -> list[int]:
        """Launches interrupted by a failed worker and not handed in since: at the end of a run, the ones whose
        env steps vanished (still waiting, or being collected again, when the run ended)."""
        died = {d["launch"] for d in self.timeline["interrupted"]}
        return sorted(died - {r["launch"] for r in self.timeline["rollouts"]})

    def write_timeline(self, path: Path, first_iteration: int) -> None:
        timeline = {"first_iteration": first_iteration, "workers": self.placement,
                    "nodes": len({p["node"] for p in self.placement}), "lost_rollouts": self.lost(),
                    **self.timeline}  # fmt: skip
        write_text_atomic(path, json.dumps(timeline, indent=1))

    def close(self) -> None:
        for w in getattr(self, "workers", []):
            self.ray.kill(w)
        self.workers = []
        if self.started_ray:
            self.ray.shutdown()
