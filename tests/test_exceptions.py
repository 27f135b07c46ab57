"""One error hierarchy under ``SequinError``, mapped to Airflow's exceptions at the edge."""

from __future__ import annotations

import pytest

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from sequin_provider import buffer, config, delivery, exceptions, pgoutput, replication, store, stream_queue
from sequin_provider.airflow_errors import airflow_errors, airflow_exception
from sequin_provider.sinks.sequin_stream import StoreUnavailableError
from sequin_provider.triggers.sequin import SequinConditionError


@pytest.mark.parametrize("cls, builtin", [
    (config.ConfigError, ValueError), (store.BackfillError, ValueError), (store.BackfillConflict, ValueError),
    (replication.ReplicationError, RuntimeError), (replication.SourceUnavailableError, RuntimeError),
    (buffer.DeliveryError, RuntimeError), (delivery.TransformError, RuntimeError),
    (StoreUnavailableError, RuntimeError), (stream_queue.TokenError, ValueError), (pgoutput.DecodeError, ValueError),
    (SequinConditionError, Exception),
])
def test_domain_errors_are_sequin_errors_and_keep_their_builtin_base(cls: type, builtin: type) -> None:
    assert issubclass(cls, exceptions.SequinError)
    assert issubclass(cls, builtin)


def test_unknown_sink_is_a_config_error_naming_the_configured_sinks() -> None:
    err = exceptions.UnknownSinkError("sequin.yaml", "nope", ["a", "b"])
    assert isinstance(err, config.ConfigError)
    assert str(err) == "sequin.yaml: sinks: unknown sink 'nope' (configured sinks: a, b)"
    assert exceptions.UnknownSinkError("x.yaml", "nope", []).reason == "unknown sink 'nope' (configured sinks: none)"


@pytest.mark.parametrize("error, airflow_type", [
    (config.ConfigError("sequin.yaml", "sinks", "bad"), AirflowFailException),
    (store.BackfillError("max_query_ms must be an integer between 1 and 600000"), AirflowFailException),
    (exceptions.LockHeldError("already supervised"), AirflowFailException),
    (exceptions.StoreUnavailableError("cannot reach the store: refused"), AirflowException),
    (replication.ReplicationError("slot gone"), AirflowException),
    (buffer.DeliveryError("HTTP 500"), AirflowException),
    (exceptions.SupervisionError("giving up after 5 consecutive restarts"), AirflowException),
    (SequinConditionError("backfill 3 failed: boom", {"backfill_id": 3}), AirflowException),
])
def test_errors_a_retry_cannot_fix_fail_the_task_others_let_airflow_retry(error: exceptions.SequinError,
                                                                         airflow_type: type) -> None:
    mapped = airflow_exception(error)
    assert type(mapped) is airflow_type
    assert str(mapped) == str(error)
    with pytest.raises(airflow_type) as raised:
        with airflow_errors():
            raise error
    assert type(raised.value) is airflow_type and raised.value.__cause__ is error


def test_other_exceptions_pass_the_edge_unchanged() -> None:
    with pytest.raises(KeyError):
        with airflow_errors():
            raise KeyError("not ours")


# -- finding a sink by name: one lookup, one error ------------------------------------------------

def two_sinks() -> config.SequinConfig:
    return config.parse_config({"databases": [{"name": "a", "dsn": "postgresql://x/y"}],
                                "sinks": [{"name": name, "tables": ["t"], "destination": {"type": "sequin_stream"}}
                                          for name in ("orders", "users")]}, source="app.yaml")


def test_sink_by_name_or_an_error_naming_the_configured_sinks() -> None:
    cfg = two_sinks()
    assert cfg.sink("users").name == "users" and cfg.has_sink("orders") and not cfg.has_sink("nope")
    with pytest.raises(exceptions.UnknownSinkError) as raised:
        cfg.sink("nope")
    assert str(raised.value) == "app.yaml: sinks: unknown sink 'nope' (configured sinks: orders, users)"
    assert raised.value.configured == ("orders", "users")
    with pytest.raises(AirflowFailException, match=r"unknown sink 'nope' \(configured sinks: orders, users\)"):
        with airflow_errors():
            cfg.sink("nope")


def test_backfill_and_cli_report_an_unknown_sink_the_same_way() -> None:
    from sequin_provider.backfill import plan_backfill
    from sequin_provider.cli import _database_of_sink

    cfg = two_sinks()
    with pytest.raises(store.BackfillError, match=r"^unknown sink 'nope' \(configured sinks: orders, users\)$"):
        plan_backfill(None, cfg, "nope", "t")  # type: ignore[arg-type]  # fails before any query
    with pytest.raises(exceptions.UnknownSinkError, match="unknown sink 'nope'"):
        _database_of_sink(cfg, "nope")
