"""The Airflow edge of the error hierarchy: ``SequinError`` -> Airflow's exceptions, in one place.

Operators and sensors run their domain calls inside ``airflow_errors()``. A ``SequinError`` that a
retry cannot fix (``retryable = False``: a bad config, an invalid backfill request, a lock another
task holds) becomes ``AirflowFailException`` (the task fails without using its retries); any other
becomes ``AirflowException`` (Airflow retries the task). The message is the error's own. Triggers
do not raise: they turn errors into ``{"status": "error"}`` events (``triggers.sequin``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from sequin_provider.exceptions import SequinError


def airflow_exception(exc: SequinError) -> AirflowException:
    """The Airflow exception that reports ``exc``: ``AirflowFailException`` if a retry cannot fix it."""
    kind = AirflowException if exc.retryable else AirflowFailException
    return kind(str(exc))


@contextmanager
def airflow_errors() -> Iterator[None]:
    """Re-raise a ``SequinError`` of the block as its Airflow exception (others pass unchanged)."""
    try:
        yield
    except SequinError as exc:
        raise airflow_exception(exc) from exc
