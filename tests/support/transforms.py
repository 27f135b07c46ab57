"""Transforms used by the tests (loaded by the stream app as ``tests.support.transforms:<name>``)."""

from __future__ import annotations

from typing import Any


def tag(message: dict[str, Any]) -> dict[str, Any]:
    """Keep the id and action, add a tag."""
    return {"id": message["record"]["id"], "action": message["action"], "tag": "custom"}


def refuse_thirteen(message: dict[str, Any]) -> dict[str, Any]:
    """Raise for the row with k = 13 (a poison pill), unless SEQUIN_TEST_FIXED is set (the "fixed" code)."""
    import os

    if message["record"].get("k") == 13 and not os.environ.get("SEQUIN_TEST_FIXED"):
        raise ValueError("cannot handle row 13")
    return {"k": message["record"]["k"], "v": message["record"].get("v"), "action": message["action"]}


def pass_through(message: dict[str, Any]) -> dict[str, Any]:
    """Return the message as it came (a transform must not change a value it does not touch)."""
    return message


def refuse_three(message: dict[str, Any]) -> dict[str, Any]:
    """Raise for the row with id = 3; pass every other message through as it came."""
    if message["record"]["id"] == 3:
        raise ValueError("cannot handle row 3")
    return message
