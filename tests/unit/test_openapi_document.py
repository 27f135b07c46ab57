"""docs/openapi.json is the document ``sequin api`` serves (regenerate with ``make openapi``)."""

from __future__ import annotations

import json

from devtools.openapi import DOCUMENT, openapi_document, render


def test_the_published_openapi_document_is_the_one_the_server_serves() -> None:
    assert DOCUMENT.exists(), "run `make openapi`"
    assert DOCUMENT.read_text() == render(openapi_document()), "docs/openapi.json is stale: run `make openapi`"


def test_it_describes_receive_ack_and_nack() -> None:
    paths = json.loads(DOCUMENT.read_text())["paths"]
    for verb in ("receive", "ack", "nack"):
        assert f"/api/sequin_streams/{{name}}/{verb}" in paths
