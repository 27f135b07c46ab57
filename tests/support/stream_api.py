"""The pull API served in-process for the tests."""

from __future__ import annotations

import threading
from typing import Any

import uvicorn

from devtools.embedded_postgres import free_port
from devtools.stream_process import wait_for
from sequin_provider.config import SequinConfig
from sequin_provider.stream_api import create_app


class ApiServer:
    """uvicorn serving the API in a thread, on a free loopback port."""

    def __init__(self, config: SequinConfig) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(config), host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ApiServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 30, what="API server start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
