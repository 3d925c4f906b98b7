"""Where tokenfuse keeps converted models and alignment tables."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache root: ``override`` (from the config), else ``$TOKENFUSE_CACHE``, else ``~/.cache/tokenfuse``."""
    if override:
        root = Path(override)
    elif os.environ.get("TOKENFUSE_CACHE"):
        root = Path(os.environ["TOKENFUSE_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenfuse"
    return root.expanduser()
