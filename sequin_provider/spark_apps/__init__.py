"""The Spark apps of the product, as files inside the installed package (spark-submit needs a path).

``replication_stream.py`` (the long-lived stream app) and ``backfill.py`` (the backfill batch app and
the backfill server) each parse their arguments and call into ``sequin_provider.spark``. The
operators submit them from here, so a wheel install has them; the top-level ``spark_apps/*.py`` of a
source checkout are shims calling the same ``main``.
"""

from __future__ import annotations

from pathlib import Path

APPS_DIR = Path(__file__).resolve().parent
"""The folder holding the app files in the installed package."""

APP_NAMES = ("replication_stream.py", "backfill.py")
"""The apps' file names."""


def app_path(name: str) -> Path:
    """Path of the packaged app ``name`` (``replication_stream.py`` or ``backfill.py``); ValueError
    naming the apps for any other name."""
    if name not in APP_NAMES:
        raise ValueError(f"unknown Spark app {name!r}: the apps are {', '.join(APP_NAMES)}")
    return APPS_DIR / name
