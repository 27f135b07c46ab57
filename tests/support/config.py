"""Config files of the tests."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_config(path: Path, body: str) -> Path:
    """Write a sequin.yaml (``body`` dedented)."""
    path.write_text(textwrap.dedent(body))
    return path


def builtin_kind_names() -> list[str]:
    """The built-in destination kinds' names in registry order (what config errors list before any
    kind a test registers)."""
    from sequin_provider.sinks import registry

    return [k.name for k in registry.kinds() if type(k).__module__ in registry.BUILTIN_MODULES]
