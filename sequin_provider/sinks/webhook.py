"""Webhook sink: POST messages to a configured URL (DESIGN §9).

The body is ``{"data": [msg, ...]}`` when batching (the default) or the message itself; only a
2xx answer is success. With a ``secret`` each request carries ``X-Sequin-Signature:
sha256=<hex HMAC-SHA256 of the body>`` so the receiver can check it came from us.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import httpx

from sequin_provider.buffer import DeliveryError
from sequin_provider.config import SinkConfig

SIGNATURE_HEADER = "X-Sequin-Signature"


def signature(secret: str, body: bytes) -> str:
    """The signature header's value for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookClient:
    """Posts rendered messages of one webhook sink; keeps its connections alive between requests."""

    def __init__(self, sink: SinkConfig) -> None:
        options: dict[str, Any] = sink.destination.options
        self.sink = sink.name
        self.url: str = options["url"]
        self.batch: bool = options.get("batch", True)
        self.batch_size: int = options.get("batch_size", 10) if self.batch else 1
        self.secret: str | None = options.get("secret")
        self.headers = {"Content-Type": "application/json", "User-Agent": "sequin-provider",
                        **options.get("headers", {})}
        self.client = httpx.Client(timeout=options.get("timeout", 30.0), follow_redirects=False,
                                   limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    def body(self, messages: list[str]) -> bytes:
        """The request body of ``messages`` (one message unless batching)."""
        if not self.batch:
            if len(messages) != 1:
                raise ValueError("one message per request when batching is off")
            return messages[0].encode()
        return ('{"data":[' + ",".join(messages) + "]}").encode()

    def send(self, messages: list[str]) -> None:
        """POST ``messages`` (in order) as one request; raises DeliveryError unless answered 2xx."""
        body = self.body(messages)
        headers = dict(self.headers)
        if self.secret:
            headers[SIGNATURE_HEADER] = signature(self.secret, body)
        try:
            response = self.client.post(self.url, content=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise DeliveryError(f"webhook {self.sink}: timed out after {self.client.timeout.read}s ({type(exc).__name__})"
                                ) from None
        except httpx.HTTPError as exc:
            raise DeliveryError(f"webhook {self.sink}: {type(exc).__name__}: {exc}") from None
        if not 200 <= response.status_code < 300:
            raise DeliveryError(f"webhook {self.sink}: HTTP {response.status_code}: {response.text[:300]}")

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()
