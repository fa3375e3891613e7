"""Batched simulation environments. Imports no policy code."""

from sim.factory import make_env

__all__ = ["make_env"]
