"""The parameters of a pull API ``receive`` in the forms Sequin's server accepts (reference/002).

They come from the query string and a JSON object body, merged key by key (the body's value wins).

- ``batch_size`` (or its alias ``max_batch_size``; ``batch_size`` wins when both are given): an
  integer 1-1000, as a JSON integer or as text of ASCII digits with an optional sign (``"5"``,
  ``"+5"``, ``"05"``). Default 1.
- ``wait_for``: a long poll of 500-300,000 milliseconds, as a JSON integer or as a duration text:
  ASCII digits with an optional unit ``ms``, ``s`` or ``m`` (``"1000"``, ``"1000ms"``, ``"60s"``,
  ``"5m"``). Default: no long poll.

``null`` is the default. Anything else is refused with the summary Sequin's server answers, naming
the parameter given. Where Sequin's server ignores a value (``"wait_for": true``) or fails on it
later (a fractional number), it is refused here too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Mapping

from pydantic import BaseModel, Field

MIN_WAIT_MS = 500
MAX_WAIT_MS = 300_000
MAX_BATCH_SIZE = 1000
INTEGER_TEXT = r"^[+-]?[0-9]+$"
DURATION_TEXT = r"^([0-9]+)(ms|s|m)?$"
_INTEGER_TEXT = re.compile(INTEGER_TEXT[1:-1])  # fullmatch: a trailing newline is not a digit
_DURATION_TEXT = re.compile(DURATION_TEXT[1:-1])
_UNIT_MS = {None: 1, "ms": 1, "s": 1000, "m": 60_000}

BAD_DURATION = "Invalid `wait_for`. When using duration strings, format must be like '60s', '5m', or '1000ms'."
BAD_WAIT_FOR = (
    "Invalid `wait_for`. Must be between 500 and 300,000 milliseconds, or use duration format"
    " like '60s', '5m', '1000ms'."
)


class InvalidReceiveParameter(ValueError):
    """A receive parameter in no accepted form; the message is the answer's summary."""


@dataclass(frozen=True)
class ReceiveRequest:
    """What a receive asks for."""

    batch_size: int
    wait_for_ms: int | None


BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
WaitFor = Annotated[int, Field(ge=MIN_WAIT_MS, le=MAX_WAIT_MS)]
IntegerText = Annotated[str, Field(pattern=INTEGER_TEXT)]
DurationText = Annotated[str, Field(pattern=DURATION_TEXT)]


class ReceiveParams(BaseModel):
    """``receive`` parameters as the OpenAPI document describes them (``parse_receive`` reads them)."""

    batch_size: BatchSize | IntegerText | None = Field(
        None, description="messages to return at most (1-1000, default 1); an integer or its text"
    )
    max_batch_size: BatchSize | IntegerText | None = Field(None, description="alias of batch_size")
    wait_for: WaitFor | DurationText | None = Field(
        None,
        description="long poll: wait up to this long for a message: milliseconds (500-300000) or a duration"
        " text like '60s', '5m', '1000ms'",
    )


def parse_receive(query: Mapping[str, str], body: bytes) -> ReceiveRequest:
    """The receive asked for by ``query`` and a JSON ``body`` (may be empty); ``InvalidReceiveParameter``
    names the first parameter in no accepted form (``batch_size`` is checked first)."""
    params: dict[str, Any] = dict(query)
    if body.strip():
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            raise InvalidReceiveParameter(f"the request body is not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidReceiveParameter("the request body must be a JSON object")
        params.update(parsed)
    return ReceiveRequest(_batch_size(params), _wait_for_ms(params.get("wait_for")))


def _batch_size(params: Mapping[str, Any]) -> int:
    for name in ("batch_size", "max_batch_size"):
        value = params.get(name)
        if value is not None:
            size = _integer(value)
            if size is None or not 1 <= size <= MAX_BATCH_SIZE:
                raise InvalidReceiveParameter(f"Invalid `{name}`. `{name}` must be an integer between 1 and 1000.")
            return size
    return 1


def _integer(value: Any) -> int | None:
    """A JSON integer, or integer text; None for anything else (booleans and fractions too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INTEGER_TEXT.fullmatch(value) and len(value) <= 20:
        return int(value)
    return None


def _wait_for_ms(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        match = _DURATION_TEXT.fullmatch(value)
        if match is None:
            raise InvalidReceiveParameter(BAD_DURATION)
        ms = int(match[1]) * _UNIT_MS[match[2]] if len(match[1]) <= 20 else MAX_WAIT_MS + 1
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    else:
        raise InvalidReceiveParameter(BAD_WAIT_FOR)
    if not MIN_WAIT_MS <= ms <= MAX_WAIT_MS:
        raise InvalidReceiveParameter(BAD_WAIT_FOR)
    return ms
