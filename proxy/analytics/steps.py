"""The three steps of ``analyze`` as plain functions, the same on Spark's executors and in one process.

1. :func:`decode_local_split` — a byte range of a segment to staged rows and edge
   rows (:mod:`proxy.analytics.decode`);
2. :func:`finish_edges` — the edge rows of some connections to their control frames,
   requests, errors, spanning chunked messages and topic answers
   (:mod:`proxy.analytics.connections`);
3. :func:`resolve_staged` — a split's staged rows given their topics and written
   (:mod:`proxy.analytics.output`).

Each returns its share of the report's :class:`~proxy.analytics.figures.Figures`.
:func:`analyze_in_process` runs them one after the other in this process: the
single-process pass ``bench/analyze.py`` measures Spark against, and what the tests
compare Spark's tables with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.analytics.connections import ConnectionTables, TimeWindow, finish_connections
from proxy.analytics.decode import SplitOutput, decode_split
from proxy.analytics.figures import Figures
from proxy.analytics.inputs import DEFAULT_SPLIT_BYTES, local_segments, mapped
from proxy.analytics.output import (
    BufferedTableWriter,
    TableWriter,
    resolution_table,
    resolve_split,
    throughput_rows,
)
from proxy.analytics.segments import Split, plan_splits, segment_recording_id

if TYPE_CHECKING:
    import pyarrow as pa

#: Tables written by step 2 (from edge rows) and step 3 (from staged rows).
EDGE_TABLES = ("frames", "requests", "messages", "errors")
STAGED_TABLES = ("frames", "messages", "replication")
ALL_TABLES = ("frames", "requests", "messages", "errors", "throughput", "replication")


@dataclass
class AnalyzeResult:
    """What a run wrote, and the report's figures."""

    out: str
    segments: int = 0
    splits: int = 0
    input_bytes: int = 0
    frames_read: int = 0
    figures: Figures = field(default_factory=Figures)
    #: tables completely written, in the order they were published
    written: list[str] = field(default_factory=list)
    #: seconds per phase, for the progress summary and the benchmark
    timings: dict[str, float] = field(default_factory=dict)
    #: per task of the one-job Spark plan, the phases it went through: (phase, seconds since the job was
    #: submitted, CPU seconds its process used since the task started), for the benchmark
    timeline: list[list[tuple[str, float, float]]] = field(default_factory=list)


def decode_local_split(split: Split) -> SplitOutput:
    """Step 1 for a split of a local segment file."""
    with mapped(split.location) as data:
        return decode_split(split, data, segment_recording_id(data))


def decode_content_split(split: Split, content: bytes) -> SplitOutput:
    """Step 1 for a whole segment whose bytes came from elsewhere (Spark's binaryFile source)."""
    return decode_split(split, content, segment_recording_id(content))


def finish_edges(edges: pa.Table, window: TimeWindow, writer: TableWriter | None, part: str,
                 others: pa.Table | None = None) -> tuple[list[tuple[object, ...]], Figures, ConnectionTables]:
    """Step 2 for the edge rows of some connections (all rows of each one).

    Writes the rows it makes when ``writer`` is given; returns the topic answers (also
    those of the connections in ``others``, see :func:`finish_connections`), the figures
    and the rows.
    """
    rows = finish_connections(edges, window, others)
    figures = Figures()
    figures.add_requests(rows.requests)
    figures.add_errors(rows.errors)
    figures.counts["frames"] += rows.frames.num_rows
    figures.counts["messages"] += rows.messages.num_rows
    if writer is not None:
        for name in EDGE_TABLES:
            writer.write(name, getattr(rows, name), part)
    return rows.resolution, figures, rows


def resolve_staged(staged: dict[str, pa.Table], resolution: pa.Table, window: TimeWindow,
                   writer: TableWriter | None, part: str) -> Figures:
    """Step 3 for one split's staged rows: topics in, rows written, figures out."""
    final = resolve_split(staged, resolution, window)
    figures = Figures()
    figures.counts["frames"] += final["frames"].num_rows
    figures.counts["messages"] += final["messages"].num_rows
    figures.add_replication(final["replication"])
    figures.throughput = throughput_rows(final["frames"])  # SEND and MESSAGE are never control frames
    if writer is not None:
        for name in STAGED_TABLES:
            writer.write(name, final[name], part)
    return figures


def analyze_in_process(inputs: Sequence[str], out: str | None, window: TimeWindow | None = None, *,
                       split_bytes: int = DEFAULT_SPLIT_BYTES,
                       step: Callable[[str], None] | None = None) -> AnalyzeResult:
    """All three steps in this process over local recordings; writes ``out`` unless it is None."""
    import pyarrow as pa

    def phase(label: str) -> None:
        if step is not None:
            step(label)

    window = window or TimeWindow()
    segments = local_segments(inputs)
    splits = plan_splits(segments, split_bytes)
    result = AnalyzeResult(out or "", segments=len(segments), splits=len(splits),
                           input_bytes=sum(s[3] for s in segments))
    writer = BufferedTableWriter(Path(out), None, "p") if out is not None else None
    clock = time.perf_counter()
    try:
        phase("decoding frames")
        decoded = []
        for split in splits:
            output = decode_local_split(split)
            result.frames_read += output.frames
            result.figures.skipped += [r.describe() for r in output.skipped]
            decoded.append(output)
        result.timings["decode"] = time.perf_counter() - clock
        phase("pairing requests per connection")
        edges = pa.concat_tables([o.edges for o in decoded])
        answers, figures, rows = finish_edges(edges, window, writer, "c00000")
        del edges
        result.figures.merge(figures)
        resolution = resolution_table(answers)
        phase("writing tables")
        del rows
        for output in decoded:
            result.figures.merge(resolve_staged(output.staged, resolution, window, writer,
                                                f"s{output.split.split_id:05d}"))
        throughput = result.figures.throughput
        result.figures.counts["throughput"] = throughput.num_rows if throughput is not None else 0
        if writer is not None:
            if throughput is not None:
                writer.write("throughput", throughput, "t00000")
            writer.flush()
            result.written = writer.publish(ALL_TABLES)
        result.timings["total"] = time.perf_counter() - clock
    finally:
        if writer is not None:
            writer.discard()
    return result


__all__ = ["ALL_TABLES", "AnalyzeResult", "analyze_in_process", "decode_content_split", "decode_local_split",
           "finish_edges", "resolve_staged"]
