"""The autoregressive VLA (type ``autoregressive_vla``): a PaliGemma-style vision-language model (SigLIP +
Gemma, `transformers`) that emits action tokens (FAST or uniform bins), decoded batched with a key-value
cache and constrained to the action tokens."""

from policies.autoregressive_vla.configuration_autoregressive_vla import AutoregressiveVLAConfig

__all__ = ["AutoregressiveVLAConfig"]
