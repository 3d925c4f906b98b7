"""Where tokenfuse keeps converted models and alignment tables, and how it writes its files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache root: ``override`` (from the config), else ``$TOKENFUSE_CACHE``, else ``~/.cache/tokenfuse``."""
    if override:
        root = Path(override)
    elif os.environ.get("TOKENFUSE_CACHE"):
        root = Path(os.environ["TOKENFUSE_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenfuse"
    return root.expanduser()


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """``np.savez`` to ``path`` whole or not at all (a temporary file renamed over it): a process killed
    while writing leaves no half-written file for a later run to read (and, where it can still clean up,
    no temporary file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
