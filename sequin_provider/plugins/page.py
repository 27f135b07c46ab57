"""The Sequin view's documents: the page, its script and style (files of the package,
``plugins/static/``, read on first use), and the server-rendered token form and message pages.

The page itself holds no data (its script fetches it and renders values as text); the only values
rendered here, a reason and a message, are HTML-escaped.
"""

from __future__ import annotations

import html
from functools import lru_cache
from importlib import resources

ASSETS = {"view.html": "text/html", "view.js": "text/javascript", "view.css": "text/css"}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self';"
    " form-action 'self'; frame-ancestors 'self'; base-uri 'none'"
)
"""Scripts and styles only from the plugin (none inline), requests only to it, framed only by
Airflow's UI (same origin)."""


@lru_cache(maxsize=None)
def asset(name: str) -> bytes:
    """One of ``ASSETS``, as shipped in the package."""
    if name not in ASSETS:
        raise KeyError(name)
    return resources.files("sequin_provider.plugins").joinpath("static", name).read_bytes()


def _shell(body: str) -> str:
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Sequin</title>"
        "<link rel='stylesheet' href='view.css'></head><body><h1>Sequin</h1>"
        f"{body}</body></html>"
    )


def token_form(reason: str, notice: str | None = None) -> str:
    """The form asking for an API token (POSTed to ``login``, never put in a URL), with why."""
    warning = f"<p class='error' id='token-in-url'>{html.escape(notice)}</p>" if notice else ""
    return _shell(
        f"{warning}<p id='reason'>{html.escape(reason)}</p>"
        "<form class='login' method='post' action='login' autocomplete='off'>"
        "<input name='token' type='password' placeholder='sqn_...' aria-label='API token' required> "
        "<button type='submit'>Show</button></form>"
    )


def message_page(text: str) -> str:
    """A page with one message (e.g. Sequin is not configured)."""
    return _shell(f"<p>{html.escape(text)}</p>")
