"""What `vla-rl eval` runs and keeps: the plan of its episodes, round by round, and its record on disk, which
an interrupted evaluation resumes from.

The plan. Every world runs one episode per round, all worlds reset together, so a round's episodes
sample from one stream of policy noise whatever ran before.
- Without a protocol, round r resets every world with the batch seed ``seed + r`` and the first
  ``num_episodes - r * N`` worlds count (what `vla-rl eval` always did).
- With ``draws_per_state`` D > 1 (the best of D), initial state k (k = 0, 1, ...) is run D times, each with
  its own policy noise: its D worlds are reset with the one world seed ``seed + k`` (equal seeds, equal
  episodes: the same layout, and on a task with scheduled events the same events), filled in order.
- Under a LIBERO protocol (`sim.libero_protocol`) each task runs exactly ``episodes_per_task`` episodes,
  episode i from the task's fixed initial state i. A world keeps its task (a LIBERO world is one task's
  scene): in round r the worlds of a task take its next episodes in order, and a world whose task has
  none left runs uncounted. Rounds: the largest ceil(episodes_per_task / worlds of a task); with N a
  multiple of the suite's task count every world is busy to the end.

The record, in the output directory:
- ``episodes.jsonl``: one line per finished episode, appended as it finishes (round, world, task, seed
  or initial state, success, length, requests: the chunks it asked for);
- ``eval_progress.pt``: after each whole round, the rounds done and every random state the next
  round reads (torch's, the delay model's, the measured lags), written atomically;
- ``eval.json``: the result, written at the end.
``--resume=true`` keeps the episodes of the rounds done, drops those of the round that was cut, restores
the states and goes on: the same episodes, with the same outcomes, as a run that was never stopped. A
record written under another config is refused with one line.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vla_core.files import write_bytes_atomic, write_text_atomic

EPISODES = "episodes.jsonl"
PROGRESS = "eval_progress.pt"
RESULT = "eval.json"
RECORD_VERSION = 1  # of episodes.jsonl and eval_progress.pt; another one is refused on resume


@dataclass
class Round:
    """One round: the reset seed (one int for the batch, or one per world) and, per world, its episode
    (a dict of what identifies it) or None when the world runs uncounted."""

    seed: int | list[int]
    episodes: list[dict[str, Any] | None]


class EpisodePlan:
    """The rounds of an evaluation (see the module doc)."""

    def __init__(self, rounds: list[Round]):
        self.rounds = rounds

    @classmethod
    def seeded(cls, num_episodes: int, num_worlds: int, seed: int) -> EpisodePlan:
        """Round r: batch seed ``seed + r``; worlds below the episodes still wanted count."""
        rounds = []
        for r in range(math.ceil(num_episodes / num_worlds)):
            want = min(num_worlds, num_episodes - r * num_worlds)
            rounds.append(Round(seed + r, [{"seed": seed + r} if w < want else None for w in range(num_worlds)]))
        return cls(rounds)

    @classmethod
    def repeated(cls, num_states: int, draws: int, num_worlds: int, seed: int) -> EpisodePlan:
        """Initial state k (world seed ``seed + k``: one world's own seed, not a batch seed, so state k is none of a
        seeded plan's episodes) run ``draws`` times, the states in order, ``num_worlds`` episodes a round; a world
        without an episode left in the last round repeats state 0 uncounted."""
        plan = [(k, j) for k in range(num_states) for j in range(draws)]
        rounds = []
        for start in range(0, len(plan), num_worlds):
            batch = plan[start : start + num_worlds]
            episodes = [{"world_seed": seed + k, "initial_state": k, "draw": j} for k, j in batch]
            pad = num_worlds - len(batch)
            rounds.append(Round([seed + k for k, _ in batch] + [seed] * pad, episodes + [None] * pad))
        return cls(rounds)

    @classmethod
    def per_task(cls, world_tasks: list[int], task_names: list[str], episodes_per_task: int) -> EpisodePlan:
        """``episodes_per_task`` episodes of every task, episode i from initial state i; ``world_tasks``
        (N,) each world's task, an index into ``task_names``. A world without an episode is reset to its
        task's state 0 (any state would do: it is not counted)."""
        missing = sorted(set(range(len(task_names))) - set(world_tasks))
        if missing:
            raise ValueError(
                f"no world runs task(s) {[task_names[t] for t in missing]}: raise --env.num_envs to at least "
                f"{len(task_names)}, a multiple of the suite's {len(task_names)} tasks"
            )
        taken = dict.fromkeys(range(len(task_names)), 0)
        rounds = []
        while any(n < episodes_per_task for n in taken.values()):
            seeds, episodes = [], []
            for t in world_tasks:
                if taken[t] < episodes_per_task:
                    state = taken[t]
                    taken[t] += 1
                    episodes.append({"task": task_names[t], "initial_state": state})
                else:
                    state = 0
                    episodes.append(None)
                seeds.append(state)
            rounds.append(Round(seeds, episodes))
        return cls(rounds)

    @property
    def num_episodes(self) -> int:
        return sum(e is not None for r in self.rounds for e in r.episodes)

    def episode_numbers(self, r: int) -> list[int]:
        """(N,) the number of each world's episode in round ``r``: the counted episodes numbered from 0 in
        plan order (round by round, world by world; r * N + w for a seeded plan), -1 for an uncounted world.
        A trace delay and per-request noise are looked up by it (`vla_core.runtime.delayed_env`)."""
        before = sum(e is not None for earlier in self.rounds[:r] for e in earlier.episodes)
        numbers = []
        for episode in self.rounds[r].episodes:
            numbers.append(-1 if episode is None else before)
            before += episode is not None
        return numbers


def best_of_draws(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """What the best of D draws per initial state would reach (``--draws_per_state``): ``episodes`` each with its
    ``initial_state`` and ``success``. Returns states, draws, mean (success over every episode), best_of_draws (the
    share of states with at least one success), states_never (with none), headroom_points (best minus mean, in
    points: what choosing among these D samples of the policy would add; more samples could add more), per_state
    (successes per state)."""
    per_state: dict[int, list[bool]] = {}
    for e in episodes:
        per_state.setdefault(int(e["initial_state"]), []).append(bool(e["success"]))
    draws = {len(v) for v in per_state.values()}
    if len(draws) != 1:
        raise ValueError(f"every initial state needs the same number of draws, got {sorted(draws)}")
    wins = [sum(v) for _, v in sorted(per_state.items())]
    d = draws.pop()
    mean = sum(wins) / (d * len(wins))
    best = sum(w > 0 for w in wins) / len(wins)
    return {"states": len(wins), "draws": d, "mean": mean, "best_of_draws": best,
            "states_never": sum(w == 0 for w in wins), "headroom_points": round(100 * (best - mean), 1),
            "per_state": wins}  # fmt: skip


def _parsed(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def random_state(delay, protocol, delays_seen: dict[int, int]) -> dict[str, Any]:
    """Every state an evaluation round reads or adds to: torch's random state (CPU and CUDA), the delay
    model's generators, the measured lags the delay estimate keeps across episodes (with the lead they count),
    and the count of chunks per delay so far."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda, "delay": delay.state_dict(), "lags": protocol.saved_lags(),
            "delays_seen": dict(delays_seen)}  # fmt: skip


def load_random_state(state: dict[str, Any], delay, protocol, delays_seen: dict[int, int], source: str) -> None:
    """Give back what `random_state` saved (``delays_seen`` is filled in place); ``source`` names the file."""
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    delay.load_state_dict(state["delay"])
    protocol.restore_lags(state["lags"], source)
    delays_seen.update(state["delays_seen"])


def occupied(out: Path) -> FileExistsError:
    """The one-line refusal of an evaluation into a folder that holds one."""
    return FileExistsError(
        f"{out} holds an evaluation already; pass --resume=true to go on with it, --overwrite=true to evaluate "
        "again over it, or choose another --output_dir"
    )


class EvalRecord:
    """The record of one evaluation in ``out`` (see the module doc). ``identity``: what must match for a
    record to be resumed (the config without what does not change the episodes)."""

    def __init__(self, out: Path, identity: dict[str, Any], resume: bool, overwrite: bool):
        self.out, self.identity = out, identity
        self.episodes_path, self.progress_path = out / EPISODES, out / PROGRESS
        self.rounds_done, self.episodes, self.saved_state = 0, [], None
        if resume:
            self._load()
        elif self.episodes_path.exists() or self.progress_path.exists() or (out / RESULT).exists():
            if not overwrite:
                raise occupied(out)
            for name in (PROGRESS, RESULT, "summary.md", "rollouts.mp4"):  # nothing of the old run is left
                (out / name).unlink(missing_ok=True)
        if not self.episodes:
            out.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.episodes_path, "")

    def _load(self) -> None:
        if (self.out / RESULT).exists() and not self.progress_path.exists():
            raise FileExistsError(f"{self.out} holds a finished evaluation ({RESULT}); choose another --output_dir")
        if not self.progress_path.exists():
            return  # nothing saved yet (stopped in its first round): start from the beginning
        saved = torch.load(self.progress_path, weights_only=False)
        if saved.get("version") != RECORD_VERSION:
            raise ValueError(
                f"{self.progress_path} was written by another version of vla-rl eval (record version "
                f"{saved.get('version')}, this one reads {RECORD_VERSION}); evaluate into another --output_dir"
            )
        if saved["identity"] != self.identity:
            changed = sorted(k for k in self.identity.keys() | saved["identity"].keys()
                             if self.identity.get(k) != saved["identity"].get(k))  # fmt: skip
            raise ValueError(
                f"{self.out} holds an evaluation of another config (differs in {', '.join(changed)}); resume it "
                "with its own flags (see its eval_progress.pt) or choose another --output_dir"
            )
        self.rounds_done, self.saved_state = saved["rounds_done"], saved["random_state"]
        lines = self.episodes_path.read_text().splitlines() if self.episodes_path.exists() else []
        # Lines of the round that was cut are dropped (a line cut short by the stop can only be one of
        # them): that round runs again, whole.
        self.episodes = [e for e in map(_parsed, lines) if e is not None and e["round"] < self.rounds_done]
        write_text_atomic(self.episodes_path, "".join(json.dumps(e) + "\n" for e in self.episodes))

    def check_rounds(self, plan: EpisodePlan) -> None:
        """The episodes kept are all those of the rounds done (a record whose lines were lost is refused)."""
        expected = sum(e is not None for r in plan.rounds[: self.rounds_done] for e in r.episodes)
        if len(self.episodes) != expected or self.rounds_done > len(plan.rounds):
            raise ValueError(
                f"{self.episodes_path} holds {len(self.episodes)} episodes of the {self.rounds_done} rounds done, "
                f"which ran {expected}: the record is damaged; evaluate again with --overwrite=true"
            )

    def append(self, episode: dict[str, Any]) -> None:
        """One finished episode: kept, and appended to episodes.jsonl at once (on the disk before the round's
        progress can name it)."""
        self.episodes.append(episode)
        with open(self.episodes_path, "a") as f:
            f.write(json.dumps(episode) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def round_done(self, rounds_done: int, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save({"version": RECORD_VERSION, "identity": self.identity, "rounds_done": rounds_done,
                    "random_state": state}, buffer)  # fmt: skip
        write_bytes_atomic(self.progress_path, buffer.getvalue())
        self.rounds_done = rounds_done

    def finished(self) -> None:
        """The result is written: nothing is left to resume."""
        self.progress_path.unlink(missing_ok=True)


PROVENANCE_PACKAGES = ("vla-rl", "torch", "numpy", "mujoco", "gymnasium", "lerobot", "hf-libero", "robosuite",
                       "transformers", "diffusers")  # fmt: skip


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 over the module's state dict (names, dtypes, shapes and bytes, in name order): the weights a
    record measured, whether they came from a checkpoint or from memory."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{t.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def provenance(policy: torch.nn.Module) -> dict[str, Any]:
    """What a re-run needs to know besides the config: the weights' hash, the versions of the packages the
    numbers depend on, the code revision, the renderer."""
    import os
    import platform
    from importlib import metadata

    from vla_rl.checkpoint import git_revision

    versions = {}
    for name in PROVENANCE_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"weights_sha256": weights_sha256(policy), "versions": versions, "python": platform.python_version(),
            "git_revision": git_revision(), "renderer": {k: os.environ.get(k) for k in ("MUJOCO_GL", "PYOPENGL_PLATFORM")},
            "record_version": RECORD_VERSION}  # fmt: skip


def read_record(record_path: Path) -> dict[str, Any]:
    """A record (``eval.json``) to run again; one of another version, or not an evaluation record, is refused
    with one line."""
    try:
        record = json.loads(Path(record_path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--rerun={record_path}: not a readable eval.json ({err})") from None
    version = record.get("provenance", {}).get("record_version")
    if version != RECORD_VERSION:
        raise ValueError(
            f"--rerun={record_path} was written by {'an older' if version is None else 'another'} vla-rl eval (record "
            f"version {version}, this one reads {RECORD_VERSION}): re-run it with its own flags (its config is in it)"
        )
    return record


def compare_episodes(record: list[dict[str, Any]], again: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The episodes (by task, round and world) whose outcome or length differ between two runs of one plan."""

    def key(e: dict[str, Any]) -> tuple:
        return e["task"], e["round"], e["world"]

    def outcome(e: dict[str, Any] | None) -> list:
        return [None, None] if e is None else [e["success"], e["length"]]

    keyed = {key(e): e for e in again}
    return [{"task": e["task"], "round": e["round"], "world": e["world"], "record": outcome(e),
             "again": outcome(keyed.get(key(e)))}
            for e in record if outcome(e) != outcome(keyed.get(key(e)))]  # fmt: skip


def suite_of(task: str) -> str:
    """A task's suite by its name: ``libero_spatial/3`` is in ``libero_spatial``; a task without one is its own."""
    return task.partition("/")[0]


def rates(episodes: list[dict[str, Any]], key) -> dict[str, dict[str, Any]]:
    """Episodes grouped by ``key(episode)``, in order of first appearance: episodes, successes, success rate
    with its 95% Wilson interval, mean episode length."""
    from vla_rl.statistics import wilson_interval

    groups: dict[str, list[dict[str, Any]]] = {}
    for e in episodes:
        groups.setdefault(key(e), []).append(e)
    out = {}
    for name, mine in groups.items():
        successes = sum(e["success"] for e in mine)
        out[name] = {"episodes": len(mine), "successes": successes, "success_rate": successes / len(mine),
                     "success_ci95": list(wilson_interval(successes, len(mine))),
                     "mean_episode_length": float(np.mean([e["length"] for e in mine]))}  # fmt: skip
    return out


def per_task_table(episodes: list[dict[str, Any]], task_names: list[str]) -> list[dict[str, Any]]:
    """One row per task (in ``task_names`` order, tasks without episodes left out), as `rates` gives it."""
    by_task = rates(episodes, lambda e: e["task"])
    return [{"task": name, **by_task[name]} for name in task_names if name in by_task]
