"""One error hierarchy under ``SequinError``, mapped to Airflow's exceptions at the edge."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from sequin_provider import buffer, config, delivery, exceptions, pgoutput, replication, store, stream_queue
from sequin_provider.airflow_errors import airflow_errors, airflow_exception
from sequin_provider.sinks.sequin_stream import StoreUnavailableError
from sequin_provider.triggers.sequin import SequinConditionError


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (config.ConfigError, ValueError),
        (store.BackfillError, ValueError),
        (store.BackfillConflict, ValueError),
        (replication.ReplicationError, RuntimeError),
        (replication.SourceUnavailableError, RuntimeError),
        (buffer.DeliveryError, RuntimeError),
        (delivery.TransformError, RuntimeError),
        (StoreUnavailableError, RuntimeError),
        (stream_queue.TokenError, ValueError),
        (pgoutput.DecodeError, ValueError),
        (SequinConditionError, Exception),
    ],
)
def test_domain_errors_are_sequin_errors_and_keep_their_builtin_base(cls: type, builtin: type) -> None:
    assert issubclass(cls, exceptions.SequinError)
    assert issubclass(cls, builtin)


def test_unknown_sink_is_a_config_error_naming_the_configured_sinks() -> None:
    err = exceptions.UnknownSinkError("sequin.yaml", "nope", ["a", "b"])
    assert isinstance(err, config.ConfigError)
    assert str(err) == "sequin.yaml: sinks: unknown sink 'nope' (configured sinks: a, b)"
    assert exceptions.UnknownSinkError("x.yaml", "nope", []).reason == "unknown sink 'nope' (configured sinks: none)"


@pytest.mark.parametrize(
    "error, airflow_type",
    [
        (config.ConfigError("sequin.yaml", "sinks", "bad"), AirflowFailException),
        (store.BackfillError("max_query_ms must be an integer between 1 and 600000"), AirflowFailException),
        (exceptions.LockHeldError("already supervised"), AirflowFailException),
        (exceptions.StoreUnavailableError("cannot reach the store: refused"), AirflowException),
        (replication.ReplicationError("slot gone"), AirflowException),
        (buffer.DeliveryError("HTTP 500"), AirflowException),
        (exceptions.SupervisionError("giving up after 5 consecutive restarts"), AirflowException),
        (SequinConditionError("backfill 3 failed: boom", {"backfill_id": 3}), AirflowException),
    ],
)
def test_errors_a_retry_cannot_fix_fail_the_task_others_let_airflow_retry(
    error: exceptions.SequinError, airflow_type: type
) -> None:
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
    return config.parse_config(
        {
            "databases": [{"name": "a", "dsn": "postgresql://x/y"}],
            "sinks": [
                {"name": name, "tables": ["t"], "destination": {"type": "sequin_stream"}}
                for name in ("orders", "users")
            ],
        },
        source="app.yaml",
    )


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


def test_backfill_and_cli_report_an_unknown_sink_the_same_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sequin_provider.backfill import plan_backfill
    from sequin_provider.cli import main

    cfg = two_sinks()
    with pytest.raises(store.BackfillError, match=r"^unknown sink 'nope' \(configured sinks: orders, users\)$"):
        plan_backfill(None, cfg, "nope", "t")  # type: ignore[arg-type]  # fails before any query
    path = tmp_path / "app.yaml"  # the same two sinks, through the CLI: it fails before connecting
    path.write_text(
        yaml.safe_dump(
            {
                "databases": [{"name": "a", "dsn": "postgresql://x/y"}],
                "sinks": [
                    {"name": name, "tables": ["t"], "destination": {"type": "sequin_stream"}}
                    for name in ("orders", "users")
                ],
            }
        )
    )
    assert main(["--config", str(path), "backfill", "start", "nope", "t", "--no-run"]) == 2
    assert capsys.readouterr().err == f"error: {path}: sinks: unknown sink 'nope' (configured sinks: orders, users)\n"


# -- supervision: one backoff, the restart budget, the stall timeout ------------------------------


def test_one_backoff_formula_for_restarts_and_redeliveries() -> None:
    import random

    from sequin_provider.backoff import exponential_backoff
    from sequin_provider.supervision import backoff_delay

    assert [exponential_backoff(n, 10, 300) for n in (0, 1, 2, 3, 4, 5, 6)] == [10, 10, 20, 40, 80, 160, 300]
    assert [backoff_delay(n, 0.5, 3) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    spread = [exponential_backoff(3, 1, 60, 0.15, random.Random(n)) for n in range(100)]
    assert all(4 * 0.85 <= d <= 4 * 1.15 for d in spread) and len(set(spread)) > 50
    assert buffer.backoff_seconds(3, random.Random(7)) == exponential_backoff(
        3, buffer.BACKOFF_BASE, buffer.BACKOFF_CAP, buffer.JITTER, random.Random(7)
    )


def test_restart_budget_backs_off_gives_up_and_resets_after_a_healthy_run() -> None:
    from sequin_provider.supervision import RestartBudget

    budget = RestartBudget(max_restarts=3, initial_backoff=10, max_backoff=25, reset_after=600)
    assert [budget.next_delay(healthy_for=5) for _ in range(3)] == [10, 20, 25]
    assert budget.next_delay(healthy_for=5) is None  # a 4th restart in a row: give up
    budget = RestartBudget(max_restarts=2, initial_backoff=1, max_backoff=100, reset_after=600)
    assert [budget.next_delay(0), budget.next_delay(0), budget.next_delay(600)] == [1, 2, 1]
    assert budget.consecutive == 1


def test_stall_timeout_follows_the_heartbeat_interval() -> None:
    from sequin_provider.supervision import HeartbeatWatch, effective_stall_timeout

    assert effective_stall_timeout(300, 15) == (300.0, None)
    assert effective_stall_timeout(None, 15) == (0.0, None)
    stall, warning = effective_stall_timeout(300, 0)
    assert stall == 0.0 and warning is not None and "only exits" in warning
    stall, warning = effective_stall_timeout(20, 10)
    assert stall == 20.0 and warning is not None and "close to heartbeat_interval 10s" in warning
    watch = HeartbeatWatch(start_timeout=60, stall_timeout=10, started=1000.0)
    assert watch.stall_reason(1061) == "stalled (no first heartbeat for 61s)"
    watch.observe("t1", 1005)
    assert watch.stall_reason(1020) == "stalled (no new heartbeat for 15s)"
