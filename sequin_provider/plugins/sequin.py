"""The Sequin plugin: the Sequin Stream API inside Airflow's API server, and the Sequin view in its UI.

Mounted at ``/sequin`` (``fastapi_apps``): the pull API at ``/sequin/api/sequin_streams/...`` with
its own bearer tokens (Airflow does not authenticate plugin apps), and the view at ``/sequin/ui/``
(``plugins.ui``), shown in Airflow's navigation (``external_views``): slots, sinks with throughput
and lag, backfills with progress and ETA, parked messages with retry / discard, refreshed live.
The view asks for an API token in a form and keeps it in an HttpOnly cookie.

Nothing is read at import: the config (``$SEQUIN_CONFIG``) is loaded on the first request, so
the API server starts even before the file exists, and reports the problem on the page instead.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Awaitable, Callable

from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

URL_PREFIX = "/sequin"


class LazySequinApp:
    """ASGI app that builds the stream API (plus the UI page) from ``$SEQUIN_CONFIG`` on first use."""

    def __init__(self) -> None:
        self._app: Any = None
        self._service: Any = None
        self._lock = threading.Lock()

    def _build(self) -> Any:
        from sequin_provider.config import ConfigError, load_config
        from sequin_provider.hooks.sequin import airflow_dsn
        from sequin_provider.plugins.page import message_page
        from sequin_provider.plugins.ui import add_view_routes
        from sequin_provider.stream_api import StreamService, create_app

        try:  # the config's conn_ids as Airflow resolves them (environment, secrets backends, metadata DB)
            config = load_config(os.environ.get("SEQUIN_CONFIG"), resolve_conn_id=airflow_dsn)
        except ConfigError as exc:
            broken = FastAPI()
            message = str(exc)

            @broken.api_route("/{path:path}", methods=["GET", "POST"])
            async def unavailable(path: str) -> Response:
                return HTMLResponse(message_page(f"Sequin is not configured: {message}"), 503)

            return broken
        service = StreamService(config)
        app = create_app(config, service)
        add_view_routes(app, config, service)
        self._service = service
        return app

    def close(self) -> None:
        """Stop what the first request built (the service's LISTEN threads and pools); the next
        request builds anew. Airflow never calls it (a mounted app gets no lifespan: the service
        lives as long as the API server); tests do, so no thread outlives a test's store."""
        with self._lock:
            service, self._app, self._service = self._service, None, None
        if service is not None:
            service.close()

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":  # a mounted app gets none; standalone, answer and open lazily
            message = await receive()
            await send({"type": f"{message['type']}.complete"})
            return
        if self._app is None:
            with self._lock:
                if self._app is None:
                    self._app = self._build()
        await self._app(scope, receive, send)


class SequinPlugin(AirflowPlugin):
    """Registers the Sequin Stream API and the Sequin status view with Airflow."""

    name = "sequin"
    fastapi_apps = [{"app": LazySequinApp(), "url_prefix": URL_PREFIX, "name": "Sequin Stream API"}]
    external_views = [
        {
            "name": "Sequin",
            "href": f"{URL_PREFIX}/ui/",
            "url_route": "sequin",
            "destination": "nav",
            "category": "browse",
        }
    ]
