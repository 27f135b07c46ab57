"""Config files of the tests."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_config(path: Path, body: str) -> Path:
    """Write a sequin.yaml (``body`` dedented)."""
    path.write_text(textwrap.dedent(body))
    return path
