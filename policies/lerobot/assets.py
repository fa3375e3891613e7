"""What a LeRobot VLA checkpoint names by hub id and needs at load time: its instruction tokenizer
(pi0 and pi05: PaliGemma's; SmolVLA: its VLM's, whose config.json also sizes the backbone).

A checkpoint's ``policy_preprocessor.json`` names the tokenizer (``tokenizer_name``), which LeRobot
fetches from the Hugging Face Hub. Offline it comes from, in this order: the directory the user names
(``--tokenizer_dir``), the checkpoint's own ``tokenizer/`` folder (vla-rl writes one beside the weights
it saves), the local Hugging Face cache. A saved checkpoint keeps naming the hub id, so LeRobot reads it
as it read the original.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FOLDER = "tokenizer"  # inside a policy directory vla-rl saved
TOKENIZER_STEP = "tokenizer_processor"  # LeRobot's registry name of its TokenizerProcessorStep


def saved_tokenizer_name(directory: str | Path) -> str | None:
    """The tokenizer the preprocessor of ``directory`` names (a hub id or a path); None: it tokenizes nothing."""
    path = Path(directory) / "policy_preprocessor.json"
    if not path.is_file():
        return None
    for step in json.loads(path.read_text()).get("steps", []):
        if step.get("registry_name") == TOKENIZER_STEP:
            return step.get("config", {}).get("tokenizer_name")
    return None


def load_tokenizer(directory: str | Path, lerobot_type: str, tokenizer_dir: str = ""):
    """The tokenizer of the LeRobot policy in ``directory`` (None when its preprocessor has no tokenizer
    step), from the first of: ``tokenizer_dir``, ``directory/tokenizer``, the Hugging Face cache (or the
    hub, when online). ValueError naming the fix when none has it."""
    name = saved_tokenizer_name(directory)
    if name is None:
        if tokenizer_dir:
            raise ValueError(
                f"the LeRobot {lerobot_type} policy in {directory} tokenizes no instructions: drop --tokenizer_dir"
            )
        return None
    from transformers import AutoTokenizer

    if tokenizer_dir and not Path(tokenizer_dir).is_dir():
        raise ValueError(
            f"--tokenizer_dir={tokenizer_dir} is not a directory; name the folder holding {name}'s tokenizer"
        )
    for local in (tokenizer_dir, Path(directory) / TOKENIZER_FOLDER):
        if local and Path(local).is_dir():
            try:
                return AutoTokenizer.from_pretrained(str(local))
            except Exception as e:  # transformers raises OSError, ValueError, ... for a folder it cannot read
                raise ValueError(
                    f"{local} holds no tokenizer transformers can load ({e}); it should hold {name}'s"
                ) from e
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise ValueError(
            f"the LeRobot {lerobot_type} policy in {directory} tokenizes its instructions with {name!r}, which is "
            f"neither in the local Hugging Face cache nor reachable: download it where there is a network "
            f"(`hf download {name} --local-dir <dir>`) and pass --tokenizer_dir=<dir>"
        ) from e


def vlm_source(directory: str | Path, vlm_name: str, tokenizer_dir: str) -> str:
    """Where SmolVLA builds its VLM from (its config.json and processor): ``tokenizer_dir``, else the
    checkpoint's ``tokenizer/`` folder when it holds a config.json, else the checkpoint's ``vlm_model_name``
    (a hub id LeRobot fetches: fine online or cached). ValueError naming the fix when ``tokenizer_dir`` is
    given without a config.json."""
    if tokenizer_dir:
        if not (Path(tokenizer_dir) / "config.json").is_file():
            raise ValueError(
                f"the SmolVLA policy in {directory} builds its backbone from the config.json of {vlm_name}, "
                f"which --tokenizer_dir={tokenizer_dir} lacks: download {vlm_name} there (`hf download {vlm_name} "
                f"--local-dir {tokenizer_dir}`)"
            )
        return str(Path(tokenizer_dir).resolve())
    own = Path(directory) / TOKENIZER_FOLDER
    return str(own.resolve()) if (own / "config.json").is_file() else vlm_name
