"""Transforms used by the tests (loaded by the stream app as ``tests.transforms:<name>``)."""

from __future__ import annotations

from typing import Any


def tag(message: dict[str, Any]) -> dict[str, Any]:
    """Keep the id and action, add a tag."""
    return {"id": message["record"]["id"], "action": message["action"], "tag": "custom"}
