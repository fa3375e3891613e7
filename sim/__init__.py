"""Batched simulation environments. Imports no policy code."""
