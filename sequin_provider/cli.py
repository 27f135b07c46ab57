"""The ``sequin`` command: ``init``, ``status``, ``stream``, ``messages``, ``backfill``, ``api``, ``token``, ``buffer``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import psycopg

from sequin_provider import store
from sequin_provider.config import ConfigError, SequinConfig, load_config
from sequin_provider.exceptions import DestinationError, ReplayError
from sequin_provider.pgoutput import int_to_lsn
from sequin_provider.replication import ReplicationError, slot_info
from sequin_provider.store import BackfillError
from sequin_provider.stream_queue import TokenError


def _config(args: argparse.Namespace) -> SequinConfig:
    return load_config(args.config)


def cmd_init(args: argparse.Namespace) -> int:
    """Provision every configured database (or one)."""
    from sequin_provider.provisioning import initialize

    config = _config(args)
    names = [args.database] if args.database else [d.name for d in config.databases]
    for name in names:
        report = initialize(config, name)
        for warning in report.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        done = ", ".join(report.created) or "nothing to create (already initialised)"
        print(f"{name}: {done}")
    return 0


def _status(config: SequinConfig) -> list[dict[str, Any]]:
    out = []
    for db in config.databases:
        entry: dict[str, Any] = {"database": db.name, "slot": db.slot.name}
        try:
            with psycopg.connect(db.dsn, connect_timeout=5) as conn:
                info = slot_info(conn, db.slot.name)
            entry.update(slot_exists=info is not None)
            if info:
                entry.update(
                    active=info.active,
                    lag_bytes=info.lag_bytes,
                    retained_bytes=info.retained_bytes,
                    confirmed_flush_lsn=int_to_lsn(info.confirmed_flush_lsn or 0),
                )
        except psycopg.Error as exc:
            entry["error"] = str(exc).strip()
        try:
            with psycopg.connect(config.store_dsn(db.name), connect_timeout=5) as conn:
                if store.schema_version(conn, config.store.schema):
                    rows = [r for r in store.read_status(conn, config.store.schema) if r["database"] == db.name]
                    if rows:
                        entry["stream"] = {
                            k: (v.isoformat() if hasattr(v, "isoformat") else v)
                            for k, v in rows[0].items()
                            if k != "database"
                        }
                    entry["sinks"] = {
                        sink.name: sink.destination.kind.counts(conn, config.store.schema, sink.name)
                        for sink in config.sinks_of(db.name)
                    }  # each kind reports its own
                    entry["messages"] = {
                        name: counts["total"] for name, counts in entry["sinks"].items() if "total" in counts
                    }
        except psycopg.Error as exc:
            entry["store_error"] = str(exc).strip()
        health = {sink.name: sink.destination.kind.health(sink) for sink in config.sinks_of(db.name)}
        entry["health"] = {name: line for name, line in health.items() if line is not None}
        out.append(entry)
    return out


def _counts_line(counts: dict[str, int]) -> str:
    """A sink's counts (``DestinationKind.counts``) in ``sequin status``: a stream's total as
    "N messages in the stream", any other kind's counts as "N name, ..."."""
    if "total" in counts:
        return f"{counts['total']} messages in the stream"
    return ", ".join(f"{n} {name}" for name, n in counts.items())


def cmd_status(args: argparse.Namespace) -> int:
    """Slot position and lag, stream app heartbeat, each sink's counts (its kind's)."""
    status = _status(_config(args))
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    for entry in status:
        stream = entry.get("stream") or {}
        print(
            f"{entry['database']}: slot {entry['slot']} "
            f"{'active' if entry.get('active') else 'inactive'}, lag {entry.get('lag_bytes', '?')} bytes, "
            f"last batch {stream.get('last_batch_id', '-')} at {stream.get('last_batch_at', '-')}, "
            f"{stream.get('total_rows', 0)} changes processed"
        )
        for sink, counts in sorted((entry.get("sinks") or {}).items()):
            if counts:
                print(f"  sink {sink}: {_counts_line(counts)}")
        for sink, line in sorted((entry.get("health") or {}).items()):
            print(f"  sink {sink} destination: {line}")
        for key in ("error", "store_error"):
            if key in entry:
                print(f"  {key.replace('_', ' ')}: {entry[key]}")
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    """Run the replication stream app in this process (local Spark unless --master)."""
    from sequin_provider.spark.app import run_stream_app

    return run_stream_app(args.config, args.database, args.checkpoint, args.master)


def cmd_messages(args: argparse.Namespace) -> int:
    """Print a sink's stream messages in position order (JSON lines)."""
    config = _config(args)
    with psycopg.connect(config.store_dsn(args.database), connect_timeout=5) as conn:
        for message in store.stream_messages(conn, config.store.schema, args.sink, visible_only=True)[-args.limit :]:
            print(message.data)
    return 0


def _store_conn(config: SequinConfig, database: str | None) -> psycopg.Connection[Any]:
    return psycopg.connect(config.store_dsn(database), connect_timeout=5)


def _database_of_sink(config: SequinConfig, sink: str) -> str:
    return config.sink(sink).database


def _run_backfill(args: argparse.Namespace, backfill_id: int) -> int:
    from sequin_provider.spark.backfill_app import run_backfill_app

    return run_backfill_app(args.config, backfill_id, args.master, args.ranges, args.max_page_rows, args.window_timeout)


def cmd_backfill_start(args: argparse.Namespace) -> int:
    """Validate and record a backfill, then run it (unless --no-run)."""
    from sequin_provider.backfill import create_backfill, follow_backfill, place_backfill, progress_line

    config = _config(args)
    database = config.database(_database_of_sink(config, args.sink))
    with (
        psycopg.connect(database.dsn, autocommit=True, connect_timeout=5) as source,
        _store_conn(config, database.name) as conn,
    ):
        store.migrate(conn, config.store.schema)
        conn.commit()
        backfill = create_backfill(
            source,
            conn,
            config,
            args.sink,
            args.table,
            args.sort_column,
            args.start_position,
            args.max_query_ms,
            where=args.where,
        )
    print(
        f"backfill {backfill.id}: {backfill.kind} backfill of {backfill.table_schema}.{backfill.table_name} for sink "
        f"{backfill.sink!r}, about {backfill.rows_initial if backfill.rows_initial is not None else '?'} rows"
    )
    if args.no_run:
        print(
            f"recorded as pending; run it with: sequin backfill run {backfill.id} (or a `sequin backfill serve`"
            " running for the database takes it)"
        )
        return 0
    placement = place_backfill(
        config.store_dsn(database.name),
        config.store.schema,
        database.name,
        backfill.id,
        application_name="sequin-backfill-server",
    )
    if placement.where == "server" and placement.server is not None:
        print(
            f"the backfill server ({placement.holder}) runs it; following it (Ctrl-C stops following, not the"
            " backfill)",
            flush=True,
        )
        final = follow_backfill(
            config.store_dsn(database.name),
            config.store.schema,
            backfill.id,
            placement.server,
            lambda line: print(line, flush=True),
        )
        if final is not None:
            print(f"backfill {final.id}: {progress_line(final)}")
            return 0 if final.state == "completed" else 1
        print("the backfill server went away before the backfill ended; running it here", flush=True)
    return _run_backfill(args, backfill.id)


def cmd_backfill_serve(args: argparse.Namespace) -> int:
    """Keep a backfill server up: each backfill of the database(s) runs as it is recorded, in one Spark app."""
    from sequin_provider.spark.backfill_app import run_backfill_server_app

    return run_backfill_server_app(
        args.config,
        args.database,
        args.master,
        args.poll_interval,
        args.ranges,
        args.max_page_rows,
        args.window_timeout,
    )


def cmd_backfill_run(args: argparse.Namespace) -> int:
    """Run (or resume) recorded backfills: one by id, or every pending and running one."""
    config = _config(args)
    if args.id is not None:
        return _run_backfill(args, args.id)
    code = 0
    for db in config.databases:
        with _store_conn(config, db.name) as conn:
            ids = [
                b.id
                for b in store.list_backfills(conn, config.store.schema)
                if b.state in store.ACTIVE_BACKFILL_STATES and _database_of_sink(config, b.sink) == db.name
            ]
        for backfill_id in sorted(ids):
            code = max(code, _run_backfill(args, backfill_id))
    return code


def cmd_backfill_status(args: argparse.Namespace) -> int:
    """A progress line per backfill (or one)."""
    from sequin_provider.backfill import progress_line

    config = _config(args)
    out: list[store.Backfill] = []
    for db in config.databases:
        with _store_conn(config, db.name) as conn:
            if not store.schema_version(conn, config.store.schema):
                continue
            if args.id is not None:
                try:
                    out.append(store.get_backfill(conn, config.store.schema, args.id))
                except BackfillError:
                    continue
            else:
                out += store.list_backfills(conn, config.store.schema, args.sink)
        if config.store.dsn:
            break  # one shared store
    if args.id is not None and not out:
        raise BackfillError(f"no backfill with id {args.id}")
    if args.json:
        print(json.dumps([b.__dict__ for b in out], indent=2, default=str))
        return 0
    for b in out:
        print(
            f"backfill {b.id} [{b.sink} {b.table_schema}.{b.table_name} {b.kind}"
            f"{' from ' + b.sort_column + ' >= ' + repr(b.start_position) if b.sort_column else ''}"
            f"{' where ' + b.where if b.where else ''}]: {progress_line(b)}"
            f"{'; requested by ' + b.requested_by if b.requested_by else ''}"
        )
    return 0


def cmd_backfill_cancel(args: argparse.Namespace) -> int:
    """Cancel a pending or running backfill (its Spark tasks stop at their next page)."""
    config = _config(args)
    for db in config.databases:
        with _store_conn(config, db.name) as conn:
            try:
                store.get_backfill(conn, config.store.schema, args.id)
            except BackfillError:
                continue
            backfill = store.transition_backfill(conn, config.store.schema, args.id, "cancelled")
            print(f"backfill {backfill.id}: cancelled after {backfill.rows_processed:,} rows")
            return 0
    raise BackfillError(f"no backfill with id {args.id}")


def _token_store(config: SequinConfig) -> psycopg.Connection[Any]:
    """The store holding API tokens: the first database's (migrated)."""
    conn = psycopg.connect(config.store_dsn(config.databases[0].name), connect_timeout=5)
    store.migrate(conn, config.store.schema)
    conn.commit()
    return conn


def cmd_token_create(args: argparse.Namespace) -> int:
    """Create an API token and print it (it is shown only this once)."""
    from sequin_provider import stream_queue

    config = _config(args)
    with _token_store(config) as conn:
        token = stream_queue.create_token(conn, config.store.schema, args.name)
    print(token)
    print(f"token {args.name!r} created; it is stored hashed and cannot be shown again", file=sys.stderr)
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    """Revoke an API token by name."""
    from sequin_provider import stream_queue

    config = _config(args)
    with _token_store(config) as conn:
        stream_queue.revoke_token(conn, config.store.schema, args.name)
    print(f"token {args.name!r} revoked")
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    """List API tokens (names and dates; tokens themselves are not stored)."""

    config = _config(args)
    with _token_store(config) as conn:
        for name, created, revoked in store.list_api_tokens(conn, config.store.schema):
            state = f"revoked {revoked:%Y-%m-%d %H:%M:%S}" if revoked else "active"
            print(f"{name}\tcreated {created:%Y-%m-%d %H:%M:%S}\t{state}")
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    """Serve the Sequin Stream HTTP pull API (until SIGTERM or Ctrl-C: open long polls answer at once)."""
    from sequin_provider.stream_api import serve

    config = _config(args)
    for db in config.databases:  # the tables must exist before the first request
        with psycopg.connect(config.store_dsn(db.name), connect_timeout=5) as conn:
            store.migrate(conn, config.store.schema)
    streams = [s.name for s in config.sinks if s.destination.kind.stored]
    print(
        f"serving Sequin Streams {', '.join(streams) or '(none configured)'} on http://{args.host}:{args.port}"
        f" (OpenAPI: /docs)",
        file=sys.stderr,
    )
    serve(config, args.host, args.port, args.log_level)
    return 0


def cmd_buffer_retry(args: argparse.Namespace) -> int:
    """Retry due parked messages (one sink or all); exit 1 if some are still parked."""
    from sequin_provider.sinks.retry import retry_sinks

    reports = retry_sinks(_config(args), args.sink)
    for report in reports:
        print(report.line())
        for error in report.errors:
            print(f"  {error}", file=sys.stderr)
    return 1 if any(r.still_parked for r in reports) else 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay retained changes from a changelog sink into a sink; exit 1 if some are still parked."""
    from sequin_provider.replay import ReplayRequest, replay_changes

    request = ReplayRequest(args.source, args.sink, tuple(args.table or ()), args.since, args.until, args.where)
    result = replay_changes(_config(args), request, deliver=not args.no_deliver)
    print(result.line())
    for error in result.delivery.errors if result.delivery else []:
        print(f"  {error}", file=sys.stderr)
    return 1 if result.delivery is not None and result.delivery.still_parked else 0


def cmd_buffer_list(args: argparse.Namespace) -> int:
    """List parked and discarded messages."""

    config = _config(args)
    out: list[dict[str, Any]] = []
    for db in config.databases:
        with _store_conn(config, db.name) as conn:
            if store.schema_version(conn, config.store.schema) < 6:
                continue
            for m in store.list_buffered(conn, config.store.schema, args.sink, args.state):
                if _database_of_sink_or_none(config, m.sink) in (db.name, None):
                    out.append(
                        {
                            "sink": m.sink,
                            "commit_lsn": m.commit_lsn,
                            "commit_idx": m.commit_idx,
                            "group": m.group_id,
                            "state": m.state,
                            "attempts": m.attempts,
                            "next_attempt_at": m.next_attempt_at.isoformat(),
                            "error": m.last_error,
                        }
                    )
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for m in out:
            print(
                f"{m['sink']}\t{int_to_lsn(m['commit_lsn'])}:{m['commit_idx']}\t{m['group']}\t{m['state']}"
                f"\tattempts {m['attempts']}\tnext {m['next_attempt_at']}\t{m['error']}"
            )
        print(f"{len(out)} buffered messages", file=sys.stderr)
    return 0


def _database_of_sink_or_none(config: SequinConfig, sink: str) -> str | None:
    return config.sink(sink).database if config.has_sink(sink) else None


def _set_buffer_state(args: argparse.Namespace, to_state: str) -> int:

    config = _config(args)
    database = _database_of_sink(config, args.sink)
    with _store_conn(config, database) as conn:
        store.migrate(conn, config.store.schema)
        conn.commit()
        count = store.set_buffered_state(conn, config.store.schema, args.sink, to_state, args.group)
    verb = "discarded" if to_state == "discarded" else "requeued"
    print(f"{count} messages of sink {args.sink!r}{f' group {args.group!r}' if args.group else ''} {verb}")
    return 0


def cmd_buffer_discard(args: argparse.Namespace) -> int:
    """Give up parked messages (kept as discarded, with their errors); their groups move on."""
    return _set_buffer_state(args, "discarded")


def cmd_buffer_requeue(args: argparse.Namespace) -> int:
    """Put discarded messages back in line, due now with their attempts reset."""
    return _set_buffer_state(args, "parked")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    from sequin_provider.backfill.control import DEFAULT_MAX_PAGE_ROWS, DEFAULT_WINDOW_TIMEOUT

    p.add_argument("--master", default=None, help="Spark master (default: local[2], or SEQUIN_SPARK_MASTER)")
    p.add_argument(
        "--ranges", type=int, default=None, help="key ranges read in parallel (default: Spark's parallelism)"
    )
    p.add_argument("--max-page-rows", type=int, default=DEFAULT_MAX_PAGE_ROWS)
    p.add_argument(
        "--window-timeout",
        type=float,
        default=DEFAULT_WINDOW_TIMEOUT,
        help="seconds to wait for the stream app to take a page before failing",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``sequin``."""
    parser = argparse.ArgumentParser(prog="sequin", description="Postgres change data capture on Spark and Airflow")
    parser.add_argument("--config", default=None, help="sequin.yaml (default: $SEQUIN_CONFIG or ./sequin.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="check prerequisites; create store schema, publication and slot")
    p.add_argument("--database", default=None)
    p.set_defaults(func=cmd_init)
    p = sub.add_parser("status", help="slot lag, stream heartbeat, counts per sink")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("stream", help="run the replication stream app (Spark) in the foreground")
    p.add_argument("--database", default=None)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--master", default=None)
    p.set_defaults(func=cmd_stream)
    p = sub.add_parser("messages", help="print a sink's stream messages")
    p.add_argument("sink")
    p.add_argument("--database", default=None)
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(func=cmd_messages)
    p = sub.add_parser("api", help="serve the Sequin Stream HTTP pull API (receive/ack/nack)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7376)
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_api)
    buf = sub.add_parser("buffer", help="retry, list, discard and requeue parked messages").add_subparsers(
        dest="buffer_command", required=True
    )
    p = buf.add_parser("retry", help="redeliver due parked messages, group by group in order")
    p.add_argument("--sink", default=None)
    p.set_defaults(func=cmd_buffer_retry)
    p = buf.add_parser("list", help="parked and discarded messages")
    p.add_argument("--sink", default=None)
    p.add_argument("--state", choices=["parked", "discarded"], default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_buffer_list)
    for name, func, what in (
        ("discard", cmd_buffer_discard, "give up a sink's parked messages (kept as discarded)"),
        ("requeue", cmd_buffer_requeue, "put a sink's discarded messages back in line"),
    ):
        p = buf.add_parser(name, help=what)
        p.add_argument("sink")
        p.add_argument("--group", default=None, help="only this group")
        p.set_defaults(func=func)
    token = sub.add_parser("token", help="create, revoke and list API tokens").add_subparsers(
        dest="token_command", required=True
    )
    p = token.add_parser("create", help="create a token and print it (shown once)")
    p.add_argument("name")
    p.set_defaults(func=cmd_token_create)
    p = token.add_parser("revoke", help="revoke a token")
    p.add_argument("name")
    p.set_defaults(func=cmd_token_revoke)
    p = token.add_parser("list", help="list tokens")
    p.set_defaults(func=cmd_token_list)
    p = sub.add_parser(
        "replay",
        help="deliver retained changes again: from a changelog sink into a sink, for a range and a condition",
    )
    p.add_argument("source", help="the changelog sink (postgres_table or iceberg, mode: changelog)")
    p.add_argument("sink", help="the sink to deliver the changes to")
    p.add_argument("--table", action="append", help="schema.table (repeatable; default: every table both sinks have)")
    p.add_argument(
        "--since", default=None, help="from this commit time (ISO 8601) or position (<lsn>:<idx>, 16/B374D848)"
    )
    p.add_argument("--until", default=None, help="before this commit time or position")
    p.add_argument(
        "--where",
        default=None,
        help="only the changes matching this SQL condition over the changelog's columns (record->>'status' = 'paid')",
    )
    p.add_argument("--no-deliver", action="store_true", help="only queue them (sequin buffer retry delivers them)")
    p.set_defaults(func=cmd_replay)
    backfill = sub.add_parser("backfill", help="start, run, watch and cancel backfills").add_subparsers(
        dest="backfill_command", required=True
    )
    p = backfill.add_parser("start", help="record a backfill of a sink's table and run it (Spark)")
    p.add_argument("sink")
    p.add_argument("table")
    p.add_argument("--sort-column", default=None, help="partial backfill: rows with sort column >= start position")
    p.add_argument("--start-position", default=None)
    p.add_argument("--max-query-ms", type=int, default=5000, help="time budget of one page query (1-600000)")
    p.add_argument(
        "--where",
        default=None,
        help="only the rows matching this SQL condition over the table's columns (run on the source; for operators)",
    )
    p.add_argument("--no-run", action="store_true", help="only record it (pending)")
    _add_run_options(p)
    p.set_defaults(func=cmd_backfill_start)
    p = backfill.add_parser("run", help="run or resume a recorded backfill (default: every pending/running one)")
    p.add_argument("id", type=int, nargs="?")
    _add_run_options(p)
    p.set_defaults(func=cmd_backfill_run)
    from sequin_provider.backfill import SERVE_POLL_INTERVAL

    p = backfill.add_parser("serve", help="stay up and run each backfill as it is recorded (one Spark app for all)")
    p.add_argument("--database", default=None, help="only this database's backfills (default: every database)")
    p.add_argument(
        "--poll-interval", type=float, default=SERVE_POLL_INTERVAL, help="seconds between looks for new backfills"
    )
    _add_run_options(p)
    p.set_defaults(func=cmd_backfill_serve)
    p = backfill.add_parser("status", help="progress of backfills")
    p.add_argument("id", type=int, nargs="?")
    p.add_argument("--sink", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_backfill_status)
    p = backfill.add_parser("cancel", help="cancel a pending or running backfill")
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_backfill_cancel)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sequin`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, ReplicationError, BackfillError, TokenError, DestinationError, ReplayError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"error: cannot connect: {str(exc).strip()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
