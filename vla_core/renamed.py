"""Config fields that were renamed or merged keep their old name for one release: the command line
(``--old.name=value``), a YAML file and a ROS parameter of the old name still set the new field, and
say so once. Listed in CHANGELOG.md with the release that drops them."""

from __future__ import annotations

from collections.abc import Callable

# old dotted name -> (new dotted name, the release that drops the old one)
RENAMED: dict[str, tuple[str, str]] = {
    # One field for the measured delay estimate's window, shared by eval, finetune and serve.
    "delay.estimate_window": ("chunking.estimate_window", "0.4.0"),
    "delay_estimate_window": ("chunking.estimate_window", "0.4.0"),
}


def renamed_line(old: str, new: str, until: str) -> str:
    return f"{old} is now {new}; the old name works until vla-rl {until}"


def ignored_line(old: str, new: str, until: str) -> str:
    """For a config that had the old field but never read it, and has no new one."""
    return f"{old} had no effect here and is ignored (it is {new} elsewhere); drop it before vla-rl {until}"


def rename_tree(tree: dict, fields: Callable[[str], bool], warn: Callable[[str], None]) -> dict:
    """A nested config mapping (a YAML file) with old names moved to their new place, each move told to
    ``warn``; ``fields`` says whether the config has a dotted name. An old name is dropped, with a notice,
    when its new name is given too or when the config lacks the new field but has the old one's parent."""
    for old, (new, until) in RENAMED.items():
        *parents, leaf = old.split(".")
        node = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node or fields(old):
            continue
        if not fields(new):
            if parents and fields(".".join(parents)):
                node.pop(leaf)
                warn(ignored_line(old, new, until))
            continue
        value = node.pop(leaf)
        *new_parents, new_leaf = new.split(".")
        target = tree
        for part in new_parents:
            target = target.setdefault(part, {})
        if new_leaf in target:  # given under its new name too: that wins
            warn(f"{old} is ignored: {new} is given too")
            continue
        warn(renamed_line(old, new, until))
        target[new_leaf] = value
    return tree
