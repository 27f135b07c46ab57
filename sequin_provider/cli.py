"""The ``sequin`` command: ``init``, ``status``, ``stream``, ``messages``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import psycopg

from sequin_provider import store
from sequin_provider.config import ConfigError, SequinConfig, load_config
from sequin_provider.pgoutput import int_to_lsn
from sequin_provider.replication import ReplicationError, slot_info


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
                entry.update(active=info.active, lag_bytes=info.lag_bytes, retained_bytes=info.retained_bytes,
                             confirmed_flush_lsn=int_to_lsn(info.confirmed_flush_lsn or 0))
        except psycopg.Error as exc:
            entry["error"] = str(exc).strip()
        try:
            with psycopg.connect(config.store_dsn(db.name), connect_timeout=5) as conn:
                if store.schema_version(conn, config.store.schema):
                    rows = [r for r in store.read_status(conn, config.store.schema) if r["database"] == db.name]
                    if rows:
                        entry["stream"] = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in rows[0].items()
                                           if k != "database"}
                    entry["messages"] = store.count_stream_messages(conn, config.store.schema)
        except psycopg.Error as exc:
            entry["store_error"] = str(exc).strip()
        out.append(entry)
    return out


def cmd_status(args: argparse.Namespace) -> int:
    """Slot position and lag, stream app heartbeat, messages per sink."""
    status = _status(_config(args))
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    for entry in status:
        stream = entry.get("stream") or {}
        print(f"{entry['database']}: slot {entry['slot']} "
              f"{'active' if entry.get('active') else 'inactive'}, lag {entry.get('lag_bytes', '?')} bytes, "
              f"last batch {stream.get('last_batch_id', '-')} at {stream.get('last_batch_at', '-')}, "
              f"{stream.get('total_rows', 0)} changes processed")
        for sink, count in sorted((entry.get("messages") or {}).items()):
            print(f"  sink {sink}: {count} messages in the stream")
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
        for message in store.stream_messages(conn, config.store.schema, args.sink)[-args.limit:]:
            print(message.data)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``sequin``."""
    parser = argparse.ArgumentParser(prog="sequin", description="Postgres change data capture on Spark and Airflow")
    parser.add_argument("--config", default=None, help="sequin.yaml (default: $SEQUIN_CONFIG or ./sequin.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="check prerequisites; create store schema, publication and slot")
    p.add_argument("--database", default=None)
    p.set_defaults(func=cmd_init)
    p = sub.add_parser("status", help="slot lag, stream heartbeat, messages per sink")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sequin`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, ReplicationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"error: cannot connect: {str(exc).strip()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
