"""What fine-tuning a LeRobot VLA (pi0, pi05, SmolVLA) needs: which weights train, their dtype, and
gradient checkpointing.

- ``trainable=all``: every weight; ``expert``: the action expert and its projections, the
  vision-language backbone frozen (LeRobot's ``train_expert_only``); ``lora``: low-rank adapters
  (``peft``) on LeRobot's own default targets for the type (the action expert's q/v projections and
  the action/state projections), everything else frozen.
- ``dtype=bfloat16``: LeRobot's own mixed precision for pi0/pi05 (the backbone in bf16, the vision path
  and norms in float32); the velocity head stays float32, so chain log-probabilities are float32.
- ``gradient_checkpointing``: each of the K velocity passes of a scored chain keeps only its inputs and
  is run again in the backward pass (`policies.lerobot.flow.Scorer`). Not LeRobot's flag: it acts in
  train mode, where transformers turns off the key-value cache LeRobot's sampler needs, and its
  layer-level recomputation would append to that cache twice. The prefix pass keeps its activations
  (they matter only when the backbone trains).

A LoRA policy is saved with its adapters merged into LeRobot's weight names (LeRobot, eval and serve
read it as a plain checkpoint) and, beside them, ``lora_adapter.safetensors``, from which a resumed run
rebuilds the exact unmerged weights on top of the run's initial checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

ADAPTER_FILE = "lora_adapter.safetensors"
# The vision-language backbone of each flow VLA, what ``expert`` freezes (LeRobot's attribute paths).
BACKBONES = {"pi0": "model.paligemma_with_expert.paligemma", "pi05": "model.paligemma_with_expert.paligemma",
             "smolvla": "model.vlm_with_expert.vlm"}  # fmt: skip


@dataclass
class AdaptationConfig:
    """How `vla-rl finetune` makes a LeRobot VLA trainable (ignored for vla-rl's own policies)."""

    trainable: Literal["all", "expert", "lora"] = "all"  # see the module docstring
    lora_rank: int = 16  # rank of the LoRA adapters (trainable=lora)
    lora_alpha: int = 16  # their scale is lora_alpha / lora_rank
    dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False

    def is_default(self) -> bool:
        return self == AdaptationConfig()

    def validate(self) -> None:
        if self.trainable not in ("all", "expert", "lora"):
            raise ValueError(f"--vla.trainable={self.trainable!r} is unknown; choose all, expert or lora")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--vla.dtype={self.dtype!r} is unknown; choose float32 or bfloat16")
        if self.lora_rank < 1 or self.lora_alpha < 1:
            raise ValueError("--vla.lora_rank and --vla.lora_alpha must be >= 1")
        default = AdaptationConfig()
        if self.trainable != "lora" and (self.lora_rank, self.lora_alpha) != (default.lora_rank, default.lora_alpha):
            raise ValueError(f"--vla.lora_rank and --vla.lora_alpha shape LoRA adapters; with --vla.trainable="
                             f"{self.trainable} there are none: drop them or set --vla.trainable=lora")  # fmt: skip


class Adapted:
    """What `adapt` did to a model: the settings, and the LoRA layers it injected (none otherwise)."""

    def __init__(self, settings: AdaptationConfig, lora_layers: list[str]):
        self.settings = settings
        self.lora_layers = lora_layers  # module names of the injected LoRA layers

    def adapter_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if "lora_" in k}

    def save_merged(self, model: nn.Module, directory: Path) -> None:
        """LeRobot's ``save_pretrained`` of the model with each adapter merged into a copy of its base layer
        (the live weights are untouched, so training continues bit for bit), plus the adapters themselves."""
        from safetensors.torch import save_file

        swapped = []
        for name in self.lora_layers:
            parent_name, _, attr = name.rpartition(".")
            parent, layer = model.get_submodule(parent_name), model.get_submodule(name)
            base = layer.get_base_layer()
            if not isinstance(base, nn.Linear):
                raise TypeError(
                    f"merging LoRA into {name} ({type(base).__name__}) is not supported: only Linear layers"
                )
            # skip_init: no initialization, which would draw from (and so shift) the run's random stream.
            merged = nn.utils.skip_init(nn.Linear, base.in_features, base.out_features, bias=base.bias is not None,
                                        device=base.weight.device, dtype=base.weight.dtype)  # fmt: skip
            with torch.no_grad():
                delta = sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
                merged.weight.copy_(base.weight + delta.to(base.weight.dtype))
                if base.bias is not None:
                    merged.bias.copy_(base.bias)
            setattr(parent, attr, merged)
            swapped.append((parent, attr, layer))
        try:
            model.save_pretrained(directory)
        finally:
            for parent, attr, layer in swapped:
                setattr(parent, attr, layer)
        if self.lora_layers:
            save_file(self.adapter_state(model), str(Path(directory) / ADAPTER_FILE))

    def load_adapter(self, model: nn.Module, directory: Path) -> None:
        """Load the adapters ``save_merged`` wrote into ``directory`` (a resumed LoRA run)."""
        from safetensors.torch import load_file

        path = Path(directory) / ADAPTER_FILE
        if not path.is_file():
            raise ValueError(f"{directory} holds no {ADAPTER_FILE}; it was not saved by a --vla.trainable=lora run")
        saved = load_file(str(path))
        expected = set(self.adapter_state(model))
        if set(saved) != expected:
            raise ValueError(f"{path} holds other adapters than this run's (another --vla.lora_rank or policy?)")
        model.load_state_dict(saved, strict=False)


def adapt(model: nn.Module, lerobot_type: str, settings: AdaptationConfig, seed: int = 0) -> Adapted:
    """Apply ``settings`` to a LeRobot flow VLA ``model`` (its ``PreTrainedPolicy``) in place. seed: of the
    LoRA adapters' initial weights (drawn from a stream of their own, so a run starts the same whatever
    the process drew before)."""
    settings.validate()
    if settings.dtype == "bfloat16":
        if lerobot_type not in ("pi0", "pi05"):
            raise ValueError(f"--vla.dtype=bfloat16 is LeRobot's mixed precision of pi0 and pi05, not {lerobot_type}")
        model.model.paligemma_with_expert.to_bfloat16_for_selected_params("bfloat16")
        model.config.dtype = "bfloat16"  # saved with the weights: LeRobot then loads them as they trained
    lora_layers: list[str] = []
    if settings.trainable == "expert":
        model.get_submodule(BACKBONES[lerobot_type]).requires_grad_(False)
    elif settings.trainable == "lora":
        try:
            from peft import LoraConfig, inject_adapter_in_model
            from peft.tuners.lora import LoraLayer
        except ImportError as e:
            raise ImportError('--vla.trainable=lora needs peft, in the vla extra: pip install -e ".[vla]"') from e

        targets = model._get_default_peft_targets()["target_modules"]
        config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules=targets)
        model.requires_grad_(False)
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            inject_adapter_in_model(config, model)
        lora_layers = [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
        for name, parameter in model.named_parameters():
            parameter.requires_grad_("lora_" in name)
            if "lora_" in name:
                # peft gives an adapter its base layer's dtype; in bf16 AdamW's small steps would round away.
                parameter.data = parameter.data.float()
    return Adapted(settings, lora_layers)
