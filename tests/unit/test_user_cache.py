"""spark/user_cache: the cache folder of what the local apps build once, and its pruning."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sequin_provider.spark.user_cache import cache_folder, configured_path, prune


def test_the_folder_follows_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder() == tmp_path / "sequin"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_folder() == Path.home() / ".cache" / "sequin"


def test_prune_removes_only_old_files_of_the_pattern_and_never_the_kept_one(tmp_path: Path) -> None:
    old = time.time() - 8 * 86400
    kept, stale, recent, other = (tmp_path / n for n in ("a-1.jar", "a-2.jar", "a-3.jar", "b-1.jsa"))
    for path in (kept, stale, recent, other):
        path.write_bytes(b"x")
    for path in (kept, stale, other):
        os.utime(path, (old, old))
    prune(kept, "a-*.jar")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-1.jar", "a-3.jar", "b-1.jsa"]


def test_a_setting_names_a_path_or_turns_it_off_or_leaves_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    default = Path("/cache/default")
    monkeypatch.delenv("SEQUIN_TEST_SETTING", raising=False)
    assert configured_path("SEQUIN_TEST_SETTING", lambda: default) == default
    monkeypatch.setenv("SEQUIN_TEST_SETTING", " OFF ")
    assert configured_path("SEQUIN_TEST_SETTING", lambda: default) is None
    monkeypatch.setenv("SEQUIN_TEST_SETTING", "/elsewhere/x.jar")
    assert configured_path("SEQUIN_TEST_SETTING", lambda: default) == Path("/elsewhere/x.jar")
