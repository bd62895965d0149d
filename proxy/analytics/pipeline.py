"""The ``pulsar-tap analyze`` pipeline on Spark.

1. Segment files are read with Spark's ``binaryFile`` source (local paths or any
   Hadoop filesystem URL), one row per segment, so executors split the work by
   segment; ``mapInArrow`` decodes each into frame rows (:func:`segment_columns`).
2. Frames are grouped by (recording, connection) and ``applyInArrow`` runs the
   session machine over each connection in capture order
   (:func:`connection_tables`), giving the rows of every table at once.
3. The rows are cached, split into the Parquet tables ``frames``, ``requests``,
   ``messages``, ``errors``, ``throughput`` and ``replication`` under ``OUT/``, and
   aggregated on Spark into the report's figures.

Both Python steps run the project's own codec, in Arrow batches, never row at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from proxy.analytics.decode import SEGMENT_SCHEMA, TABLES, connection_tables, ddl, segment_columns
from proxy.analytics.spark import AnalyticsError, StageProgress
from proxy.errors import RecordingError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

SEGMENT_GLOB: Final = "segment-*.ptap"
_ROWS_PER_BATCH: Final = 4096
_SEGMENT_INDEX = re.compile(r"segment-(\d+)\.ptap$")

#: The union of every table's columns, plus which table a row belongs to.
EVENT_COLUMNS: Final = (("table", "string"), *{
    name: kind for cols in TABLES.values() for name, kind in cols}.items())

#: Output tables -> the columns they are partitioned by on disk.
PARTITIONING: Final[dict[str, tuple[str, ...]]] = {
    "frames": ("command",), "requests": ("request_command",), "messages": (), "errors": (),
    "throughput": (), "replication": (),
}


@dataclass
class AnalyzeResult:
    """What the pipeline wrote and the figures the report shows."""

    out: Path | str
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    latency: list[dict[str, Any]] = field(default_factory=list)
    top_topics: list[dict[str, Any]] = field(default_factory=list)
    error_counts: list[dict[str, Any]] = field(default_factory=list)
    throughput: list[dict[str, Any]] = field(default_factory=list)
    segments: int = 0
    input_bytes: int = 0


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def resolve_inputs(paths: Sequence[str]) -> list[str]:
    """Check local inputs up front so a typo gets a clear error rather than a Spark trace."""
    resolved = []
    for raw in paths:
        if _is_url(raw):
            resolved.append(raw)
            continue
        path = Path(raw.removeprefix("file://"))
        if not path.exists():
            raise AnalyticsError(f"{raw}: no such file or directory")
        if not path.is_dir():
            raise AnalyticsError(f"{raw}: not a recording directory")
        if not any(path.rglob(SEGMENT_GLOB)):
            raise AnalyticsError(f"{raw}: no recording here (no {SEGMENT_GLOB} files)")
        resolved.append(str(path.resolve()))
    return resolved


def _segment_index(path: str) -> int:
    match = _SEGMENT_INDEX.search(path)
    return int(match.group(1)) if match else 0


def _decode_segments() -> Any:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        schema = _arrow_schema(SEGMENT_SCHEMA)
        for batch in batches:
            paths = batch.column("path").to_pylist()
            contents = batch.column("content")
            for i, path in enumerate(paths):
                recording = path.rstrip("/").split("/")[-2]
                segment = path.rsplit("/", 1)[-1]
                cols = segment_columns(recording, segment, _segment_index(path), contents[i].as_py())
                rows = len(cols["seq"])
                # small batches: a 256 MiB segment must not become one Arrow batch in the JVM
                for start in range(0, max(rows, 1), _ROWS_PER_BATCH):
                    yield pa.RecordBatch.from_pydict(
                        {name: values[start:start + _ROWS_PER_BATCH] for name, values in cols.items()},
                        schema=schema)

    return run


def _analyze_connection(group: pa.Table) -> pa.Table:
    import pyarrow as pa

    group = group.sort_by("seq")
    recording = group.column("recording")[0].as_py()
    conn_id = group.column("conn_id")[0].as_py()
    rows = zip(group.column("ts_ns").to_pylist(), group.column("direction").to_pylist(),
               group.column("origin").to_pylist(), group.column("size").to_pylist(),
               group.column("data").to_pylist(), group.column("payload_stripped").to_pylist(),
               group.column("rules").to_pylist(), strict=True)
    tables = connection_tables(recording, conn_id, rows).tables
    out: dict[str, list[Any]] = {name: [] for name, _ in EVENT_COLUMNS}
    for table, cols in tables.items():
        size = len(next(iter(cols.values())))
        if not size:
            continue
        out["table"] += [table] * size
        for name, _ in EVENT_COLUMNS[1:]:
            values = cols.get(name)
            if values is None and name == "ts_ns":
                values = cols.get("start_ns")
            out[name] += values if values is not None else [None] * size
    return pa.Table.from_pydict(out, schema=_arrow_schema(EVENT_COLUMNS))


def _arrow_schema(columns: Sequence[tuple[str, str]]) -> pa.Schema:
    import pyarrow as pa

    kinds = {"string": pa.string(), "bigint": pa.int64(), "int": pa.int32(), "double": pa.float64(),
             "binary": pa.binary(), "boolean": pa.bool_()}
    return pa.schema([(name, kinds[kind]) for name, kind in columns])


def parse_time(text: str) -> int:
    """``--since``/``--until``: ISO 8601 (UTC unless it says), or Unix seconds; returns epoch ns."""
    from datetime import UTC, datetime

    try:
        return int(float(text) * 1e9)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise AnalyticsError(f"bad time {text!r}: use ISO 8601 (2026-11-22T10:00:00Z) or Unix seconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1e9)


def run_pipeline(spark: SparkSession, inputs: Sequence[str], out: str, *, since_ns: int | None = None,
                 until_ns: int | None = None, strict: bool = False,
                 progress: StageProgress | None = None) -> AnalyzeResult:
    """Run the whole pipeline; returns the figures for the report."""
    from pyspark.sql import functions as F  # noqa: N812 - Spark's customary alias
    from pyspark.storagelevel import StorageLevel

    def step(label: str) -> None:
        if progress is not None:
            progress.step(label)

    result = AnalyzeResult(out)
    step("reading segments")
    # One segment per task, read where it is decoded: packing files into partitions and
    # then repartitioning would shuffle every segment's bytes through the JVM.
    spark.conf.set("spark.sql.files.maxPartitionBytes", "1")
    spark.conf.set("spark.sql.files.openCostInBytes", "1")
    try:
        segments = (spark.read.format("binaryFile").option("pathGlobFilter", SEGMENT_GLOB)
                    .option("recursiveFileLookup", "true").load(list(inputs)))
        listing = segments.select("path", "length").collect()
    except Exception as exc:
        raise AnalyticsError(f"cannot list the recordings: {str(exc).splitlines()[0]}") from None
    if not listing:
        raise AnalyticsError("no segment files found in " + ", ".join(inputs))
    result.segments = len(listing)
    result.input_bytes = sum(row["length"] for row in listing)

    step("decoding frames")
    frame_rows = segments.select("path", "content").mapInArrow(_decode_segments(), ddl(SEGMENT_SCHEMA))
    frame_rows = frame_rows.persist(StorageLevel.MEMORY_AND_DISK)
    problems = frame_rows.filter(F.col("problem").isNotNull()).select("recording", "problem").collect()
    result.problems = [f"{row['recording']}/{row['problem']}" for row in problems]
    if strict and result.problems:
        raise RecordingError(result.problems[0] + " (--strict)")

    step("pairing requests per connection")
    events = (frame_rows.filter(F.col("problem").isNull())
              .groupBy("recording", "conn_id").applyInArrow(_analyze_connection, ddl(EVENT_COLUMNS)))
    if since_ns is not None:
        events = events.filter(F.col("ts_ns") >= since_ns)
    if until_ns is not None:
        events = events.filter(F.col("ts_ns") < until_ns)
    events = events.persist(StorageLevel.MEMORY_AND_DISK)

    def table(name: str) -> DataFrame:
        return events.filter(F.col("table") == name).select(*[name for name, _ in TABLES[name]])

    frames, requests = table("frames"), table("requests")
    errors = (requests.filter(F.col("outcome") != "ok")
              .select("recording", "conn_id", F.col("start_ns").alias("ts_ns"),
                      F.col("request_command").alias("command"), "topic", "outcome", "error_code", "error_message")
              .unionByName(table("problems").select(
                  "recording", "conn_id", "ts_ns", F.lit(None).cast("string").alias("command"),
                  F.lit(None).cast("string").alias("topic"), F.lit("undecodable").alias("outcome"),
                  F.lit("DecodeError").alias("error_code"), F.col("message").alias("error_message"))))
    second = (F.col("ts_ns") / F.lit(1_000_000_000)).cast("bigint")
    payload_frames = frames.filter(F.col("command").isin("SEND", "MESSAGE"))
    is_send = F.col("command") == "SEND"
    throughput = (payload_frames.withColumn("second", second)
                  .groupBy(F.coalesce(F.col("topic"), F.lit("(unknown)")).alias("topic"), "second")
                  .agg(F.sum(F.when(is_send, F.col("num_messages")).otherwise(0)).alias("messages_in"),
                       F.sum(F.when(is_send, F.col("size")).otherwise(0)).alias("bytes_in"),
                       F.sum(F.when(~is_send, F.col("num_messages")).otherwise(0)).alias("messages_out"),
                       F.sum(F.when(~is_send, F.col("size")).otherwise(0)).alias("bytes_out"))
                  .orderBy("second", "topic"))
    outputs: dict[str, DataFrame] = {
        "frames": frames, "requests": requests, "messages": table("messages"), "errors": errors,
        "throughput": throughput, "replication": table("replication"),
    }
    for name, frame in outputs.items():
        step(f"writing {name}")
        writer = frame.write.mode("overwrite")
        if PARTITIONING[name]:
            writer = writer.partitionBy(*PARTITIONING[name])
        writer.parquet(f"{str(out).rstrip('/')}/{name}")

    step("computing the report")
    counts = events.groupBy("table").count().collect()
    result.counts = {row["table"]: row["count"] for row in counts}
    result.counts.setdefault("errors", 0)
    result.counts["errors"] = result.counts.get("problems", 0) + requests.filter(F.col("outcome") != "ok").count()
    result.latency = [row.asDict() for row in (
        requests.filter(F.col("outcome") != "unanswered").groupBy("request_command")
        .agg(F.count("*").alias("count"),
             F.expr("percentile(latency_us, array(0.5, 0.9, 0.99))").alias("p"),
             F.max("latency_us").alias("max"))
        .orderBy(F.desc("count")).collect())]
    for row in result.latency:
        p50, p90, p99 = row.pop("p")
        row.update(p50=p50, p90=p90, p99=p99)
    result.top_topics = [row.asDict() for row in (
        throughput.groupBy("topic").agg(F.sum("messages_in").alias("messages_in"),
                                        F.sum("bytes_in").alias("bytes_in"),
                                        F.sum("messages_out").alias("messages_out"),
                                        F.sum("bytes_out").alias("bytes_out"))
        .orderBy(F.desc(F.col("bytes_in") + F.col("bytes_out"))).limit(10).collect())]
    result.error_counts = [row.asDict() for row in (
        errors.groupBy(F.coalesce("error_code", "outcome").alias("code")).count()
        .orderBy(F.desc("count")).collect())]
    result.throughput = [row.asDict() for row in (
        throughput.groupBy("second").agg(F.sum("messages_in").alias("messages_in"),
                                         F.sum("messages_out").alias("messages_out"),
                                         F.sum("bytes_in").alias("bytes_in"),
                                         F.sum("bytes_out").alias("bytes_out"))
        .orderBy("second").limit(3600).collect())]
    events.unpersist()
    frame_rows.unpersist()
    return result
