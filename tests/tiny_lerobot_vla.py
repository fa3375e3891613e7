"""LeRobot's pi0 and pi05, shrunk for CPU tests, saved as a real checkpoint directory.

LeRobot 0.6 builds pi0/pi05 only from its named parts (``gemma_2b`` backbone, ``gemma_300m`` expert,
SigLIP so400m: about 3.5 B parameters). `tiny_backbones` is the test-only config patch: while it is
active, LeRobot's own classes build with a one-layer Gemma of width 64 (backbone) and 32 (expert) and
a one-layer SigLIP of width 32, with every other part (the prefix/suffix attention, the Euler sampler,
the processors) LeRobot's unchanged. Loading a tiny checkpoint needs the patch active as well.

The saved preprocessor names PaliGemma's tokenizer by its hub id, as a real checkpoint does; the
tokenizer itself is a small word-level one saved in a directory of its own (what a user passes as
``--tokenizer_dir``), since PaliGemma's cannot be fetched offline.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import torch

PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # what LeRobot's pi0/pi05 processors name
BACKBONE_WIDTH = 64
IMAGE_RESOLUTION = 28  # SigLIP patches of 14: 2 x 2 image tokens per camera


VOCAB = 1024  # LeRobot sizes the embeddings for PaliGemma's 257152 tokens; the tiny tokenizer needs few


def _pinned(config, **pinned):
    """``config`` with the attributes ``pinned`` kept at their values whatever LeRobot sets them to later.

    A subclass of the config's class under the same name, registered with transformers' AutoModel (which
    builds a model from the config's class) for the model class of the original."""
    from transformers import AutoModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    original = type(config)

    class Pinned(original):
        def __setattr__(self, name, value):
            super().__setattr__(name, pinned.get(name, value))

    Pinned.__name__ = Pinned.__qualname__ = original.__name__  # what AutoModel.register compares
    AutoModel.register(Pinned, MODEL_MAPPING[original], exist_ok=True)
    config.__class__ = Pinned
    for name, value in pinned.items():
        setattr(config, name, value)
    return config


def _tiny_gemma(variant: str):
    from lerobot.policies.pi0.modeling_pi0 import GemmaConfig

    width = BACKBONE_WIDTH if variant == "gemma_2b" else 32
    return GemmaConfig(width=width, depth=1, mlp_dim=2 * width, num_heads=2, num_kv_heads=1, head_dim=16)


def _tiny_config_mapping():
    """LeRobot's pi0/pi05 read CONFIG_MAPPING["paligemma"] and ["gemma"]: the same configs, with a tiny
    SigLIP (LeRobot sets the so400m tower's intermediate_size 4304 and projection_dim 2048 after building
    it) and a small vocabulary."""
    from transformers import PaliGemmaConfig, SiglipVisionConfig
    from transformers.models.auto import CONFIG_MAPPING

    def paligemma():
        config = PaliGemmaConfig()
        vision = SiglipVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=14)
        config.vision_config = _pinned(vision, intermediate_size=64, projection_dim=BACKBONE_WIDTH)
        config.text_config = _pinned(config.text_config, vocab_size=VOCAB)
        return config

    def gemma(**kwargs):
        return CONFIG_MAPPING["gemma"](**(kwargs | {"vocab_size": VOCAB}))

    return {"paligemma": paligemma, "gemma": gemma}


@contextlib.contextmanager
def tiny_backbones():
    """While active, LeRobot's pi0 and pi05 build with tiny Gemma and SigLIP parts (see the module docstring)."""
    from lerobot.policies.pi0 import modeling_pi0
    from lerobot.policies.pi05 import modeling_pi05

    mapping = _tiny_config_mapping()
    with contextlib.ExitStack() as stack:
        for module in (modeling_pi0, modeling_pi05):
            stack.enter_context(mock.patch.object(module, "get_gemma_config", _tiny_gemma))
            stack.enter_context(mock.patch.object(module, "CONFIG_MAPPING", mapping))
        yield


def word_tokenizer(directory: Path, words: list[str]):
    """A word-level tokenizer over ``words`` (PreTrainedTokenizerFast), saved in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<bos>": 2} | {w: i + 3 for i, w in enumerate(sorted(set(words)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def save_tiny_vla(directory: Path, tokenizer, kind: str = "pi0", cameras=("front",), image_size: int = 64,
                  state_dim: int = 11, action_dim: int = 4, chunk_size: int = 8, n_action_steps: int = 4,
                  num_inference_steps: int = 3, seed: int = 0):  # fmt: skip
    """A random tiny pi0 or pi05 saved by LeRobot with its processors (normalization from hand-set
    statistics), for an env with ``cameras`` of ``image_size`` pixels. Returns (policy, pre, post)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    from lerobot.processor import tokenizer_processor

    if kind == "pi0":
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
    else:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
    inputs = {
        f"observation.images.{c}": PolicyFeature(FeatureType.VISUAL, (3, image_size, image_size)) for c in cameras
    }
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (state_dim,))
    config = Config(
        input_features=inputs, output_features={"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
        chunk_size=chunk_size, n_action_steps=n_action_steps, num_inference_steps=num_inference_steps,
        image_resolution=(IMAGE_RESOLUTION, IMAGE_RESOLUTION), tokenizer_max_length=16, device="cpu",
    )  # fmt: skip
    stats = {
        "observation.state": {"mean": torch.linspace(-0.1, 0.1, state_dim), "std": torch.full((state_dim,), 0.5),
                              "min": -torch.ones(state_dim), "max": torch.ones(state_dim),
                              "q01": -torch.ones(state_dim), "q99": torch.ones(state_dim)},
        "action": {"mean": torch.linspace(0.0, 0.3, action_dim), "std": torch.full((action_dim,), 0.2),
                   "min": -torch.ones(action_dim), "max": torch.ones(action_dim),
                   "q01": -torch.ones(action_dim), "q99": torch.ones(action_dim)},
    }  # fmt: skip
    loader = mock.Mock(from_pretrained=mock.Mock(return_value=tokenizer))
    with tiny_backbones(), mock.patch.object(tokenizer_processor, "AutoTokenizer", loader):
        torch.manual_seed(seed)
        policy = get_policy_class(kind)(config)
        pre, post = make_pre_post_processors(config, dataset_stats=stats)
    assert loader.from_pretrained.call_args.args == (PALIGEMMA_TOKENIZER,)  # named as a real checkpoint names it
    for part in (policy, pre, post):
        part.save_pretrained(directory)
    return policy, pre, post


SMOLVLM_SPECIAL = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                   "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>",
                   "video_token": "<video>"}  # fmt: skip


def save_tiny_smolvlm(directory: Path, words: list[str]) -> None:
    """A local SmolVLM "checkpoint" without weights, what SmolVLA's backbone is built from: a two-layer
    Llama of width 64 with a one-layer SigLIP-style tower of width 32 on 28-pixel images (its
    ``config.json``), and its processor (a word-level tokenizer with SmolVLM's image tokens, SmolVLM's
    image and video processors), saved where ``--tokenizer_dir`` points."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    specials = list(SMOLVLM_SPECIAL.values())
    vocab = {"<pad>": 0, "<unk>": 1} | {w: i + 2 for i, w in enumerate(specials + sorted(set(words)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        extra_special_tokens=SMOLVLM_SPECIAL)  # fmt: skip
    images = SmolVLMImageProcessor(size={"longest_edge": 28}, max_image_size={"longest_edge": 28})
    SmolVLMProcessor(images, tokenizer, SmolVLMVideoProcessor(), image_seq_len=1).save_pretrained(directory)
    SmolVLMConfig(
        text_config={"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": IMAGE_RESOLUTION, "patch_size": 14},
        scale_factor=2, image_token_id=vocab["<image>"], vocab_size=VOCAB,
    ).save_pretrained(directory)  # fmt: skip


def save_tiny_smolvla(directory: Path, vlm_dir: Path, image_size: int = 64, state_dim: int = 11,
                      action_dim: int = 4, chunk_size: int = 8, n_action_steps: int = 4, seed: int = 0):  # fmt: skip
    """A random SmolVLA on the tiny SmolVLM of ``vlm_dir``, saved by LeRobot with its processors (whose
    tokenizer step names the hub id of SmolVLA's real backbone, as a real checkpoint does)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.processor import tokenizer_processor
    from transformers import AutoTokenizer

    inputs = {"observation.images.front": PolicyFeature(FeatureType.VISUAL, (3, image_size, image_size)),
              "observation.state": PolicyFeature(FeatureType.STATE, (state_dim,))}  # fmt: skip
    config = SmolVLAConfig(
        input_features=inputs, output_features={"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
        chunk_size=chunk_size, n_action_steps=n_action_steps, num_steps=3, resize_imgs_with_padding=(28, 28),
        tokenizer_max_length=16, load_vlm_weights=False, device="cpu",
    )  # fmt: skip
    hub_name = config.vlm_model_name
    stats = {"observation.state": {"mean": torch.zeros(state_dim), "std": torch.ones(state_dim)},
             "action": {"mean": torch.zeros(action_dim), "std": torch.ones(action_dim)}}  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir))
    loader = mock.Mock(from_pretrained=mock.Mock(return_value=tokenizer))
    torch.manual_seed(seed)
    config.vlm_model_name = str(vlm_dir)  # built from the local SmolVLM, saved naming the hub's
    policy = SmolVLAPolicy(config)
    config.vlm_model_name = hub_name
    with mock.patch.object(tokenizer_processor, "AutoTokenizer", loader):
        pre, post = make_pre_post_processors(config, dataset_stats=stats)
    for part in (policy, pre, post):
        part.save_pretrained(directory)
