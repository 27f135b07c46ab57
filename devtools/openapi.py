"""Write the pull API's OpenAPI document to ``docs/openapi.json`` (``make openapi``).

The document is the one ``sequin api`` serves at ``/openapi.json``; it does not depend on which sinks
a config has (the sink is a path parameter). ``tests/unit/test_openapi_document.py`` fails when the file
and the app disagree, so the published document cannot drift from the server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sequin_provider.config import SequinConfig, parse_config

DOCUMENT = Path(__file__).resolve().parent.parent / "docs" / "openapi.json"


def example_config() -> SequinConfig:
    """A config with one Sequin Stream sink: enough to build the app (nothing is connected)."""
    return parse_config(
        {
            "databases": [{"name": "shop", "dsn": "postgresql://127.0.0.1/shop"}],
            "sinks": [{"name": "orders", "tables": ["public.orders"], "destination": {"type": "sequin_stream"}}],
        },
        "openapi",
        environ={},
    )


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the pull API's app."""
    from sequin_provider.stream_api import create_app

    return create_app(example_config()).openapi()


def render(document: dict[str, Any]) -> str:
    """The document as the file holds it (sorted keys, two-space indent, a final newline)."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def main() -> int:
    DOCUMENT.write_text(render(openapi_document()))
    print(f"wrote {DOCUMENT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
