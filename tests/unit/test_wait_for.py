"""devtools' ``wait_for``: the one poll loop of the tests, and the looks it lets raise."""

from __future__ import annotations

import pytest

from devtools.stream_process import wait_for


def test_wait_for_returns_the_first_truthy_look_and_counts_ignored_errors_as_not_yet() -> None:
    looks = iter([LookupError("not rendered"), None, 0, "found", "later"])

    def look() -> object:
        value = next(looks)
        if isinstance(value, Exception):
            raise value
        return value

    assert wait_for(look, timeout=5, interval=0, what="the element", ignoring=(LookupError,)) == "found"
    assert next(looks) == "later"


def test_wait_for_lets_other_errors_through_and_times_out_naming_what_it_waited_for() -> None:
    def broken() -> object:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        wait_for(broken, timeout=5, interval=0, ignoring=(ValueError,))
    with pytest.raises(TimeoutError, match="the element"):
        wait_for(lambda: None, timeout=0.05, interval=0.01, what="the element")
