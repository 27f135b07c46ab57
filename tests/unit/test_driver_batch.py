"""spark/driver_batch: a micro-batch's spool file named from Spark's offset log, or None."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sequin_provider.spark import driver_batch
from sequin_provider.spark.driver_batch import batch_spool_file, logged_offset
from sequin_provider.spark.spool import spool_path

METADATA = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 1795785599749, "conf": {}})


def log_entry(checkpoint: Path, batch_id: int, text: str) -> None:
    (checkpoint / "offsets").mkdir(parents=True, exist_ok=True)
    (checkpoint / "offsets" / str(batch_id)).write_text(text)


@pytest.fixture(autouse=True)
def warn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process: the once-per-process warning not yet given."""
    monkeypatch.setattr(driver_batch, "_unreadable_warned", False)


def test_the_spool_file_of_a_batch_is_named_by_its_own_and_the_previous_logged_offsets(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    log_entry(tmp_path, 6, f'v1\n{METADATA}\n{{"lsn": 1000}}')
    log_entry(tmp_path, 7, f'v1\n{METADATA}\n{{"lsn": 2000, "idx": 4}}')
    path = spool_path(str(spool), (1000, 0), (2000, 4))
    assert batch_spool_file(str(tmp_path), str(spool), 7) is None  # the file is not there (yet)
    Path(path).write_bytes(b"")
    assert batch_spool_file(str(tmp_path), str(spool), 7) == path
    assert batch_spool_file(f"file://{tmp_path}", f"file://{spool}", 7) == path
    assert batch_spool_file(str(tmp_path), str(spool), 6) is None  # no batch 5 in the log
    assert batch_spool_file(str(tmp_path), "s3a://bucket/spool", 7) is None  # another file system
    assert batch_spool_file("hdfs://nn/ckpt", str(spool), 7) is None


def test_a_log_entry_the_driver_cannot_read_is_said_once_and_leaves_the_batch_to_spark(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log_entry(tmp_path, 1, f'v2\n{METADATA}\n0:{{"lsn": 1000}}')  # another version of the log
    log_entry(tmp_path, 2, f'v1\n{METADATA}\n{{"position": 1000}}')  # an offset without its lsn
    log_entry(tmp_path, 3, f'v1\n{METADATA}\n{{"lsn": 1000}}\n{{"lsn": 5}}')  # two sources
    with caplog.at_level(logging.WARNING, logger=driver_batch.__name__):
        assert [logged_offset(str(tmp_path), n) for n in (1, 2, 3, 4)] == [None] * 4
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "offsets/1" in warnings[0] and "none is written by the driver" in warnings[0]
