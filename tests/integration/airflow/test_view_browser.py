"""The Sequin view in a real browser: Debian's ``chromium``, headless, driven by Selenium through
``/usr/bin/chromedriver`` (``make chromium`` installs both; ``make test`` runs it first).

The plugin's app is mounted as Airflow mounts it and served by uvicorn; the store is a real
Postgres holding a running backfill and a parked message. The page must show the backfill's
progress bar and ETA, follow its progress without a reload, show the parked message's error as
text, deliver the message to its webhook when its Retry button is clicked, and discard another
after a second click. Past the check that a ``?token=`` URL is refused, the view runs framed as
Airflow's UI frames it (a sandboxed iframe). A screenshot goes
into the test's ``tmp_path`` (its path is printed) and to ``build/screenshots/sequin-view.png``.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from devtools import stream_process
from devtools.embedded_postgres import free_port
from sequin_provider import store, stream_queue
from sequin_provider.plugins.sequin import URL_PREFIX, LazySequinApp
from tests.support.receiver import Receiver
from tests.support.view import running_backfill, view_config

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOT = Path(__file__).resolve().parents[3] / "build" / "screenshots" / "sequin-view.png"
ERROR = "HTTP 500: <b>boom</b> & <script>alert(1)</script>"


def wait_for(check: Callable[[], Any], what: str) -> Any:
    """Poll ``check`` for 20 s until it returns something truthy; that value. A look that raises (an
    element not rendered yet, or gone between the look and the read) counts as not yet."""
    return stream_process.wait_for(check, timeout=20.0, interval=0.1, what=what, ignoring=(Exception,))


AIRFLOW_SANDBOX = "allow-scripts allow-same-origin allow-forms allow-downloads"
"""The ``sandbox`` of the iframe Airflow 3's UI shows a plugin's nav view in (``/plugin/<url_route>``):
no ``allow-modals``, so the view cannot use ``window.confirm``."""


class Server:
    """The plugin's app mounted at ``/sequin`` (as Airflow mounts it), served by uvicorn in a thread,
    and at ``/`` a page framing the view as Airflow's UI does."""

    def __init__(self) -> None:
        app = FastAPI()

        @app.get("/", response_class=HTMLResponse)
        async def airflow_like_frame() -> str:
            return (
                "<!doctype html><title>Airflow</title><body style='margin:0;overflow:hidden'>"
                f"<iframe id='view' sandbox='{AIRFLOW_SANDBOX}' src='{URL_PREFIX}/ui/'"
                " style='display:block;border:none;width:100%;height:100vh'></iframe></body>"
            )

        self.plugin = LazySequinApp()
        app.mount(URL_PREFIX, self.plugin)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{URL_PREFIX}/ui/"

    @property
    def frame_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def __enter__(self) -> Server:
        self.thread.start()
        wait_for(lambda: self.server.started, what="uvicorn")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.plugin.close()  # a mounted app gets no lifespan: its LISTEN thread would outlive the store


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium through chromedriver (both from Debian's packages)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("chromium and chromedriver are needed: make chromium (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def seed(dsn: str, dbname: str, tmp_path: Path, hook_url: str) -> tuple[Path, str, int]:
    """A config with a stream sink and a webhook sink, the stream's last batch at 1,234 rows/s, a
    running backfill 400/1,000 rows in 40 s, and one parked message of the webhook sink, not due
    for 10 minutes; the config, a token and the backfill's id."""
    config = view_config(dsn, dbname, tmp_path, hook_url)
    with psycopg.connect(dsn) as conn:
        token = stream_queue.create_token(conn, "sequin", "browser")
        conn.commit()
        backfill_id = running_backfill(conn, "kv_stream", "kv")
        now = datetime.now(timezone.utc)
        store.update_status(conn, "sequin", "app", 5000, heartbeat_at=now, last_batch_at=now, rows_per_sec=1234.4)
        message = json.dumps({"record": {"k": 7, "v": 42}, "action": "insert"})
        store.park_messages(
            conn, "sequin", [store.ParkRow("kv_hook", 700, 0, "kv:7", "700:0", message, None, 3, ERROR, delay=600.0)]
        )
    return config, token, backfill_id


def test_view_in_headless_chromium_shows_progress_and_retries_a_parked_message(
    dsn: str, dbname: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    receiver = Receiver().start()
    try:
        config, token, backfill_id = seed(dsn, dbname, tmp_path, receiver.url)
        monkeypatch.setenv("SEQUIN_CONFIG", str(config))
        with Server() as server:
            # A token in the URL is not taken: the form asks for it, and no cookie is set.
            browser.get(f"{server.url}?token={token}")
            assert "not accepted in URLs" in browser.find_element(By.ID, "token-in-url").text
            assert browser.get_cookies() == []

            # The rest in the view as Airflow shows it: in a sandboxed iframe.
            browser.get(server.frame_url)
            browser.switch_to.frame(browser.find_element(By.ID, "view"))
            field = wait_for(lambda: browser.find_element(By.NAME, "token"), what="the token form")
            field.send_keys(token)
            field.submit()
            (cookie,) = wait_for(browser.get_cookies, what="the token cookie")
            assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"]) == ("sequin_token", True, "Strict")
            assert browser.execute_script("return document.cookie") == ""  # the page's script cannot read it
            assert token not in browser.execute_script("return location.href")

            # The page re-renders what changed every 2 s: each look finds its elements again (wait_for
            # retries one that went stale between finding and reading).
            def backfill() -> tuple[str | None, str, str]:
                row = browser.find_element(By.ID, f"backfill-{backfill_id}")
                bar = row.find_element(By.CSS_SELECTOR, "[role=progressbar]")
                return bar.get_attribute("aria-valuenow"), row.text, row.find_element(By.CSS_SELECTOR, "td.eta").text

            valuenow, text, eta = wait_for(backfill, what="the backfill")
            assert valuenow == "40" and "400 / 1,000 rows (40.0%)" in text and eta == "0:01:00"

            def parked() -> tuple[str, int, str | None, list[str]] | None:
                rows = browser.find_elements(By.CSS_SELECTOR, "tr.buffered-message")
                if len(rows) != 1:
                    return None
                cell = rows[0].find_element(By.CSS_SELECTOR, "td.error")
                sink_row = browser.find_element(By.CSS_SELECTOR, "#sinks tr[data-sink=kv_hook]")
                markup = len(cell.find_elements(By.CSS_SELECTOR, "b, script"))
                return (
                    cell.text,
                    markup,
                    rows[0].get_attribute("data-group"),
                    [td.text for td in sink_row.find_elements(By.TAG_NAME, "td")],
                )

            error, markup, group, sink = wait_for(parked, what="the parked message")
            assert error == ERROR and markup == 0  # shown as text: the markup in it is not rendered
            assert group == "kv:7"
            throughput, lag, parked_count = sink[3], sink[4], sink[6]
            assert (throughput, parked_count) == ("1,234 rows/s (app)", "1")
            assert re.fullmatch(r"[\d,]+ bytes, heartbeat 0:00:\d\d ago", lag), lag  # slot lag, heartbeat age

            # Refreshed live: progress recorded now shows without a reload.
            with psycopg.connect(dsn) as conn:
                store.record_backfill_progress(conn, "sequin", backfill_id, {"k": 700}, 300, 300)
            wait_for(
                lambda: "700 / 1,000 rows (70.0%)" in browser.find_element(By.ID, f"backfill-{backfill_id}").text,
                what="the page to follow the backfill",
            )
            shot = tmp_path / "sequin-view.png"
            browser.save_screenshot(str(shot))
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, SCREENSHOT)
            print(f"screenshot: {shot} (copied to {SCREENSHOT})")

            assert receiver.messages() == []
            retry = "tr.buffered-message button.action-retry"
            wait_for(lambda: browser.find_element(By.CSS_SELECTOR, retry).click() or True, what="the Retry click")
            delivered = wait_for(receiver.messages, what="the retried message at the webhook")
            assert [m["record"] for m in delivered] == [{"k": 7, "v": 42}]
            wait_for(lambda: "delivered 1" in browser.find_element(By.ID, "notice").text, what="the retry's report")
            wait_for(
                lambda: not browser.find_elements(By.CSS_SELECTOR, "tr.buffered-message"),
                what="the message to leave the page",
            )
            with psycopg.connect(dsn) as conn:
                assert store.list_buffered(conn, "sequin") == []

            # Discard asks for a second click (no window.confirm in Airflow's sandbox), then the
            # message stays as discarded with its error and a Requeue button.
            with psycopg.connect(dsn) as conn:
                row = store.ParkRow("kv_hook", 800, 0, "kv:8", "800:0", "{}", None, 1, "HTTP 400", delay=600.0)
                store.park_messages(conn, "sequin", [row])
            discard = "tr.buffered-message button.action-discard"
            wait_for(lambda: browser.find_element(By.CSS_SELECTOR, discard).click() or True, what="Discard")
            wait_for(
                lambda: browser.find_element(By.CSS_SELECTOR, discard).text == "Click again to discard",
                what="the Discard button to ask again",
            )
            with psycopg.connect(dsn) as conn:
                assert [m.state for m in store.list_buffered(conn, "sequin")] == ["parked"]
            wait_for(lambda: browser.find_element(By.CSS_SELECTOR, discard).click() or True, what="Discard again")
            wait_for(
                lambda: browser.find_elements(By.CSS_SELECTOR, "tr.buffered-message button.action-requeue"),
                what="the discarded message's Requeue",
            )
            with psycopg.connect(dsn) as conn:
                (gone,) = store.list_buffered(conn, "sequin")
            assert (gone.group_id, gone.state, gone.last_error) == ("kv:8", "discarded", "HTTP 400 (discarded by hand)")
            assert receiver.messages() == delivered
            browser.save_screenshot(str(tmp_path / "sequin-view-after-retry-and-discard.png"))
    finally:
        receiver.stop()
