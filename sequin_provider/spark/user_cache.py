"""The user's cache folder for what the local Spark apps build once and reuse (the class archive,
the checkpoint jar), and its pruning."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

STALE_DAYS = 7


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/sequin``, else ``~/.cache/sequin`` (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sequin"


def configured_path(env: str, default: Callable[[], Path]) -> Path | None:
    """The path a setting ``env`` names: None when it is ``off``, ``default()`` when it is unset."""
    setting = os.environ.get(env, "").strip()
    if setting.lower() == "off":
        return None
    return Path(setting) if setting else default()


def prune(kept: Path, pattern: str, days: int = STALE_DAYS) -> None:
    """Remove the files of ``kept``'s folder that match ``pattern`` and were written over ``days``
    ago, except ``kept``: what a reinstalled venv or another version left and nothing reads now."""
    cutoff = time.time() - days * 86400
    for other in kept.parent.glob(pattern):
        if other != kept and other.stat().st_mtime < cutoff:
            other.unlink(missing_ok=True)
