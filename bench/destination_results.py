"""What each destination benchmark (``bench/<destination>_throughput.py``) reports, in one shape, so that
``bench/compare.py --destinations`` can run them in its run and set them beside its Sequin Stream sink.

Each writes ``bench/results/destinations/<name>.json``: ``end_to_end`` (changes/s, the stream app from
the first commit to the last change in the destination, after a warm-up), ``limit`` (the destination's
own limit, measured with its native client alone in the same run) and ``limit_label`` (what that was).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).resolve().parent / "results" / "destinations"


def record(name: str, end_to_end: float, limit: float, limit_label: str, **extra: Any) -> Path:
    """Write one destination's figures; returns the file."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    path = FOLDER / f"{name}.json"
    data = {"name": name, "end_to_end": end_to_end, "limit": limit, "limit_label": limit_label, **extra}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def load(name: str) -> dict[str, Any]:
    """The figures a destination benchmark last wrote."""
    return json.loads((FOLDER / f"{name}.json").read_text())  # type: ignore[no-any-return]
