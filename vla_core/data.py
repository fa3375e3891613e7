"""Demonstrations from a LeRobotDataset, held in memory as tensors for fast chunk sampling.

The dataset is read with `lerobot`'s own `LeRobotDataset`, so any v3 dataset with the needed
features works, ours or a public one.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from vla_core.types import ACTION, ENVIRONMENT_STATE, OBS_IMAGES, OBS_STATE, TASK


def video_backend() -> str:
    """torchcodec when its FFmpeg libraries load, else pyav; chosen quietly (our datasets store images)."""
    try:
        import torchcodec  # noqa: F401

        return "torchcodec"
    except (ImportError, OSError, RuntimeError):
        return "pyav"


def quiet_datasets() -> None:
    """Hide the `datasets` library's per-call progress bars (a `Map:` bar for every saved episode),
    so a command that writes a dataset shows its own bar alone."""
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()


def discard_dataset(dataset, root: Path) -> None:
    """Remove a dataset being written at ``root`` (an interrupted or failed recording).

    Its writers are closed first: LeRobot's writer finalizes itself when garbage-collected, which
    would otherwise write its metadata files again into the removed directory.
    """
    import shutil

    if dataset is not None:
        with contextlib.suppress(Exception):  # already failing: removing the directory matters more
            dataset.finalize()
    shutil.rmtree(root, ignore_errors=True)


def open_dataset(root: str | Path, repo_id: str | None = None):
    """Open a local LeRobotDataset, or stop with a one-line error naming the fix."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = Path(root)
    if not (root / "meta" / "info.json").is_file():
        raise FileNotFoundError(
            f"no LeRobotDataset at {root} (missing meta/info.json); record one with `vla-rl record "
            f"--output_dir={root}` or point --dataset.root at an existing dataset"
        )
    return LeRobotDataset(repo_id or f"local/{root.name}", root=root, video_backend=video_backend())


def _as_uint8(images: torch.Tensor) -> torch.Tensor:
    """Image columns decode as uint8 (PNG frames) or float in [0, 1] (decoded video); keep uint8 in memory."""
    if images.dtype == torch.uint8:
        return images
    return (images * 255).round().clamp(0, 255).to(torch.uint8)


def _entry_names(feature: dict) -> list[str] | None:
    """A vector feature's entry names as LeRobot records them (a list, or a dict of one list such as
    ``{"motors": [...]}``), None when it records none."""
    names = feature.get("names")
    if isinstance(names, dict) and len(names) == 1:
        names = next(iter(names.values()))
    return [str(n) for n in names] if isinstance(names, list) and names else None


class ChunkedDemos:
    """All frames of a dataset in memory.

    images[cam]: (N, 3, S, S) uint8; state: (N, S_dim); action: (N, A); episode[i]: episode index of
    frame i; episode_end[i]: index one past the last frame of frame i's episode; task_index[i]:
    instruction index into ``tasks``.
    """

    # (N, E) the simulation's true state of each frame, when recorded (labels, never a policy input), else None
    environment_state: torch.Tensor | None = None

    def __init__(self, dataset, cameras: list[str] | None = None):
        features = dataset.meta.features
        available = [k.removeprefix(OBS_IMAGES + ".") for k in features if k.startswith(OBS_IMAGES + ".")]
        self.cameras = cameras or available
        missing = [k for k in [OBS_STATE, ACTION] + [f"{OBS_IMAGES}.{c}" for c in self.cameras] if k not in features]
        if missing:
            raise ValueError(
                f"dataset {dataset.root} lacks features {missing}; it has {sorted(features)}. "
                f"Choose cameras from {available}"
            )
        columns = [OBS_STATE, ACTION, "episode_index", "task_index"] + [f"{OBS_IMAGES}.{c}" for c in self.cameras]
        true_state = ENVIRONMENT_STATE in features  # `vla-rl record --environment_state=true`
        table = dataset.hf_dataset.select_columns(columns + [ENVIRONMENT_STATE] * true_state).with_format("torch")[:]
        self.environment_state = table[ENVIRONMENT_STATE].float() if true_state else None
        self.images = {c: _as_uint8(table[f"{OBS_IMAGES}.{c}"]) for c in self.cameras}
        self.state_names, self.action_names = _entry_names(features[OBS_STATE]), _entry_names(features[ACTION])
        self.state = table[OBS_STATE].float()
        self.action = table[ACTION].float()
        self.episode = episode = table["episode_index"].long()
        self.task_index = table["task_index"].long()
        tasks = dataset.meta.tasks  # pandas frame indexed by task string
        self.tasks = [str(t) for t in sorted(tasks.index, key=lambda t: int(tasks.loc[t, "task_index"]))]
        # Frame i's episode ends at the first frame whose episode differs (frames are stored in order).
        boundaries = torch.nonzero(episode[1:] != episode[:-1]).flatten() + 1
        ends = torch.cat([boundaries, torch.tensor([len(episode)])])
        self.episode_end = ends[torch.bucketize(torch.arange(len(episode)), ends, right=True)]
        if not (torch.isfinite(self.state).all() and torch.isfinite(self.action).all()):
            raise ValueError(f"dataset {dataset.root} has NaN or inf in state or action")

    def __len__(self) -> int:
        return self.state.shape[0]

    def action_chunks(self, horizon: int, frames: torch.Tensor | None = None) -> torch.Tensor:
        """(F, horizon, A) the action chunk of each of ``frames`` (all by default), as `batch` makes them:
        steps past the episode's end repeat its last action. What an action tokenizer is fitted on."""
        idx = torch.arange(len(self)) if frames is None else frames
        offsets = idx[:, None] + torch.arange(horizon)[None]
        return self.action[offsets.clamp(max=self.episode_end[idx][:, None] - 1)]

    def batch(self, idx: torch.Tensor, horizon: int) -> dict:
        """Frames ``idx`` (B,) -> observation batch + ``action`` (B, horizon, A) + ``action_is_pad`` (B, horizon).

        Steps past the episode's end repeat its last action and are marked as padding. A dataset with the true state
        adds ``observation.environment_state`` (B, E) of the frames (labels: no policy reads it as an input).
        """
        offsets = idx[:, None] + torch.arange(horizon)[None]  # (B, H)
        last = self.episode_end[idx][:, None] - 1
        batch = {f"{OBS_IMAGES}.{c}": self.images[c][idx].float() / 255.0 for c in self.cameras}
        batch[OBS_STATE] = self.state[idx]
        batch[ACTION] = self.action[offsets.clamp(max=last)]
        batch["action_is_pad"] = offsets > last
        batch[TASK] = [self.tasks[i] for i in self.task_index[idx].tolist()]
        if self.environment_state is not None:
            batch[ENVIRONMENT_STATE] = self.environment_state[idx]
        return batch


class FrameSampler:
    """Draws training frames: uniformly, or task-balanced (a task uniformly, then a frame of it).

    Task balance keeps a multi-task dataset's rare tasks from being drowned by frequent or long
    ones. frames: (M,) the frame indices to draw from (e.g. without held-out episodes); task_index:
    (N,) of the whole dataset.
    """

    def __init__(self, frames: torch.Tensor, task_index: torch.Tensor, balanced: bool):
        if len(frames) == 0:
            raise ValueError("no frames to train on; lower val_episodes or record more episodes")
        self.frames = frames
        tasks = task_index[frames]
        self.by_task = [frames[tasks == t] for t in tasks.unique().tolist()]
        # With one task the two rules coincide; drawing only the frame keeps the random stream of
        # a single-task run the same whichever rule is chosen.
        self.balanced = balanced and len(self.by_task) > 1

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n,) frame indices."""
        if not self.balanced:
            return self.frames[torch.randint(0, len(self.frames), (n,), generator=generator)]
        task = torch.randint(0, len(self.by_task), (n,), generator=generator).tolist()
        u = torch.rand(n, generator=generator).tolist()
        return torch.tensor([self.by_task[t][int(x * len(self.by_task[t]))].item() for t, x in zip(task, u)])


def random_shift(images: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """(B, C, S, S) -> same shape, each image translated by up to ``shift`` pixels (edge padding)."""
    if shift <= 0:
        return images
    b, _, s, _ = images.shape
    padded = torch.nn.functional.pad(images, (shift,) * 4, mode="replicate")
    dx, dy = torch.randint(0, 2 * shift + 1, (2, b), generator=generator).tolist()
    return torch.stack([padded[i, :, dy[i] : dy[i] + s, dx[i] : dx[i] + s] for i in range(b)])
