"""The analytics tables: their columns, and the rows that pass between the pipeline's steps.

Output (``OUT/<table>/``, Parquet): ``frames``, ``requests``, ``messages``, ``errors``,
``throughput`` and ``replication`` (SPEC.md, "analyze output"; the columns are in
:data:`TABLES`).  ``frames`` is partitioned on disk by ``command`` and ``requests`` by
``request_command``.

The ``replication`` table (filled by geo-replication traffic) has one row per
message that carries ``replicated_from`` (``kind = "replicated_message"``; ``lag_ms``
= capture time minus the message's publish time, i.e. how long replication took to
bring it to this connection) and one per replication marker (``kind`` = the marker
type name, e.g. ``REPLICATED_SUBSCRIPTION_SNAPSHOT``; ``snapshot_id`` and
``source_cluster`` from the marker's body when it has them).  ``direction`` says
whether the proxy saw it going to the broker (a replicator producing) or to a client.

Between the steps (see :mod:`proxy.analytics.pipeline`):

- :data:`STAGED` — the large rows the first step writes per split (frames of the data
  path, messages, replication rows), each naming the producer or consumer its topic
  must be looked up for (``ref_kind``, ``ref_id``) and the point in the connection's
  history at which (``epoch``);
- :data:`EDGE` — the few rows the first step hands to the second, keyed by
  connection: control frames, SEND ids with their receipts, topic look-ups, chunks
  of messages that span splits, problems, and the connection's last capture time;
- :data:`RESOLUTION` — the second step's answers to the topic look-ups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import pyarrow as pa

Columns = tuple[tuple[str, str], ...]

#: The output tables and their columns (Spark DDL types), in order.
TABLES: Final[dict[str, Columns]] = {
    "frames": (
        ("recording", "string"), ("conn_id", "bigint"), ("ts_ns", "bigint"), ("direction", "string"),
        ("origin", "string"), ("command", "string"), ("size", "int"), ("topic", "string"),
        ("request_id", "bigint"), ("producer_id", "bigint"), ("consumer_id", "bigint"),
        ("sequence_id", "bigint"), ("num_messages", "int"), ("payload_size", "int"), ("rules", "string"),
    ),
    "requests": (
        ("recording", "string"), ("conn_id", "bigint"), ("request_command", "string"),
        ("response_command", "string"), ("topic", "string"), ("start_ns", "bigint"), ("end_ns", "bigint"),
        ("latency_us", "double"), ("outcome", "string"), ("error_code", "string"), ("error_message", "string"),
        ("request_id", "bigint"), ("producer_id", "bigint"), ("consumer_id", "bigint"),
        ("sequence_id", "bigint"), ("num_messages", "int"),
    ),
    "messages": (
        ("recording", "string"), ("conn_id", "bigint"), ("ts_ns", "bigint"), ("topic", "string"),
        ("producer_name", "string"), ("sequence_id", "bigint"), ("publish_time_ms", "bigint"),
        ("size", "int"), ("compression", "string"), ("key", "string"), ("properties_count", "int"),
        ("batch_index", "int"), ("event_time_ms", "bigint"),
    ),
    "errors": (
        ("recording", "string"), ("conn_id", "bigint"), ("ts_ns", "bigint"), ("command", "string"),
        ("topic", "string"), ("outcome", "string"), ("error_code", "string"), ("error_message", "string"),
    ),
    "throughput": (
        ("topic", "string"), ("second", "bigint"), ("messages_in", "bigint"), ("bytes_in", "bigint"),
        ("messages_out", "bigint"), ("bytes_out", "bigint"),
    ),
    "replication": (
        ("recording", "string"), ("conn_id", "bigint"), ("ts_ns", "bigint"), ("direction", "string"),
        ("topic", "string"), ("kind", "string"), ("replicated_from", "string"), ("publish_time_ms", "bigint"),
        ("lag_ms", "double"), ("snapshot_id", "string"), ("source_cluster", "string"),
    ),
}

#: Output tables -> the columns they are partitioned by on disk.
PARTITIONING: Final[dict[str, tuple[str, ...]]] = {
    "frames": ("command",), "requests": ("request_command",), "messages": (), "errors": (),
    "throughput": (), "replication": (),
}

#: Frame decoding problems (a frame that does not decode); they reach ``errors`` as ``undecodable``.
PROBLEM_COLUMNS: Final[Columns] = (
    ("recording", "string"), ("conn_id", "bigint"), ("ts_ns", "bigint"), ("where", "string"), ("message", "string"),
)

_REF: Final[Columns] = (("epoch", "bigint"), ("ref_kind", "int"), ("ref_id", "bigint"))

#: The large per-split rows: a table's columns without ``topic``, plus the topic reference.
STAGED: Final[dict[str, Columns]] = {
    name: tuple(col for col in TABLES[name] if col[0] != "topic") + _REF
    for name in ("frames", "messages", "replication")
}

#: ``ref_kind`` values: whose topic a row is attributed to.
REF_PRODUCER: Final = 1
REF_CONSUMER: Final = 2

#: Kinds of :data:`EDGE` rows.
EDGE_CONTROL: Final = 1       # a control frame (no payload), for the session machine: ``data`` = the frame
EDGE_SEND: Final = 2          # a SEND, SEND_RECEIPT or SEND_ERROR: ids, time, error, epoch
EDGE_REF: Final = 3           # a topic look-up: (epoch, ref_kind, ref_id)
EDGE_CHUNK: Final = 4         # a chunk whose message spans splits: ``data`` = its MessageMetadata
EDGE_CHUNK_RESET: Final = 5   # a chunked message restarted (chunk 0) and finished within a split
EDGE_PROBLEM: Final = 6       # a frame that did not decode
EDGE_LAST: Final = 7          # the connection's last capture time in the split

EDGE: Final[Columns] = (
    ("recording", "string"), ("conn_id", "bigint"), ("seq", "bigint"), ("edge", "int"), ("ts_ns", "bigint"),
    ("direction", "string"), ("origin", "string"), ("size", "int"), ("rules", "string"), ("data", "binary"),
    ("frame_type", "int"), ("producer_id", "bigint"), ("sequence_id", "bigint"), ("num_messages", "int"),
    ("error_code", "string"), ("error_message", "string"), ("ref_kind", "int"), ("ref_id", "bigint"),
    ("payload_size", "int"), ("message", "string"), ("epoch", "bigint"),
)

RESOLUTION: Final[Columns] = (
    ("recording", "string"), ("conn_id", "bigint"), ("epoch", "bigint"), ("ref_kind", "int"), ("ref_id", "bigint"),
    ("topic", "string"),
)


def ddl(columns: Iterable[tuple[str, str]]) -> str:
    """A Spark DDL schema string such as ``"`a` string, `b` bigint"``."""
    return ", ".join(f"`{name}` {kind}" for name, kind in columns)


def arrow_schema(columns: Sequence[tuple[str, str]]) -> pa.Schema:
    import pyarrow as pa

    kinds = {"string": pa.string(), "bigint": pa.int64(), "int": pa.int32(), "double": pa.float64(),
             "binary": pa.binary(), "boolean": pa.bool_()}
    return pa.schema([(name, kinds[kind]) for name, kind in columns])


def names(columns: Columns) -> list[str]:
    return [name for name, _ in columns]


__all__ = ["EDGE", "EDGE_CHUNK", "EDGE_CHUNK_RESET", "EDGE_CONTROL", "EDGE_LAST", "EDGE_PROBLEM", "EDGE_REF",
           "EDGE_SEND", "PARTITIONING", "PROBLEM_COLUMNS", "REF_CONSUMER", "REF_PRODUCER", "RESOLUTION", "STAGED",
           "TABLES", "arrow_schema", "ddl", "names"]
