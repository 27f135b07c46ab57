"""The Sequin plugin: the Sequin Stream API inside Airflow's API server, and a status view in its UI.

Mounted at ``/sequin`` (``fastapi_apps``): the pull API at ``/sequin/api/sequin_streams/...`` with
its own bearer tokens (Airflow does not authenticate plugin apps), and ``/sequin/ui/``, a page
listing sinks, backfills with progress, slot lag and parked messages, shown in Airflow's navigation
(``external_views``). The page asks for an API token too and keeps it in a cookie.

Nothing is read at import: the config (``$SEQUIN_CONFIG``) is loaded on the first request, so
the API server starts even before the file exists, and reports the problem on the page instead.
"""

from __future__ import annotations

import html
import os
import threading
from typing import Any, Awaitable, Callable

import psycopg
from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

URL_PREFIX = "/sequin"
TOKEN_COOKIE = "sequin_token"


def _cell(value: Any) -> str:
    return f"<td>{html.escape('' if value is None else str(value))}</td>"


def status_page(config: Any, service: Any, token: str | None) -> str:
    """The HTML status view: sinks with their messages and parked counts, backfills, slot lag."""
    from sequin_provider import store
    from sequin_provider.backfill import progress_line
    from sequin_provider.replication import slot_info

    if not token:
        return _token_form("An API token (sequin token create NAME) is needed to see this page.")
    try:
        service.authorize(token)
    except Exception as exc:  # noqa: BLE001 - ApiError: unknown or revoked
        return _token_form(str(exc))
    rows_sinks, rows_backfills, rows_slots = [], [], []
    for db in config.databases:
        schema = config.store.schema
        try:
            with psycopg.connect(db.dsn, connect_timeout=5) as source:
                info = slot_info(source, db.slot.name)
            rows_slots.append(
                [
                    db.name,
                    db.slot.name,
                    "yes" if info and info.active else "no",
                    f"{info.lag_bytes:,}" if info and info.lag_bytes is not None else "?",
                ]
            )
            with psycopg.connect(config.store_dsn(db.name), connect_timeout=5) as conn:
                parked = store.buffer_counts(conn, schema) if store.schema_version(conn, schema) >= 6 else {}
                for sink in config.sinks_of(db.name):
                    counts = sink.destination.kind.counts(conn, schema, sink.name)
                    rows_sinks.append(
                        [
                            sink.name,
                            sink.destination.kind.name,
                            ", ".join(t.qualified for t in sink.tables),
                            counts.get("visible", ""),
                            counts.get("outstanding", ""),
                            parked.get(sink.name, {}).get("parked", 0),
                            parked.get(sink.name, {}).get("discarded", 0),
                            sink.destination.kind.health(sink) or "",
                        ]
                    )
                for b in store.list_backfills(conn, schema)[:50] if store.schema_version(conn, schema) else []:
                    rows_backfills.append(
                        [b.id, b.sink, f"{b.table_schema}.{b.table_name}", b.kind, progress_line(b), b.error or ""]
                    )
        except psycopg.Error as exc:
            rows_slots.append([db.name, db.slot.name, "unreachable", str(exc).strip()])

    def table(headers: list[str], rows: list[list[Any]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        body = (
            "".join("<tr>" + "".join(_cell(v) for v in r) + "</tr>" for r in rows)
            or f"<tr><td colspan={len(headers)}>none</td></tr>"
        )
        return f"<table><tr>{head}</tr>{body}</table>"

    return _page(
        "<h2>Replication slots</h2>"
        + table(["database", "slot", "active", "lag bytes"], rows_slots)
        + "<h2>Sinks</h2>"
        + table(
            ["sink", "type", "tables", "visible messages", "outstanding", "parked", "discarded", "destination"],
            rows_sinks,
        )
        + "<h2>Backfills</h2>"
        + table(["id", "sink", "table", "kind", "progress", "error"], rows_backfills)
    )


def _page(body: str) -> str:
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>Sequin</title><style>"
        "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1.5em}"
        "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}</style></head><body>"
        f"<h1>Sequin</h1>{body}</body></html>"
    )


def _token_form(reason: str) -> str:
    return _page(
        f"<p>{html.escape(reason)}</p><form method='get'><input name='token' type='password' size='60' "
        "placeholder='sqn_...'> <button>Show</button></form>"
    )


class LazySequinApp:
    """ASGI app that builds the stream API (plus the UI page) from ``$SEQUIN_CONFIG`` on first use."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    def _build(self) -> Any:
        from sequin_provider.config import ConfigError, load_config
        from sequin_provider.hooks.sequin import airflow_dsn
        from sequin_provider.stream_api import StreamService, create_app

        try:  # the config's conn_ids as Airflow resolves them (environment, secrets backends, metadata DB)
            config = load_config(os.environ.get("SEQUIN_CONFIG"), resolve_conn_id=airflow_dsn)
        except ConfigError as exc:
            broken = FastAPI()
            message = str(exc)

            @broken.api_route("/{path:path}", methods=["GET", "POST"])
            async def unavailable(path: str) -> Response:
                return HTMLResponse(_page(f"<p>Sequin is not configured: {html.escape(message)}</p>"), 503)

            return broken
        service = StreamService(config)
        app = create_app(config, service)

        @app.get("/ui/", include_in_schema=False, response_class=HTMLResponse)
        async def ui(request: Request, token: str | None = None) -> HTMLResponse:
            from starlette.concurrency import run_in_threadpool

            service.ensure_open()
            token = token or request.cookies.get(TOKEN_COOKIE)
            page = await run_in_threadpool(status_page, config, service, token)
            response = HTMLResponse(page)
            if token and "<form" not in page:
                response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict", path=URL_PREFIX)
            return response

        return app

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
