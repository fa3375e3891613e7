"""Imports of the optional extras, which fail rather than skip where every extra must be installed.

`make test` installs every extra and CI runs it with ``CI=true``: there a broken or missing
import must fail the run, not make a whole test file vanish as a skip. A developer who installed
only part of the project (``pip install -e ".[dev]"``) still gets a skip naming the extra.
"""

from __future__ import annotations

import importlib
import os

import pytest


def extras_required() -> bool:
    """True where a missing extra is a failure: under CI, or with VLA_RL_REQUIRE_EXTRAS=1."""
    flag = os.environ.get("VLA_RL_REQUIRE_EXTRAS") or os.environ.get("CI", "")
    return flag.lower() in ("1", "true", "yes")


def require(module: str, extra: str):
    """Import ``module`` (brought by the ``extra`` extra), or skip the calling test file where allowed."""
    if extras_required():
        return importlib.import_module(module)  # an ImportError fails collection, loudly
    return pytest.importorskip(module, reason=f'needs the {extra} extra: pip install -e ".[{extra}]"')
