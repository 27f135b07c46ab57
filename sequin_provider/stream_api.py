"""The Sequin Stream HTTP pull API (DESIGN §9, reference/002): receive, ack and nack over HTTP.

Wire-compatible with Sequin's public API: ``POST|GET /api/sequin_streams/{name}/receive``,
``POST .../ack`` and ``POST .../nack``, also under the older prefix ``/api/http_pull_consumers``.
Every request carries ``Authorization: Bearer <token>`` (tokens: ``sequin token create``). Errors
are JSON ``{"code": ..., "summary": ...}`` with status 400, 401, 403, 404, 413, 429 or 503.

Long polls (``wait_for``) wake as soon as the stream app makes new messages visible (NOTIFY on
``store.VISIBLE_CHANNEL``) and re-check at least every second, which also catches visibility
timeouts expiring and nacks from other API processes. ``max_waiting`` is enforced per API process.
Receives of a sink share its claims: one at a time per process, the receives that arrived meanwhile
claiming together (``receive_rounds``).

A receive whose client disconnects stops at once: a long poll watches its connection while it waits
and gives up its ``max_waiting`` slot; nothing is claimed once the client is gone, and messages
claimed while it went are released (``stream_queue.release``). ``serve`` (``sequin api``) answers
open long polls with no messages as soon as it is told to stop (SIGTERM, Ctrl-C), so it exits
within seconds. A store that cannot be reached answers 503 ``unavailable`` (one log line, no
traceback).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from types import FrameType
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

import anyio.to_thread
import psycopg
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from psycopg_pool import ConnectionPool, PoolTimeout
from pydantic import BaseModel, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.routing import Route

from sequin_provider import stream_queue
from sequin_provider.config import SequinConfig
from sequin_provider.metrics.api import ApiMetrics
from sequin_provider.receive_params import InvalidReceiveParameter, ReceiveParams, parse_receive
from sequin_provider.receive_rounds import ReceiveRounds
from sequin_provider.store import VISIBLE_CHANNEL

log = logging.getLogger(__name__)
ModelT = TypeVar("ModelT", bound="BaseModel")

PREFIXES = ("/api/sequin_streams", "/api/http_pull_consumers")
MAX_BODY_BYTES = 1024 * 1024
MAX_ACK_IDS = 10_000
TOKEN_CACHE_SECONDS = 2.0
RECHECK_SECONDS = 1.0
SHUTDOWN_GRACE_SECONDS = 3.0
"""After a stop signal, requests still running this long are cancelled (long polls end at once)."""
STORE_WARNING_SECONDS = 10.0
POOL_WAIT_SECONDS = 30.0
POOL_POLL_SECONDS = 0.5
"""A request waits up to ``POOL_WAIT_SECONDS`` for a pooled connection (then 503), in steps of
``POOL_POLL_SECONDS`` so that it gives up as soon as the process is stopping."""


class ApiError(Exception):
    """An error answered as ``{"code", "summary"}`` with an HTTP status."""

    def __init__(self, status: int, code: str, summary: str) -> None:
        super().__init__(summary)
        self.status, self.code, self.summary = status, code, summary


class ErrorBody(BaseModel):
    """Every error response."""

    code: str
    summary: str


class AckRequest(BaseModel):
    """``ack``/``nack`` body."""

    ack_ids: list[uuid.UUID] = Field(..., min_length=1, max_length=MAX_ACK_IDS)


class ReceivedMessage(BaseModel):
    """One delivered message: ``data`` is the message JSON (record, changes, action, metadata)."""

    ack_id: uuid.UUID
    data: dict[str, Any]


class ReceiveResponse(BaseModel):
    data: list[ReceivedMessage]


class SuccessResponse(BaseModel):
    success: bool


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what}
    for status, what in (
        (400, "invalid parameters or body"),
        (401, "missing or unknown bearer token"),
        (403, "revoked token"),
        (404, "no Sequin Stream sink of that name"),
        (413, "body larger than 1 MiB"),
        (429, "max_waiting long-polling receivers already waiting"),
        (503, "the message store is unavailable"),
    )
}


BEARER_SCHEME = {"type": "http", "scheme": "bearer", "description": "an API token from `sequin token create`"}


class ClientConnection:
    """Whether a request's client is still connected, watched from inside ``async with``: one task
    waits for the server's ``http.disconnect`` (enter after the request's body was read). ``gone()``
    reads what it saw, and ``watching(wake)`` has it set ``wake`` too, for a long poll.

    Asking the server instead (Starlette's ``Request.is_disconnected``, a cancelled receive) cost
    24 µs per question, two per receive; the watch costs about 17 µs per request, its task started,
    looked at and cancelled (``bench/api_per_message.py``). It takes its first look on entering, so a client gone already
    is seen before any claim; one that goes while its messages are claimed gets them released
    (``StreamService._claim``)."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._gone = False
        self._wakes: set[asyncio.Event] = set()
        self._watch: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ClientConnection:
        self._watch = asyncio.create_task(self._watch_disconnect())
        await asyncio.sleep(0)  # the task's first look: a client gone already is seen before any claim
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with suppress(asyncio.CancelledError):
                await self._watch

    async def _watch_disconnect(self) -> None:
        try:
            while (await self._request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a connection the server cannot read is one to answer no more
            log.debug("stream API: reading the client's connection failed; taken as gone", exc_info=True)
        self._gone = True
        for wake in self._wakes:
            wake.set()

    def gone(self) -> bool:
        """True once the client is known to have disconnected."""
        return self._gone

    @contextmanager
    def watching(self, wake: asyncio.Event) -> Iterator[None]:
        """While inside, a disconnect sets ``wake``."""
        self._wakes.add(wake)
        try:
            if self._gone:
                wake.set()
            yield
        finally:
            self._wakes.discard(wake)


@dataclass(frozen=True)
class Stream:
    """A Sequin Stream sink as the API serves it."""

    name: str
    store_dsn: str
    schema: str
    visibility_timeout: float
    max_ack_pending: int
    max_waiting: int


def _configure_connection(conn: psycopg.Connection[Any]) -> None:
    """A new pooled store connection: JIT off. A receive's one statement reads the size of the head
    it reads from the store (``store.claim_first``), so the planner estimates a tenth of the stream
    for it and, on a stream of a few hundred thousand messages, passes ``jit_above_cost``: JIT then
    compiled every receive for 58 ms, against 2-3 ms to run it."""
    conn.execute("SET jit = off")


class StreamService:
    """The API's state: streams, store pools, token checks, long-poll wake-ups and waiter counts."""

    def __init__(self, config: SequinConfig, pool_size: int = 16) -> None:
        self.streams = {
            s.name: Stream(
                s.name,
                config.store_dsn(s.database),
                config.store.schema,
                s.destination.options.visibility_timeout,
                s.destination.options.max_ack_pending,
                s.destination.options.max_waiting,
            )
            for s in config.sinks
            if s.destination.kind.stored
        }
        self.token_dsn = config.store_dsn(config.databases[0].name)
        self.schema = config.store.schema
        self.metrics = ApiMetrics(
            list(self.streams),
            {s.name: (s.database, config.store_dsn(s.database)) for s in config.sinks if s.name in self.streams},
            config.store.schema,
        )
        """This process's counters (``metrics.api``); ``/metrics`` serves them when ``metrics.api`` is on."""
        dsns = {s.store_dsn for s in self.streams.values()} | {self.token_dsn}
        # autocommit: a receive, an ack or a nack is one statement, committed with its answer (one
        # round trip; BEGIN and COMMIT of their own took two more: store.own_transaction)
        self.pools = {
            dsn: ConnectionPool(
                dsn,
                min_size=1,
                max_size=pool_size,
                open=False,
                kwargs={"autocommit": True, "connect_timeout": 5},
                configure=_configure_connection,
            )
            for dsn in dsns
        }
        self._tokens: dict[str, tuple[str, float]] = {}
        self._waiting: dict[str, int] = {}
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._receive_rounds: dict[tuple[asyncio.AbstractEventLoop, str], ReceiveRounds[stream_queue.Delivery]] = {}
        self._rounds_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._stopping = False
        self._listeners: list[threading.Thread] = []
        self._store_warned: tuple[str, float] = ("", 0.0)

    # lifecycle ---------------------------------------------------------------------------------
    def ensure_open(self) -> None:
        """Open on first use when no lifespan ran (an app mounted inside another, e.g. Airflow's)."""
        if self._loop is None:
            self.open()

    def open(self) -> None:
        """Open the pools and start one LISTEN thread per store (call inside the event loop)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        for pool in self.pools.values():
            pool.open(wait=False)
        for dsn in {s.store_dsn for s in self.streams.values()}:
            thread = threading.Thread(target=self._listen, args=(dsn,), name="sequin-api-listen", daemon=True)
            thread.start()
            self._listeners.append(thread)

    def stop_waiting(self) -> None:
        """Answer every long poll now, and new ones at once: the process is stopping (call in the
        event loop; ``request_stop`` from elsewhere)."""
        self._stopping = True
        for waiters in self._waiters.values():
            for wake in waiters:
                wake.set()

    def request_stop(self) -> None:
        """``stop_waiting`` from any thread or a signal handler."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.stop_waiting)

    def close(self) -> None:
        """Stop the listeners and close the pools."""
        self._stop.set()
        for thread in self._listeners:
            thread.join(timeout=2)
        for pool in self.pools.values():
            pool.close(timeout=2)

    def warn_store_unavailable(self, summary: str) -> None:
        """Log that the store cannot be reached: once per different reason, and at most every
        ``STORE_WARNING_SECONDS`` for the same one."""
        last, at = self._store_warned
        now = time.monotonic()
        if summary != last or now - at >= STORE_WARNING_SECONDS:
            self._store_warned = (summary, now)
            log.warning("stream API: %s", summary)

    def _listen(self, dsn: str) -> None:
        """Wake the long polls of a sink when the stream app makes its messages visible."""
        while not self._stop.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {VISIBLE_CHANNEL}")
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            schema, _, sink = note.payload.partition("/")
                            if schema == self.schema:
                                self._wake(sink)
            except psycopg.Error as exc:  # retried every 2 s; the same reason is logged once a while
                self.warn_store_unavailable(
                    f"LISTEN on the store failed ({str(exc).strip()}); long polls fall back to 1 s re-checks"
                )
                self._stop.wait(2.0)

    def _wake(self, sink: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._set_event, sink)

    def _set_event(self, sink: str) -> None:
        for wake in self._waiters.get(sink, ()):
            wake.set()

    # requests ----------------------------------------------------------------------------------
    def stream(self, name: str) -> Stream:
        """The stream called ``name`` (404 otherwise)."""
        stream = self.streams.get(name)
        if stream is None:
            raise ApiError(404, "not_found", f"no Sequin Stream sink named {name!r}")
        return stream

    def authorize(self, token: str) -> None:
        """Check a bearer token against the store (cached for a moment)."""
        self.check_token_status(self.cached_token_status(token) or self.fetch_token_status(token))

    def cached_token_status(self, token: str) -> str | None:
        """A token's status from the cache, or None when it has to be fetched (no I/O, so the
        event loop can call it)."""
        cached = self._tokens.get(token)
        return cached[0] if cached is not None and cached[1] >= time.monotonic() else None

    def fetch_token_status(self, token: str) -> str:
        """A token's status from the store, cached for ``TOKEN_CACHE_SECONDS``."""
        with self._connection(self.token_dsn) as conn:
            status = stream_queue.token_status(conn, self.schema, token)
        if len(self._tokens) > 10_000:
            self._tokens.clear()
        self._tokens[token] = (status, time.monotonic() + TOKEN_CACHE_SECONDS)
        return status

    @staticmethod
    def check_token_status(status: str) -> None:
        """Raise the API error for an unknown or revoked token."""
        if status == "unknown":
            raise ApiError(401, "unauthorized", "unknown API token")
        if status == "revoked":
            raise ApiError(403, "forbidden", "this API token has been revoked")

    def _run(self, stream: Stream, operation: Callable[[psycopg.Connection[Any]], Any]) -> Any:
        with self._connection(stream.store_dsn) as conn:
            return operation(conn)

    @contextmanager
    def _connection(self, dsn: str) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection of ``dsn`` (as ``pool.connection()``); waiting for one ends with
        ``PoolTimeout`` after ``POOL_WAIT_SECONDS``, or at once when the process is stopping."""
        pool = self.pools[dsn]
        deadline = time.monotonic() + POOL_WAIT_SECONDS
        while True:
            try:
                conn = pool.getconn(timeout=POOL_POLL_SECONDS)
                break
            except PoolTimeout:
                if self._stopping or time.monotonic() >= deadline:
                    raise
        try:
            with conn:
                yield conn
        finally:
            pool.putconn(conn)

    async def receive(
        self, stream: Stream, batch_size: int, wait_for_ms: int | None, client: ClientConnection
    ) -> list[stream_queue.Delivery]:
        """Deliverable messages now, or (long poll) as soon as some arrive within ``wait_for_ms``;
        nothing once ``client`` is gone, or (long poll) when the process is stopping."""
        if wait_for_ms is None:
            return await self._claim(stream, batch_size, client)
        if self._stopping:
            return []
        if self._waiting.get(stream.name, 0) >= stream.max_waiting:
            self.metrics.rejected.labels(stream.name).inc()
            raise ApiError(
                429,
                "too_many_requests",
                f"{stream.max_waiting} receivers are already waiting on {stream.name!r} (max_waiting)",
            )
        self._waiting[stream.name] = self._waiting.get(stream.name, 0) + 1
        wake = asyncio.Event()
        waiters = self._waiters.setdefault(stream.name, set())
        waiters.add(wake)
        try:
            with client.watching(wake):
                deadline = time.monotonic() + wait_for_ms / 1000.0
                while not self._stopping:
                    wake.clear()  # before the claim: a wake-up during it is not lost
                    got = await self._claim(stream, batch_size, client)
                    remaining = deadline - time.monotonic()
                    if got or remaining <= 0 or client.gone():
                        return got
                    with suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wake.wait(), timeout=min(remaining, RECHECK_SECONDS))
                return []
        finally:
            waiters.discard(wake)
            self._waiting[stream.name] -= 1

    async def _claim(self, stream: Stream, batch_size: int, client: ClientConnection) -> list[stream_queue.Delivery]:
        """Claim messages for a client still connected; what was claimed while it went is released
        (visible again at once, its delivery not counted)."""
        if client.gone():
            return []
        rounds = self._rounds(stream)
        self.metrics.in_claim_rounds.labels(stream.name).inc()
        try:
            got = await rounds.receive(batch_size, client.gone)
        finally:
            self.metrics.in_claim_rounds.labels(stream.name).dec()
        if got and client.gone():
            await self._release(stream, got)
            return []
        return got

    async def _release(self, stream: Stream, got: list[stream_queue.Delivery]) -> None:
        """Give back messages claimed for a client that went: visible again at once, their delivery
        not counted (or, when the store cannot be reached, after their visibility timeout)."""
        ack_ids = [d.ack_id for d in got]
        try:
            await run_in_threadpool(
                self._run, stream, lambda conn: stream_queue.release(conn, stream.schema, stream.name, ack_ids)
            )
        except psycopg.Error as exc:
            log.warning(
                "stream API: could not release %d messages of %r claimed for a client that went (%s);"
                " they come back after the visibility timeout",
                len(got),
                stream.name,
                str(exc).strip(),
            )
        self._set_event(stream.name)  # visible again: other long polls may take them

    def _rounds(self, stream: Stream) -> ReceiveRounds[stream_queue.Delivery]:
        """The sink's receive rounds in the running event loop (``receive_rounds``): one claim of a
        sink at a time in this process, shared by the receives waiting for it."""
        loop = asyncio.get_running_loop()
        with self._rounds_lock:
            rounds = self._receive_rounds.get((loop, stream.name))
            if rounds is None:
                self._receive_rounds = {k: v for k, v in self._receive_rounds.items() if not k[0].is_closed()}

                async def claim(batch_size: int) -> list[stream_queue.Delivery]:
                    self.metrics.claims.labels(stream.name).inc()
                    return await run_in_threadpool(
                        self._run,
                        stream,
                        lambda conn: stream_queue.receive(
                            conn,
                            stream.schema,
                            stream.name,
                            batch_size,
                            stream.visibility_timeout,
                            stream.max_ack_pending,
                        ),
                    )

                rounds = ReceiveRounds(claim, functools.partial(self._release, stream))
                self._receive_rounds[(loop, stream.name)] = rounds
        return rounds

    async def ack(self, stream: Stream, ack_ids: list[uuid.UUID]) -> int:
        count = int(
            await run_in_threadpool(
                self._run, stream, lambda conn: stream_queue.ack(conn, stream.schema, stream.name, ack_ids)
            )
        )
        self.metrics.acked.labels(stream.name).inc(count)
        return count

    async def nack(self, stream: Stream, ack_ids: list[uuid.UUID]) -> int:
        count = int(
            await run_in_threadpool(
                self._run, stream, lambda conn: stream_queue.nack(conn, stream.schema, stream.name, ack_ids)
            )
        )
        self._set_event(stream.name)  # nacked messages are deliverable now
        self.metrics.nacked.labels(stream.name).inc(count)
        return count


def _deliveries_json(deliveries: list[stream_queue.Delivery]) -> bytes:
    """The receive response, built from the stored JSON texts without re-encoding them."""
    return ('{"data":[' + ",".join(f'{{"ack_id":"{d.ack_id}","data":{d.data}}}' for d in deliveries) + "]}").encode()


class BodyLimit:
    """ASGI middleware: bodies over ``MAX_BODY_BYTES`` get 413 before any handler reads them."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = JSONResponse({"code": "payload_too_large", "summary": f"request body over {self.limit} bytes"}, 413)
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await too_big(scope, receive, send)
            return
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, "payload_too_large", f"request body over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


def _starlette_route(route: APIRoute) -> Route:
    """A plain Starlette route serving what ``route`` serves: its path, exactly its methods (Starlette
    adds HEAD to a GET route, and a HEAD receive would claim messages nobody gets), and its endpoint
    (the stream's name, the request) called with the path's name."""
    endpoint: Callable[[str, Request], Awaitable[Response]] = route.endpoint

    async def starlette_endpoint(request: Request) -> Response:
        return await endpoint(request.path_params["name"], request)

    served = Route(route.path, starlette_endpoint, methods=list(route.methods))
    served.methods = set(route.methods)
    return served


def _validation_summary(exc: RequestValidationError | Exception) -> str:
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return str(exc)
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query"))
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def _validated(model: type[ModelT], data: bytes | dict[str, str]) -> ModelT:
    """``data`` (a JSON body, strictly, or query parameters) as ``model``, or a 400 naming the first problem."""
    try:
        return model.model_validate_json(data, strict=True) if isinstance(data, bytes) else model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, "bad_request", _validation_summary(exc)) from None


def _query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    """OpenAPI query parameters for the fields of ``model``."""
    return [
        {
            "name": name,
            "in": "query",
            "required": False,
            "schema": {k: v for k, v in field.items() if k != "description"},
            "description": field.get("description", ""),
        }
        for name, field in model.model_json_schema()["properties"].items()
    ]


def _json_body(model: type[BaseModel], required: bool) -> dict[str, Any]:
    """An OpenAPI JSON request body of ``model``."""
    return {
        "required": required,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
    }


def create_app(config: SequinConfig, service: StreamService | None = None) -> FastAPI:
    """The FastAPI app serving every Sequin Stream sink of ``config``."""
    service = service or StreamService(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 200  # long polls hold no thread
        service.open()
        try:
            yield
        finally:
            await run_in_threadpool(service.close)

    app = FastAPI(
        title="Sequin Stream API",
        version="1",
        lifespan=lifespan,
        description="Pull messages of Sequin Stream sinks: receive, then ack or nack (consumer groups, "
        "visibility timeout, per-group order).",
    )
    app.state.service = service

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse({"code": exc.code, "summary": exc.summary}, exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"code": "bad_request", "summary": _validation_summary(exc)}, 400)

    @app.exception_handler(psycopg.OperationalError)
    async def store_unavailable(_: Request, exc: psycopg.OperationalError) -> JSONResponse:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        summary = f"the message store is unavailable: {reason}"
        service.warn_store_unavailable(summary)
        return JSONResponse({"code": "unavailable", "summary": summary}, 503, headers={"Retry-After": "1"})

    # The endpoints take the request itself and validate with the models above: FastAPI's per-parameter
    # dependency solving cost more CPU than the store's queries (bench/delivery_throughput.py). The
    # OpenAPI document still describes every parameter and body (openapi_extra, from the same models).
    async def authorize(request: Request) -> None:
        service.ensure_open()
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "unauthorized", "missing bearer token (Authorization: Bearer <token>)")
        service.check_token_status(
            service.cached_token_status(token) or await run_in_threadpool(service.fetch_token_status, token)
        )

    async def receive(name: str, request: Request) -> Response:
        await authorize(request)
        stream = service.stream(name)
        try:
            asked = parse_receive(request.query_params, await request.body())
        except InvalidReceiveParameter as exc:
            raise ApiError(400, "bad_request", str(exc)) from None
        async with ClientConnection(request) as client:
            got = await service.receive(stream, asked.batch_size, asked.wait_for_ms, client)
        service.metrics.receives.labels(name).inc()
        if got:
            service.metrics.received.labels(name).inc(len(got))
        return Response(_deliveries_json(got), media_type="application/json")

    def settle_endpoint(operation: str) -> Callable[[str, Request], Awaitable[Response]]:
        async def endpoint(name: str, request: Request) -> Response:
            await authorize(request)
            stream = service.stream(name)
            ids = _validated(AckRequest, await request.body()).ack_ids  # repeated ids count once (stream_queue)
            await (service.ack(stream, ids) if operation == "ack" else service.nack(stream, ids))
            return Response(b'{"success":true}', media_type="application/json")

        return endpoint

    security = {"security": [{"HTTPBearer": []}]}
    receive_doc = {
        **security,
        "parameters": _query_parameters(ReceiveParams),
        "requestBody": _json_body(ReceiveParams, False),
    }
    settle_doc = {**security, "requestBody": _json_body(AckRequest, True)}
    for prefix in PREFIXES:
        legacy = prefix != PREFIXES[0]
        suffix = "_legacy" if legacy else ""
        for method in ("POST", "GET"):
            app.add_api_route(
                f"{prefix}/{{name}}/receive",
                receive,
                methods=[method],
                openapi_extra=receive_doc,
                operation_id=f"receive_{method.lower()}{suffix}",
                response_model=ReceiveResponse,
                responses=ERROR_RESPONSES,
                include_in_schema=not legacy,
                tags=["Sequin Stream"],
                summary="Receive messages: at most one per group, invisible for the visibility timeout",
            )
        for operation in ("ack", "nack"):
            app.add_api_route(
                f"{prefix}/{{name}}/{operation}",
                settle_endpoint(operation),
                methods=["POST"],
                openapi_extra=settle_doc,
                operation_id=f"{operation}{suffix}",
                response_model=SuccessResponse,
                responses=ERROR_RESPONSES,
                include_in_schema=not legacy,
                tags=["Sequin Stream"],
                summary="Acknowledge messages (delete them)"
                if operation == "ack"
                else "Make messages visible again at once",
            )

    # The same endpoints as plain Starlette routes, matched before FastAPI's: FastAPI's per-request
    # handling (dependency solving, its request wrapper) cost the API a fifth of its CPU; its routes
    # above stay for the OpenAPI document and never match first.
    app.router.routes[:0] = [
        _starlette_route(route)
        for route in app.router.routes
        if isinstance(route, APIRoute) and route.path.startswith(PREFIXES)
    ]

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    if config.metrics.api:

        @app.get("/metrics", include_in_schema=False)
        async def metrics() -> Response:
            """Prometheus text (docs/metrics.md); the store is read off the event loop, with timeouts."""
            return Response(await run_in_threadpool(service.metrics.render), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        """FastAPI's document, minus the 422 it adds by default: validation errors answer 400 here."""
        if app.openapi_schema is None:
            document = FastAPI.openapi(app)
            for path in document.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = document.setdefault("components", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(name, None)
            for model in (ReceiveParams, AckRequest):
                components.setdefault("schemas", {})[model.__name__] = model.model_json_schema(
                    ref_template="#/components/schemas/{model}"
                )
            components.setdefault("securitySchemes", {})["HTTPBearer"] = BEARER_SCHEME
            app.openapi_schema = document
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(BodyLimit)
    return app


class StoppingServer(uvicorn.Server):
    """uvicorn that tells the API a stop signal came (``StreamService.request_stop``) before it
    waits for open requests: long polls answer at once instead of holding the exit for ``wait_for``."""

    def __init__(self, config: uvicorn.Config, service: StreamService) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.service.request_stop()
        super().handle_exit(sig, frame)


def serve(config: SequinConfig, host: str, port: int, log_level: str = "warning") -> None:
    """Serve the API until SIGTERM or Ctrl-C; open long polls answer with no messages at once, and
    whatever still runs ``SHUTDOWN_GRACE_SECONDS`` later is cancelled."""
    service = StreamService(config)
    server = StoppingServer(
        uvicorn.Config(
            create_app(config, service),
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
        ),
        service,
    )
    server.run()
