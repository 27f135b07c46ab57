"""The chaos workload: random transactions of 1–1,000 rows over two tables, surviving server restarts.

What committed is not tracked here but by the database itself: a trigger writes every row change
into ``chaos_audit`` inside the changing transaction, so a commit whose answer was lost to a
restart is still known exactly. Every write gives the row a fresh ``ver`` from one sequence, so a
change is identified by (table, primary key, action, ver), and deletes carry the old ``ver``
(REPLICA IDENTITY FULL).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import psycopg

SCHEMA = [
    "CREATE SEQUENCE chaos_ver",
    "CREATE TABLE accounts (id int PRIMARY KEY, ver bigint NOT NULL, balance int NOT NULL, note text)",
    "ALTER TABLE accounts REPLICA IDENTITY FULL",
    "CREATE TABLE lines (order_id int, line int, ver bigint NOT NULL, qty int NOT NULL, PRIMARY KEY (order_id, line))",
    "ALTER TABLE lines REPLICA IDENTITY FULL",
    "CREATE TABLE chaos_audit (seq bigserial PRIMARY KEY, tbl text NOT NULL, pk text NOT NULL, action text NOT NULL,"
    " ver bigint NOT NULL, xid bigint NOT NULL DEFAULT txid_current(), at timestamptz NOT NULL DEFAULT clock_timestamp())",
    """CREATE FUNCTION chaos_audit() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE
        r jsonb := to_jsonb(CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END);
    BEGIN
        INSERT INTO chaos_audit (tbl, pk, action, ver) VALUES (TG_TABLE_NAME,
            CASE WHEN TG_TABLE_NAME = 'accounts' THEN r->>'id' ELSE (r->>'order_id') || ',' || (r->>'line') END,
            lower(TG_OP), (r->>'ver')::bigint);
        RETURN NULL;
    END $$""",
]

AUDIT_TRIGGERS = [
    "CREATE TRIGGER audit AFTER INSERT OR UPDATE OR DELETE ON accounts FOR EACH ROW EXECUTE FUNCTION chaos_audit()",
    "CREATE TRIGGER audit AFTER INSERT OR UPDATE OR DELETE ON lines FOR EACH ROW EXECUTE FUNCTION chaos_audit()",
]

TABLES = ("accounts", "lines")


def create_schema(dsn: str, seed_accounts: int) -> None:
    """The tables, ``seed_accounts`` rows that exist before replication starts (only a backfill
    can deliver them), then the audit triggers."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in SCHEMA:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO accounts SELECT g, nextval('chaos_ver'), 0, 'seed' FROM generate_series(1, %s) g",
            (seed_accounts,),
        )
        for statement in AUDIT_TRIGGERS:
            conn.execute(statement)
        conn.execute("ANALYZE")


def row_key(table: str, record: dict[str, Any]) -> str:
    """The primary key of a row as ``chaos_audit.pk`` writes it."""
    return str(record["id"]) if table == "accounts" else f"{record['order_id']},{record['line']}"


def committed_changes(dsn: str) -> list[tuple[str, str, str, int]]:
    """Every committed change: (table, key, action, ver), in commit order per key."""
    with psycopg.connect(dsn) as conn:
        return [tuple(r) for r in conn.execute("SELECT tbl, pk, action, ver FROM chaos_audit ORDER BY seq")]


def final_rows(dsn: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The tables' rows now, by (table, key)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with psycopg.connect(dsn) as conn:
        for table in TABLES:
            cur = conn.execute(f"SELECT * FROM {table}")
            names = [d.name for d in cur.description or []]
            for values in cur:
                record = dict(zip(names, values))
                rows[(table, row_key(table, record))] = record
    return rows


def transaction_size(rng: random.Random) -> int:
    """Rows in the next transaction: mostly a few, sometimes hundreds, at most 1,000."""
    draw = rng.random()
    if draw < 0.70:
        return rng.randint(1, 10)
    if draw < 0.95:
        return rng.randint(11, 100)
    return rng.randint(101, 1000)


class Workload:
    """Writes random transactions from a thread at about ``rate`` row changes per second.

    Connection errors (a restarting server) are waited out and the transaction is not retried:
    whether it committed is for ``chaos_audit`` to say.
    """

    def __init__(self, dsn: str, rate: float, accounts: int, orders: int, seed: int) -> None:
        self.dsn = dsn
        self.rate = rate
        self.accounts = accounts
        self.orders = orders
        self.rng = random.Random(seed)
        self.transactions = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-workload", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Workload:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop writing; raises what broke the workload, if anything did."""
        self._stop.set()
        self._thread.join(60)
        if self.error:
            raise self.error

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self._stop.is_set():
                size = transaction_size(self.rng)
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.dsn, connect_timeout=5)
                    with conn.transaction():
                        self._write(conn, size)
                    self.transactions += 1
                except psycopg.OperationalError:
                    self.errors += 1
                    if conn is not None:
                        conn.close()
                    conn = None
                    self._stop.wait(0.5)
                    continue
                self._stop.wait(size / self.rate)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc
        finally:
            if conn is not None:
                conn.close()

    def _write(self, conn: psycopg.Connection[Any], size: int) -> None:
        """One transaction of about ``size`` row changes: upserts, updates and deletes on both tables."""
        rng = self.rng
        left = size
        while left > 0:
            n = min(left, rng.randint(1, max(1, size // 2)))
            left -= n
            what = rng.random()
            if what < 0.35:
                ids = rng.sample(range(1, self.accounts + 1), min(n, self.accounts))
                conn.execute(
                    "INSERT INTO accounts (id, ver, balance, note) SELECT i, nextval('chaos_ver'), 0, 'new'"
                    " FROM unnest(%s::int[]) i ON CONFLICT (id) DO UPDATE SET ver = EXCLUDED.ver,"
                    " balance = accounts.balance + 1, note = 'upserted'",
                    (ids,),
                )
            elif what < 0.55:
                ids = rng.sample(range(1, self.accounts + 1), min(n, self.accounts))
                conn.execute(
                    "UPDATE accounts SET ver = nextval('chaos_ver'), balance = balance - 1 WHERE id = ANY(%s)", (ids,)
                )
            elif what < 0.62:
                ids = rng.sample(range(1, self.accounts + 1), min(n, self.accounts))
                conn.execute("DELETE FROM accounts WHERE id = ANY(%s)", (ids,))
            elif what < 0.90:
                orders = rng.sample(range(1, self.orders + 1), min(max(1, n // 4), self.orders))
                conn.execute(
                    "INSERT INTO lines (order_id, line, ver, qty) SELECT o, l, nextval('chaos_ver'), 1"
                    " FROM unnest(%s::int[]) o, generate_series(1, 4) l ON CONFLICT (order_id, line)"
                    " DO UPDATE SET ver = EXCLUDED.ver, qty = lines.qty + 1",
                    (orders,),
                )
            else:
                orders = rng.sample(range(1, self.orders + 1), min(max(1, n // 4), self.orders))
                conn.execute("DELETE FROM lines WHERE order_id = ANY(%s) AND line > 2", (orders,))
