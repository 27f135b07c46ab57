"""The spool: each micro-batch's change rows as one Arrow IPC file that the executors read.

The reader (driver side) writes a batch's file in ``latestOffset``; the executors read it (the
source's ``read``, and with ``payload=spool`` the writers' slices); ``commit`` removes it. A spool
location is either a local path, whose files are memory-mapped, or a filesystem URI that pyarrow
resolves (``file://``, ``hdfs://``, ``s3://``, ``gs://``, ``abfs://``...; ``s3a://`` and ``s3n://``,
as Hadoop spells S3, are read as ``s3://``). With a Spark master that is not local, the executors
run on other hosts: the location must be one every executor reaches, a shared path (NFS) or such a
URI (``check_reachable`` proves it at start).

A file is named by the batch's string (``spool_path``): a local path or a URI, so that an executor
resolves it by itself, with a filesystem made once per process and folder.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from sequin_provider.change_arrow import CHANGE_ARROW_SCHEMA
from sequin_provider.replication import Position

HADOOP_SCHEMES = {"s3a": "s3", "s3n": "s3"}
"""Hadoop's names of filesystems that pyarrow knows under another scheme."""


class SpoolUnreachableError(RuntimeError):
    """The spool location cannot be written here or read by the executors."""


def is_uri(location: str) -> bool:
    """Whether ``location`` is a filesystem URI (``scheme://…``) rather than a local path."""
    return "://" in location


def local_path(location: str) -> str | None:
    """``location`` as a path of this machine's file system (a plain path or ``file://``), else None."""
    if location.startswith("file://"):
        return location[len("file://") :] or None
    return None if is_uri(location) else location


def pyarrow_uri(location: str) -> str:
    """``location`` with Hadoop's scheme names replaced by pyarrow's (``s3a://b/k`` -> ``s3://b/k``)."""
    scheme, sep, rest = location.partition("://")
    return f"{HADOOP_SCHEMES.get(scheme.lower(), scheme)}{sep}{rest}"


@functools.lru_cache(maxsize=16)
def _filesystem(folder: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem of a folder URI and the folder's path in it (made once per process)."""
    return pafs.FileSystem.from_uri(pyarrow_uri(folder))


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """A spool file's (or folder's) filesystem and path in it."""
    folder, _, name = path.rstrip("/").rpartition("/")
    fs, base = _filesystem(folder)
    return fs, f"{base.rstrip('/')}/{name}"


def join(folder: str, name: str) -> str:
    """``name`` inside the spool ``folder`` (a path or a URI)."""
    return f"{folder.rstrip('/')}/{name}" if is_uri(folder) else os.path.join(folder, name)


def spool_path(folder: str, start: Position, end: Position) -> str:
    """The spool file of the batch ``(start, end]``."""
    return join(folder, f"{start[0]:020d}_{start[1]:010d}-{end[0]:020d}_{end[1]:010d}.arrow")


def spooled_end(name: str) -> Position:
    """The end position of the batch a spool file name (or a crash's ``.arrow.tmp…``) is for."""
    lsn, _, idx = name.split(".")[0].split("-")[1].partition("_")
    return int(lsn), int(idx or 0)


def make_folder(folder: str) -> None:
    """Create the spool folder (and its parents) if it is missing."""
    if is_uri(folder):
        fs, path = _filesystem(folder)
        fs.create_dir(path, recursive=True)
    else:
        os.makedirs(folder, exist_ok=True)


def write_spool(path: str, batch: pa.RecordBatch) -> None:
    """Write ``batch`` as an Arrow IPC file, atomically (a reader never sees half a file, and
    several writers of the same file, such as the slices of a re-read batch, do not collide)."""
    suffix = f".tmp{os.getpid()}-{threading.get_ident()}"
    if not is_uri(path):
        with pa.OSFile(path + suffix, "wb") as sink, pa.ipc.new_file(sink, CHANGE_ARROW_SCHEMA) as writer:
            writer.write_batch(batch)
        os.replace(path + suffix, path)
        return
    fs, target = resolve(path)
    with fs.open_output_stream(target + suffix) as sink, pa.ipc.new_file(sink, CHANGE_ARROW_SCHEMA) as writer:
        writer.write_batch(batch)
    fs.move(target + suffix, target)  # a rename on HDFS and local disks; copy-then-delete on object stores


def spool_table(path: str) -> pa.Table:
    """A whole spool file: memory-mapped when local (its buffers stay valid after the call), read
    whole from a URI's filesystem."""
    if not is_uri(path):
        with pa.memory_map(path) as source:
            return pa.ipc.open_file(source).read_all()
    fs, target = resolve(path)
    with fs.open_input_file(target) as source:
        return pa.ipc.open_file(source).read_all()


def remove_spooled(folder: str, committed: Position) -> None:
    """Remove the files of batches that end at or before ``committed`` (also a crash's temporary
    files); anything else in the folder is left alone."""
    if is_uri(folder):
        fs, base = _filesystem(folder)
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        entries = [(info.base_name, info.path) for info in infos if info.type == pafs.FileType.File]
        delete = fs.delete_file
    else:
        if not os.path.isdir(folder):
            return
        entries = [(name, os.path.join(folder, name)) for name in os.listdir(folder)]
        delete = os.unlink
    for name, path in entries:
        if ".arrow" not in name:
            continue
        try:
            if spooled_end(name) <= committed:
                delete(path)
        except (ValueError, IndexError, FileNotFoundError):
            continue


def _probe_reader(path: str) -> Any:
    """The Spark task of ``check_reachable``: whether this executor reads the probe file."""

    def read(_: Any) -> list[tuple[str, str]]:
        try:
            spool_table(path)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which names the host
            return [(socket.gethostname(), f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}")]
        return [(socket.gethostname(), "")]

    return read


def check_reachable(spark: Any, folder: str) -> None:
    """Prove that the spool ``folder`` can be written here and read by the executors: a probe
    file, read by a task on every core. Raises ``SpoolUnreachableError`` naming the hosts that
    could not read it. Meant for a master that is not local; one small job at start."""
    probe = join(folder, f"probe-{uuid.uuid4().hex}.check")
    try:
        make_folder(folder)
        write_spool(probe, pa.RecordBatch.from_pylist([], CHANGE_ARROW_SCHEMA))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError, ArrowInvalid, ValueError...
        raise SpoolUnreachableError(f"cannot write the spool at {folder}: {exc}") from None
    try:
        tasks = max(2, 2 * spark.sparkContext.defaultParallelism)
        results = spark.sparkContext.parallelize(range(tasks), tasks).mapPartitions(_probe_reader(probe)).collect()
    except Exception as exc:  # noqa: BLE001 - Py4JJavaError: e.g. the package missing on the workers
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpoolUnreachableError(f"the executors could not run the spool check: {first}") from None
    finally:
        try:
            remove_file(probe)
        except OSError:
            pass
    failed = sorted({f"{host} ({error})" for host, error in results if error})
    if failed:
        raise SpoolUnreachableError(
            f"executors cannot read the spool at {folder}: {', '.join(failed)}; set stream.spool_location"
            " to a folder every executor reaches: a shared path (NFS) or a URI (hdfs://, s3a://, gs://...)"
        )


def remove_file(path: str) -> None:
    """Remove one file of the spool (a path or a URI); a missing one is fine."""
    if is_uri(path):
        fs, target = resolve(path)
        try:
            fs.delete_file(target)
        except FileNotFoundError:
            pass
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def spool_folder(spool_location: str | None, checkpoint: str, database: str) -> str:
    """The spool folder of ``database``'s stream app: ``<spool_location>/<database>`` when the
    config sets ``stream.spool_location``, else ``<checkpoint>/sequin-spool`` (either may be a URI)."""
    return join(spool_location, database) if spool_location else join(checkpoint, "sequin-spool")
