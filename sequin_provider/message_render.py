"""Messages and stream rows rendered from Arrow columns of change rows, vectorized (DESIGN §5).

The stream app's executors render each sink's messages here, over whole Arrow batches, with
Arrow's string kernels instead of per-row code: the message JSON is concatenated around the
decoder's ``record``/``changes`` JSON texts (so every value passes byte for byte), the parts that
are constant per table or per sink are JSON-escaped once, and keys are escaped as PostgreSQL's
``to_json`` and Python's ``json`` escape them (so a change and a read written by the store agree).
Stream rows go to the store as COPY binary, which needs no escaping at all. This module imports
neither Spark nor a database driver.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sequin_provider.config import SinkConfig
from sequin_provider.delivery import (
    Outgoing,
    Transform,
    TransformError,
    apply_transform,
    message_kind,
    selected_actions,
)
from sequin_provider.messages import (
    MessageTemplate,
    idempotency_key,
    json_text,
    message_template,
    metadata_head,
    metadata_tail,
    replay_key,
)
from sequin_provider.pgoutput import COMPILED, hot_path

if TYPE_CHECKING:
    from sequin_provider.store import StoreReads

_NEEDS_ESCAPE = r'[\x00-\x1f"\\]'


def json_strings(values: pa.Array) -> pa.Array:
    """Each string as a JSON string literal (nulls stay null)."""
    quoted = pc.binary_join_element_wise('"', values, '"', "")
    special = pc.match_substring_regex(values, _NEEDS_ESCAPE)
    if not pc.any(special).as_py():
        return quoted
    mask = special.fill_null(False).to_numpy(zero_copy_only=False)
    texts = quoted.to_pylist()
    for j in np.flatnonzero(mask):
        texts[j] = json_text(values[int(j)].as_py())
    return pa.array(texts, pa.string())


def json_string_arrays(lists: pa.Array) -> pa.Array:
    """Each list of strings as a JSON array (``["a","b"]``); a null list stays null."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    lists = pc.list_slice(lists, 0) if lists.offset else lists  # offsets from 0 for from_arrays
    elements = json_strings(lists.values) if len(lists.values) else pa.array([], pa.string())
    rebuilt = pa.ListArray.from_arrays(lists.offsets, elements, mask=lists.is_null())
    return pc.binary_join_element_wise("[", pc.binary_join(rebuilt, ","), "]", "")


@dataclass(frozen=True)
class SinkRendering:
    """What renders one sink's messages: its message kind, grouping and per-table metadata heads."""

    name: str
    kind: str  # "change", "record" (row message) or "record_only" (the record itself)
    grouped: bool
    tables: tuple[str, ...]  # "schema\0name", index-aligned with heads
    heads: tuple[str, ...]
    tail: str
    actions: tuple[str, ...] = ()  # the change actions it takes (``delivery.selected_actions``)
    templates: tuple[MessageTemplate | None, ...] = ()  # per table, for compact changes (``render``)

    @classmethod
    def of(cls, sink: SinkConfig, database_name: str) -> SinkRendering:
        """The rendering of ``sink`` (kind before any Python transform), for changes of ``database_name``."""
        tail = metadata_tail(sink.consumer_id, sink.name, database_name)
        return cls(
            sink.name,
            message_kind(sink),
            sink.message_grouping,
            tuple(f"{t.schema}\0{t.name}" for t in sink.tables),
            tuple(metadata_head(t.schema, t.name) for t in sink.tables),
            tail,
            tuple(selected_actions(sink)),
            tuple(message_template(t.schema, t.name, tail) for t in sink.tables),
        )


def selection(batch: pa.RecordBatch, sink: SinkRendering) -> pa.BooleanArray:
    """Which change rows of ``batch`` the sink takes: its tables, its actions and its own backfills'
    reads, as ``delivery.selection_predicate`` says for a sink without a filter (a sink with one is
    selected by Spark SQL). Never null."""
    tables = pc.is_in(
        pc.binary_join_element_wise(batch.column("table_schema"), batch.column("table_name"), "\0"),
        value_set=pa.array(sink.tables, pa.string()),
    )
    action = batch.column("action")
    taken = pc.is_in(action, value_set=pa.array(sink.actions, pa.string()))
    own_read = pc.and_kleene(pc.equal(action, "read"), pc.equal(batch.column("backfill_sink"), sink.name))
    return pc.fill_null(pc.and_kleene(tables, pc.or_kleene(taken, own_read)), False)


@dataclass(frozen=True)
class CompactParts:
    """What compact stream rows keep beside their own part of the message (``messages.MessageTemplate``)."""

    template: pa.Array  # each row's index in ``templates``
    templates: tuple[MessageTemplate | None, ...]  # the sink's, per table (``SinkRendering.templates``)
    commit_timestamp: pa.Array

    def filter(self, mask: pa.Array) -> CompactParts:
        """The parts of the rows ``mask`` selects."""
        return CompactParts(pc.filter(self.template, mask), self.templates, pc.filter(self.commit_timestamp, mask))


@dataclass(frozen=True)
class RenderedRows:
    """A sink's stream rows of one batch, column-wise: position, group, idempotency key, message."""

    commit_lsn: pa.Array
    commit_idx: pa.Array
    group_id: pa.Array
    idempotency_key: pa.Array
    data: pa.Array
    barrier: pa.Array | None = None  # truncates' barriers (``truncate_barriers``); None when there are none
    compact: CompactParts | None = None
    """Compact rows (``render``'s ``compact``): ``data`` holds each message's own part and these
    the rest; None: ``data`` is whole."""

    def __len__(self) -> int:
        return len(self.commit_lsn)


def group_ids(
    batch: pa.RecordBatch, sink: SinkRendering, position: pa.Array | None = None, pks: pa.Array | None = None
) -> pa.Array:
    """The default group id of each change row (``delivery.default_group_sql``): its table and
    primary key, or its position ("lsn:idx") when the sink does not group. ``position`` and
    ``pks`` (the JSON arrays of ``record_pks``) are reused when the caller has them."""
    if not sink.grouped:
        if position is None:
            position = pc.binary_join_element_wise(
                pc.cast(batch.column("commit_lsn"), pa.string()), pc.cast(batch.column("commit_idx"), pa.string()), ":"
            )
        return position
    if pks is None:
        pks = json_string_arrays(batch.column("record_pks"))
    return pc.binary_join_element_wise(batch.column("table_schema"), ".", batch.column("table_name"), ":", pks, "")


def truncate_barriers(batch: pa.RecordBatch, sink: SinkRendering) -> pa.Array | None:
    """The ``barrier`` of each truncate of ``batch`` (null for other rows): the group-id prefix of its
    table's messages for this sink, ``schema.table:`` (default and custom groups both begin so), or
    ``""`` when the sink does not group, so its truncates are barriers for the whole sink. None
    when the batch holds no truncate, which is the rule: the check is one comparison per row."""
    if "truncate" not in sink.actions or not len(batch):
        return None
    truncate = pc.fill_null(pc.equal(batch.column("action"), "truncate"), False)
    if not pc.any(truncate).as_py():
        return None
    prefix = (
        pc.binary_join_element_wise(batch.column("table_schema"), ".", batch.column("table_name"), ":", "")
        if sink.grouped
        else pa.array([""] * len(batch), pa.string())
    )
    return pc.if_else(truncate, prefix, pa.scalar(None, pa.string()))


def render(
    batch: pa.RecordBatch,
    sink: SinkRendering,
    group: pa.Array | None = None,
    replay_id: int | None = None,
    compact: bool = False,
) -> RenderedRows:
    """The stream rows of the change rows in ``batch`` (``messages.CHANGE_COLUMNS``, with
    ``record``/``changes`` JSON texts). ``group``: group ids computed elsewhere (custom group
    columns); by default the table and primary key, or the position when the sink does not group.
    ``replay_id``: the changes are replayed (``replay``): each message's idempotency key is
    ``replay:<id>:<lsn>:<idx>`` (``messages.replay_key``) and its metadata says ``"replay_id":<id>``.

    ``compact``: the rows are for the store, which may keep them compact (``messages.MessageTemplate``;
    the store serves them whole): they are, when the batch is plain changes (no backfill read,
    truncate, unchanged TOAST column or replay) of tables with a template, for a sink of change or
    row messages grouped by primary key. Otherwise, and without ``compact``, ``data`` is whole."""
    lsn, idx = batch.column("commit_lsn"), batch.column("commit_idx")
    lsn_text, idx_text = pc.cast(lsn, pa.string()), pc.cast(idx, pa.string())
    position = pc.binary_join_element_wise(lsn_text, idx_text, ":")
    pks = json_string_arrays(batch.column("record_pks"))
    key = position if replay_id is None else pc.binary_join_element_wise(replay_key(replay_id, ""), position, "")
    key_json = pc.binary_join_element_wise('"', key, '"', "")
    backfill = batch.column("backfill_id")
    if backfill.null_count < len(backfill):  # backfill reads: keyed by (backfill, primary key)
        keys, keys_json = key.to_pylist(), key_json.to_pylist()
        record_pks = batch.column("record_pks").to_pylist()
        for j, backfill_id in enumerate(backfill.to_pylist()):
            if backfill_id is not None:
                keys[j] = idempotency_key(0, 0, backfill_id, record_pks[j])
                keys_json[j] = json_text(keys[j])
        key, key_json = pa.array(keys, pa.string()), pa.array(keys_json, pa.string())
    schema_, table = batch.column("table_schema"), batch.column("table_name")
    by_key = group is None and sink.grouped  # the default group: the keys are found in it again
    if group is None:
        group = group_ids(batch, sink, position, pks)
    record = batch.column("record")
    barrier = truncate_barriers(batch, sink)
    if sink.kind == "record_only":
        data = record
    else:
        which = pc.index_in(
            pc.binary_join_element_wise(schema_, table, "\0"), value_set=pa.array(sink.tables, pa.string())
        )
        toast = batch.column("unchanged_toast")
        has_toast = pc.fill_null(pc.greater(pc.list_value_length(toast), 0), False)
        if (
            compact
            and by_key
            and replay_id is None
            and barrier is None
            and backfill.null_count == len(backfill)
            and not pc.any(has_toast).as_py()
            and len(sink.templates) == len(sink.tables)
            and all(sink.templates)
            and not which.null_count
        ):
            parts = CompactParts(which, sink.templates, batch.column("commit_timestamp"))
            return RenderedRows(lsn, idx, group, key, _own_parts(batch, sink), None, parts)
        head = pc.take(pa.array(sink.heads, pa.string()), which)
        toast_part = pc.if_else(
            has_toast, pc.binary_join_element_wise(',"unchanged_toast_columns":', json_string_arrays(toast), ""), ""
        )
        metadata = [
            head,
            ',"commit_timestamp":"',
            batch.column("commit_timestamp"),
            '","commit_lsn":',
            lsn_text,
            ',"commit_idx":',
            idx_text,
            ',"idempotency_key":',
            key_json,
            ',"record_pks":',
            pks,
            sink.tail,
            toast_part,
            "" if replay_id is None else f',"replay_id":{int(replay_id)}',
            "}",
        ]
        if sink.kind == "record":
            parts = ['{"record":', record, ',"metadata":', *metadata, "}"]
        else:
            parts = [
                '{"record":',
                record,
                ',"changes":',
                pc.fill_null(batch.column("changes"), "null"),
                ',"action":"',
                batch.column("action"),
                '","metadata":',
                *metadata,
                "}",
            ]
        data = pc.binary_join_element_wise(*parts, "")
    return RenderedRows(lsn, idx, group, key, data, barrier)


def _own_parts(batch: pa.RecordBatch, sink: SinkRendering) -> pa.Array:
    """Compact rows' data: each message up to its metadata (``messages.MessageTemplate``)."""
    record = batch.column("record")
    if sink.kind == "record":
        return pc.binary_join_element_wise('{"record":', record, "")
    changes = pc.fill_null(batch.column("changes"), "null")
    return pc.binary_join_element_wise(
        '{"record":', record, ',"changes":', changes, ',"action":"', batch.column("action"), '"', ""
    )


def outgoing(rows: RenderedRows, sink: SinkConfig, transform: Transform | None) -> Outgoing:
    """A sink's rendered messages as ``delivery.Outgoing``, transformed (the path of a push sink,
    and of a stored sink with a transform or parked groups); a transform that raises marks its
    message instead of failing the batch."""
    out = Outgoing(
        rows.commit_lsn.to_pylist(),
        rows.commit_idx.to_pylist(),
        rows.group_id.to_pylist(),
        rows.idempotency_key.to_pylist(),
        rows.data.to_pylist(),
    )
    if rows.barrier is not None:  # truncates
        out.barriers.update(
            (int(i), b)
            for i, b in zip(
                pc.indices_nonzero(pc.is_valid(rows.barrier)).to_pylist(), pc.drop_null(rows.barrier).to_pylist()
            )
        )
    if transform is not None:
        for i, data in enumerate(out.data):
            try:
                out.data[i] = apply_transform(sink, transform, data)  # type: ignore[arg-type]
            except TransformError as exc:
                out.data[i] = None
                out.failed[i] = (data, str(exc))  # type: ignore[assignment]
    return out


COPY_BINARY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
COPY_BINARY_TRAILER = struct.pack("!h", -1)
_FIELDS_7 = struct.pack("!h", 7)  # a backfill read's (``store.READ_MESSAGE_COLUMNS``)
_FIELDS_9 = struct.pack("!h", 9)  # a stream row's (``store.STREAM_COLUMNS``)
_NULL_FIELD = struct.pack("!i", -1)


def _length_prefixed(values: pa.Array) -> pa.Array:
    """Each value as a COPY binary field: its byte length (int32, big-endian) and its bytes."""
    lengths = pc.binary_length(values).to_numpy(zero_copy_only=False).astype(">i4")
    prefixes = pa.FixedSizeBinaryArray.from_buffers(pa.binary(4), len(values), [None, pa.py_buffer(lengths.tobytes())])
    return pc.binary_join_element_wise(pc.cast(prefixes, pa.binary()), pc.cast(values, pa.binary()), b"")


def _fixed(values: pa.Array, dtype: str, size: int) -> pa.Array:
    """Integers as COPY binary fields of ``size`` bytes."""
    numbers = values.to_numpy(zero_copy_only=False).astype(dtype)
    header = np.frombuffer(struct.pack("!i", size), dtype=np.uint8)
    fields = np.empty((len(values), 4 + size), dtype=np.uint8)
    fields[:, :4] = header
    fields[:, 4:] = numbers.view(np.uint8).reshape(len(values), size)
    return pc.cast(
        pa.FixedSizeBinaryArray.from_buffers(pa.binary(4 + size), len(values), [None, pa.py_buffer(fields.tobytes())]),
        pa.binary(),
    )


def _copy_field(field: bytes | pa.Array | pa.ChunkedArray) -> bytes | pa.Array:
    """A field of ``copy_binary_rows`` in the layouts both of its paths read: one chunk; int64,
    int32, or string and binary with 32-bit offsets (large ones are cast down)."""
    if isinstance(field, bytes):
        return field
    array = field.combine_chunks() if isinstance(field, pa.ChunkedArray) else field
    if pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type):
        return array.cast(pa.binary())
    if not (
        pa.types.is_int64(array.type)
        or pa.types.is_int32(array.type)
        or pa.types.is_string(array.type)
        or pa.types.is_binary(array.type)
    ):
        raise TypeError(f"a COPY binary column of type {array.type}: int64, int32, string or binary")
    return array


def copy_binary_rows(fields: Sequence[bytes | pa.Array], compiled: bool = COMPILED) -> pa.Buffer:
    """Rows of Arrow columns as COPY binary tuples, without header or trailer. ``fields`` in tuple
    order: ``bytes`` are written as they are in every tuple (the field count, constant fields with
    their lengths); an int64 or int32 array gives 8- or 4-byte fields, a string array
    length-prefixed ones. The arrays are of one length and hold no nulls.

    One pass in the compiled hot path (``_pgoutput_c.copy_binary_rows``); otherwise Arrow's
    kernels, which are its reference (three copies of every string), or with ``compiled`` False."""
    arrays = [_copy_field(f) for f in fields]
    columns = [a for a in arrays if not isinstance(a, bytes)]
    n = len(columns[0]) if columns else 0
    if any(len(a) != n for a in columns) or any(a.null_count for a in columns):
        raise ValueError("COPY binary columns must be of one length and hold no nulls")
    if not n:
        return pa.py_buffer(b"")
    if compiled:
        if hot_path is None:
            raise RuntimeError("the compiled hot path (sequin_provider._pgoutput_c) is not built")
        specs: list[tuple] = []
        for a in arrays:
            if isinstance(a, bytes):
                specs.append((0, a))
            elif pa.types.is_int64(a.type) or pa.types.is_int32(a.type):
                specs.append((1 if pa.types.is_int64(a.type) else 2, a.buffers()[1], a.offset))
            else:
                buffers = a.buffers()
                specs.append((3, buffers[1], buffers[2] or b"", a.offset))
        return pa.py_buffer(hot_path.copy_binary_rows(n, specs))
    parts = [
        a
        if isinstance(a, bytes)
        else _fixed(a, ">i8", 8)
        if pa.types.is_int64(a.type)
        else _fixed(a, ">i4", 4)
        if pa.types.is_int32(a.type)
        else _length_prefixed(a)
        for a in arrays
    ]
    tuples = pc.binary_join_element_wise(*parts, b"")
    joined = pc.binary_join(pa.ListArray.from_arrays(pa.array([0, len(tuples)], pa.int32()), tuples), b"")
    return joined[0].as_buffer()


def _columns(rows: RenderedRows) -> tuple[pa.Array, ...]:
    """The columns of ``rows`` that every stream row has (all but the barrier)."""
    return (rows.commit_lsn, rows.commit_idx, rows.group_id, rows.idempotency_key, rows.data)


def stream_rows_copy_binary(sink_name: str, rows: RenderedRows, template_ids: Sequence[int] = ()) -> pa.Buffer:
    """``rows`` as tuples of COPY binary (``store.STREAM_COLUMNS``), without header or trailer.

    Rows with a null group, key or message (a change the sink's tables do not name) are left out.
    The barrier is a constant null field, but for the truncates among ``rows`` (rare: each is
    written on its own, ``copy_binary_tuple``). Compact rows (``rows.compact``) name their
    template by its id in the store: ``template_ids``, index-aligned with the sink's templates
    (``store.message_template_ids`` of ``rows.compact.templates``); whole rows have neither a
    template nor a commit timestamp."""
    complete = pc.and_(pc.and_(pc.is_valid(rows.group_id), pc.is_valid(rows.idempotency_key)), pc.is_valid(rows.data))
    if not pc.all(complete).as_py():
        barrier = None if rows.barrier is None else pc.filter(rows.barrier, complete)
        compact = None if rows.compact is None else rows.compact.filter(complete)
        rows = RenderedRows(*(pc.filter(c, complete) for c in _columns(rows)), barrier, compact)
    template: bytes | pa.Array = _NULL_FIELD
    commit_timestamp: bytes | pa.Array = _NULL_FIELD
    if rows.compact is not None:
        if len(template_ids) != len(rows.compact.templates):
            raise ValueError("compact stream rows need the store's id of each of their sink's templates")
        template = pc.take(pa.array(template_ids, pa.int32()), rows.compact.template)
        commit_timestamp = rows.compact.commit_timestamp
    name = sink_name.encode()
    truncates = b""
    if rows.barrier is not None and rows.barrier.null_count < len(rows.barrier):
        is_truncate = pc.is_valid(rows.barrier)
        truncates = b"".join(
            copy_binary_tuple((sink_name, *row))
            for row in zip(*(pc.filter(c, is_truncate).to_pylist() for c in (*_columns(rows), rows.barrier)))
        )
        rows = RenderedRows(*(pc.filter(c, pc.invert(is_truncate)) for c in _columns(rows)))
    tuples = copy_binary_rows(
        [
            _FIELDS_9 + struct.pack("!i", len(name)) + name,
            rows.commit_lsn,
            rows.commit_idx,
            rows.group_id,
            rows.idempotency_key,
            rows.data,
            _NULL_FIELD,
            template,
            commit_timestamp,
        ]
    )
    return pa.py_buffer(tuples.to_pybytes() + truncates) if truncates else tuples


def copy_binary_tuple(row: Sequence[object]) -> bytes:
    """One stream row (``store.StreamRow``: sink, lsn, idx, group, key, data[, barrier]) as a COPY
    binary tuple (its message whole: no template, no commit timestamp of its own)."""
    sink, lsn, idx, group, key, data = (
        str(row[0]).encode(),
        int(row[1]),
        int(row[2]),
        str(row[3]).encode(),
        str(row[4]).encode(),
        str(row[5]).encode(),
    )
    barrier = row[6] if len(row) > 6 else None
    tail = _NULL_FIELD if barrier is None else struct.pack("!i", len(str(barrier).encode())) + str(barrier).encode()
    return (
        _FIELDS_9
        + struct.pack("!i", len(sink))
        + sink
        + struct.pack("!iqii", 8, lsn, 4, idx)
        + struct.pack("!i", len(group))
        + group
        + struct.pack("!i", len(key))
        + key
        + struct.pack("!i", len(data))
        + data
        + tail
        + _NULL_FIELD * 2
    )


def read_rows_copy_binary(
    reads: StoreReads, page_id: int, records: pa.Array, record_pks: pa.Array, compact: bool = False
) -> pa.Buffer:
    """A backfill page's reads for a plain Sequin Stream sink as COPY binary tuples of
    ``store.READ_MESSAGE_COLUMNS``, without header or trailer: ``records`` are the rows' record
    JSON texts and ``record_pks`` their keys as JSON arrays, in page order. The messages are
    ``reads.template`` around them (``messages.read_message_template``), as ``render`` renders the
    same reads through Spark (tested byte for byte); keyed ``backfill:<id>:<keys JSON>``.

    With ``compact`` a message's data is its record alone: its page holds the template
    (``store.stage_page_reads_copy``'s ``template``) and the store serves the whole message
    (``store.READ_DATA``), so each read stores a third of the bytes."""
    n = len(records)
    if not n:
        return pa.py_buffer(b"")
    idx = pa.array(np.arange(reads.commit_idx + 1, reads.commit_idx + 1 + n, dtype=np.int64))
    idx_text = pc.cast(idx, pa.string())
    key = pc.binary_join_element_wise(f"backfill:{reads.backfill_id}:", record_pks, "")
    group = (
        pc.binary_join_element_wise(reads.group_prefix, record_pks, "")
        if reads.group_prefix is not None
        else pc.binary_join_element_wise(f"{reads.commit_lsn}:", idx_text, "")
    )
    t = reads.template
    if t.record_only or compact:
        data = records
    else:
        # the key as a JSON string: it holds a JSON text, whose only characters JSON escapes are '"' and '\'
        key_json = pc.binary_join_element_wise(
            '"', pc.replace_substring(pc.replace_substring(key, "\\", "\\\\"), '"', '\\"'), '"', ""
        )
        data = pc.binary_join_element_wise(
            t.before_record,
            records,
            t.before_idx,
            idx_text,
            ',"idempotency_key":',
            key_json,
            ',"record_pks":',
            record_pks,
            t.after_pks,
            "",
        )
    name = reads.sink.encode()
    start = _FIELDS_7 + struct.pack("!i", len(name)) + name + struct.pack("!iq", 8, reads.commit_lsn)
    return copy_binary_rows([start, pc.cast(idx, pa.int32()), group, key, data, struct.pack("!iq", 8, page_id)])
