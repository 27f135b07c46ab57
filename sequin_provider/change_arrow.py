"""Change rows as Arrow record batches: their schema, a batch built from change-row tuples (a
compiled pass, with Arrow's own converter as its reference), and a batch's open-transaction
marker. Apart from ``messages`` so that what only records or reads messages (the store, the CLI,
the Airflow side) does not load pyarrow: 0.1-0.2 s of every ``sequin`` command's start."""

from __future__ import annotations

from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from sequin_provider.messages import CHANGE_COLUMNS, OPEN_TRANSACTION_PREFIX
from sequin_provider.pgoutput import COMPILED, hot_path

ARROW_TYPES: dict[str, tuple[pa.DataType, bytes]] = {
    "bigint": (pa.int64(), b"q"),
    "int": (pa.int32(), b"i"),
    "string": (pa.string(), b"s"),
    "array<string>": (pa.list_(pa.string()), b"l"),
}
"""For each Spark SQL type a change column has (``messages.CHANGE_COLUMNS``): its Arrow type, and its
kind for the compiled pass (``_pgoutput_c.column_sizes`` and ``fill_columns``)."""

CHANGE_ARROW_SCHEMA = pa.schema([pa.field(name, ARROW_TYPES[ddl][0]) for name, ddl in CHANGE_COLUMNS])
CHANGE_ARROW_STRUCT = pa.struct(list(CHANGE_ARROW_SCHEMA))
CHANGE_COLUMN_KINDS = b"".join(ARROW_TYPES[ddl][1] for _, ddl in CHANGE_COLUMNS)
"""Each change column's kind, in order (``ARROW_TYPES``)."""


def rows_to_arrow(rows: Sequence[tuple], compiled: bool = COMPILED) -> pa.RecordBatch:
    """Build one Arrow batch of change rows (tuples in ``CHANGE_COLUMNS`` order).

    The compiled hot path sizes each column, then writes its Arrow buffers (taken from Arrow's
    memory pool) in one pass over the tuples (``_pgoutput_c.column_sizes``, ``fill_columns``).
    Arrow reading the tuples as structs (``compiled=False``, and wherever the compiled pass
    refuses a row: a value of another type, strings past 2 GiB) is the definition; its generic
    converter checks every value's type (transposing in Python first, ``zip(*rows)``, was slower)."""
    if compiled and not COMPILED:
        raise RuntimeError("the compiled change-row pass (sequin_provider._pgoutput_c) is not built")
    if compiled and type(rows) is list and rows:
        try:
            return _compiled_rows_to_arrow(rows)
        except (TypeError, ValueError, OverflowError):  # Arrow decides, raising what it raises
            pass
    return pa.RecordBatch.from_struct_array(pa.array(rows, type=CHANGE_ARROW_STRUCT))


def _compiled_rows_to_arrow(rows: list[tuple]) -> pa.RecordBatch:
    n = len(rows)
    sizes = hot_path.column_sizes(rows, CHANGE_COLUMN_KINDS)
    buffers = []
    for kind, (nbytes, items) in zip(CHANGE_COLUMN_KINDS, sizes):
        valid = pa.allocate_buffer((n + 7) // 8)
        if kind in b"qi":
            buffers.append((valid, pa.allocate_buffer(n * (8 if kind == ord("q") else 4))))
        elif kind == ord("s"):
            buffers.append((valid, pa.allocate_buffer(4 * (n + 1)), pa.allocate_buffer(nbytes)))
        else:
            buffers.append(
                (
                    valid,
                    pa.allocate_buffer(4 * (n + 1)),
                    pa.allocate_buffer(4 * (items + 1)),
                    pa.allocate_buffer(nbytes),
                )
            )
    nulls = hot_path.fill_columns(rows, CHANGE_COLUMN_KINDS, buffers)
    arrays = []
    for typ, bufs, null_count in zip(CHANGE_ARROW_SCHEMA.types, buffers, nulls):
        valid = bufs[0] if null_count else None
        if len(bufs) == 4:
            items = pa.Array.from_buffers(pa.string(), bufs[2].size // 4 - 1, [None, bufs[2], bufs[3]])
            arrays.append(pa.Array.from_buffers(typ, n, [valid, bufs[1]], null_count, children=[items]))
        else:
            arrays.append(pa.Array.from_buffers(typ, n, [valid, *bufs[1:]], null_count))
    return pa.RecordBatch.from_arrays(arrays, schema=CHANGE_ARROW_SCHEMA)


def open_transaction_lsn(changes: pa.RecordBatch) -> int | None:
    """The commit LSN of the transaction a batch of change rows ends inside, if its marker is among them."""
    marked = pc.and_(
        pc.equal(changes.column("action"), "message"), pc.equal(changes.column("table_name"), OPEN_TRANSACTION_PREFIX)
    )
    return pc.min(changes.column("commit_lsn").filter(marked)).as_py()
