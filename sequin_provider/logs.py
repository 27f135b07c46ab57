"""Logging of the Spark apps and of the Python workers Spark starts for them: one format, the level
from ``$SEQUIN_LOG_LEVEL`` (default INFO), to stderr, which Spark forwards into the app's log."""

from __future__ import annotations

import logging
import os
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging() -> None:
    """Send this process's log records to stderr (once; a process that already has handlers, such as
    Airflow's or pytest's, keeps them). Python workers start with no handler, so without this their
    INFO lines (a page's window closed, a range's progress) would be lost."""
    logging.basicConfig(level=os.environ.get("SEQUIN_LOG_LEVEL", "INFO"), format=LOG_FORMAT, stream=sys.stderr)
