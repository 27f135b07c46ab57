"""Where a recorded backfill runs (``backfill.place_backfill``), the one decision behind
``sequin backfill start`` and ``SequinBackfillOperator``: real advisory locks in a real store."""

from __future__ import annotations

import psycopg
import pytest
from airflow.sdk.exceptions import AirflowException

from sequin_provider.airflow_errors import airflow_errors
from sequin_provider.backfill import place_backfill, run_lock, server_lock
from sequin_provider.exceptions import StoreUnavailableError
from sequin_provider.hooks.sequin import store_errors


def test_nobody_runs_it_and_no_server_is_up_so_the_caller_runs_it(dsn: str) -> None:
    assert place_backfill(dsn, "sequin", "app", 1) == place_backfill(dsn, "sequin", "app", 1, takeover_wait=0)
    assert place_backfill(dsn, "sequin", "app", 1).where == "here"


def test_a_backfill_server_up_for_the_database_takes_it(dsn: str) -> None:
    server = server_lock(dsn, "sequin", "app", "the backfill server")
    assert server.acquire()
    try:
        placement = place_backfill(dsn, "sequin", "app", 1)
        assert placement.where == "server" and "the backfill server" in str(placement.holder)
        assert placement.server is not None and placement.server.held_elsewhere()
        assert place_backfill(dsn, "sequin", "other_db", 1).where == "here"  # a server of another database
    finally:
        server.release()


def test_an_app_holding_the_run_lock_runs_it_when_a_takeover_is_asked(dsn: str) -> None:
    app = run_lock(dsn, "sequin", 7, "an earlier app")
    server = server_lock(dsn, "sequin", "app", "the backfill server")
    assert app.acquire() and server.acquire()
    try:
        placement = place_backfill(dsn, "sequin", "app", 7, takeover_wait=0)
        assert placement.where == "elsewhere" and "an earlier app" in str(placement.holder)
        # a new backfill (no takeover asked) does not look at run locks: the server takes it
        assert place_backfill(dsn, "sequin", "app", 7).where == "server"
    finally:
        app.release()
        server.release()
    assert place_backfill(dsn, "sequin", "app", 7, takeover_wait=0).where == "here"


def test_an_unreachable_store_is_a_store_error_and_a_retryable_task_failure(pg: object) -> None:
    dead = "host=127.0.0.1 port=1 dbname=x connect_timeout=2"
    with pytest.raises(StoreUnavailableError, match="cannot reach the store: "):
        with store_errors("the store", psycopg.Error):
            place_backfill(dead, "sequin", "app", 1)
    with pytest.raises(AirflowException, match="cannot reach the store") as raised:
        with airflow_errors(), store_errors("the store"):
            place_backfill(dead, "sequin", "app", 1)
    assert type(raised.value) is AirflowException  # not AirflowFailException: a retry may find the store back
