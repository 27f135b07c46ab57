"""The stream app and the ``sequin`` CLI as the tests run them: child processes of this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from devtools.stream_process import StreamAppProcess


class StreamApp(StreamAppProcess):
    """The stream app for tests: a dead app fails the test with its log."""

    def check_alive(self) -> None:
        """Raise AssertionError (a test failure, with the app's log) when the app has died."""
        try:
            super().check_alive()
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None


def spark_jvm(app: StreamAppProcess) -> psutil.Process:
    """The Spark JVM the app's driver started (local mode: it runs the executors too)."""
    assert app.proc is not None
    for child in psutil.Process(app.proc.pid).children(recursive=True):
        if child.name() == "java":
            return child
    raise AssertionError("the stream app runs no JVM")


def spark_jvm_arguments(app: StreamAppProcess) -> list[str]:
    """The command line of the app's Spark JVM."""
    return spark_jvm(app).cmdline()


def cli(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``sequin --config <config> <args>`` in a child interpreter; its output is captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
