"""The spool's files on a local path (memory-mapped) and through a filesystem URI (pyarrow's API),
on this machine's disk: the same batches come back, removal stops at the committed position, and a
location that cannot be written is a clear error."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from sequin_provider.change_arrow import CHANGE_ARROW_SCHEMA, rows_to_arrow
from sequin_provider.spark.spool import (
    SpoolUnreachableError,
    check_reachable,
    local_path,
    make_folder,
    pyarrow_uri,
    remove_spooled,
    spool_folder,
    spool_path,
    spool_table,
    spooled_end,
    write_spool,
)


def batch(n: int) -> pa.RecordBatch:
    """``n`` insert rows of public.items."""
    return rows_to_arrow(
        [
            (
                100 + i,
                0,
                "2026-11-26T12:00:00Z",
                7,
                "public",
                "items",
                "insert",
                f'{{"id": {i}}}',
                None,
                [str(i)],
                [],
                None,
                None,
            )
            for i in range(n)
        ]
    )


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_a_spooled_batch_reads_back_whole_and_is_removed_once_committed(tmp_path: Path, as_uri: bool) -> None:
    folder = f"file://{tmp_path / 'spool'}" if as_uri else str(tmp_path / "spool")
    make_folder(folder)
    first, second = spool_path(folder, (0, 0), (200, 0)), spool_path(folder, (200, 0), (300, 5))
    write_spool(first, batch(3))
    write_spool(second, batch(2))
    assert spool_table(first).to_pylist() == pa.Table.from_batches([batch(3)]).to_pylist()
    assert spool_table(second).schema == CHANGE_ARROW_SCHEMA and spool_table(second).num_rows == 2
    assert spooled_end(second.rpartition("/")[2]) == (300, 5)
    (tmp_path / "spool" / "notes.txt").write_text("not ours")
    remove_spooled(folder, (200, 0))
    assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == [second.rpartition("/")[2], "notes.txt"]
    remove_spooled(folder, (300, 5))
    assert [p.name for p in (tmp_path / "spool").iterdir()] == ["notes.txt"]


def test_the_spool_folder_of_a_database() -> None:
    assert spool_folder(None, "/ck/shop", "shop") == "/ck/shop/sequin-spool"
    assert spool_folder(None, "hdfs://nn:8020/ck/shop", "shop") == "hdfs://nn:8020/ck/shop/sequin-spool"
    assert spool_folder("s3a://bucket/spool/", "/ck/shop", "shop") == "s3a://bucket/spool/shop"
    assert pyarrow_uri("s3a://bucket/spool/shop") == "s3://bucket/spool/shop"
    assert pyarrow_uri("S3N://bucket/x") == "s3://bucket/x" and pyarrow_uri("hdfs://nn/x") == "hdfs://nn/x"


def test_a_spool_that_cannot_be_written_is_a_clear_error_before_any_job(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SpoolUnreachableError, match=r"cannot write the spool at .*a-file/spool"):
        check_reachable(None, str(blocker / "spool"))  # no Spark needed: it fails before the job


def test_only_paths_of_this_machine_are_local() -> None:
    assert local_path("/var/ckpt") == "/var/ckpt"
    assert local_path("file:///var/ckpt") == "/var/ckpt"
    assert local_path("hdfs://nn/ckpt") is None and local_path("s3a://b/k") is None
