"""The ``pulsar-tap analyze`` plan on Spark: three steps, one shuffle of narrow rows.

1. **Decode** (one task per split, :func:`decode_task`): every split of every segment
   is decoded where it is read (:mod:`proxy.analytics.decode`).  The large rows
   (data-path frames, messages, replication) stay on the executor — staged beside the
   output — and so do the narrow edge rows, which the driver reads from there (a few
   per connection and split; with more than :data:`DRIVER_EDGE_ROWS` of them they are
   read back as rows and shuffled instead).
2. **Finish connections** (:func:`finish_task`): the edge rows are the only thing
   shuffled, by connection; each task runs its connections' control frames through the
   session machine, pairs SENDs with their receipts, writes ``requests``, ``errors`` and
   the control frames' ``frames`` rows, and answers the first step's topic look-ups.
3. **Resolve** (one task per split, :func:`resolve_task`): the staged rows get their
   topics (the answers are broadcast) and are written.

Each task also returns its share of the report's :class:`~proxy.analytics.figures.Figures`,
added up here.  Frame bytes never cross the shuffle: what does is listed in
:mod:`proxy.analytics.decode`.

When the recordings and ``--out`` are local paths, no DataFrame is needed, and how the
steps run depends on the master:

- on a local master that does not retry tasks (``local[N]``, ``local[*]``), all three
  steps are **one job** of one barrier task per core (:func:`barrier_task`): the tasks
  claim splits as they go (:class:`SplitClaims`; the last ones cut small,
  :func:`~proxy.analytics.segments.taper_splits`, so that they end decoding together),
  meet once, through files in the staging directory, finish the connections each owns
  (:func:`connection_owners`; each also answers the topic look-ups of the others' from
  their control frames) and resolve the splits they decoded from memory.  A job costs
  ~0.1 s of waiting and JVM time whatever it does, and the driver does no step's work;
- elsewhere (clusters, where Spark reruns failed tasks), steps 1 and 3 are plain Spark
  tasks over groups of splits (:func:`decode_plain_task`, :func:`resolve_plain_task`:
  no query plan, nothing converted in the JVM) and step 2 runs on the driver.

Otherwise steps 1 and 3 are ``mapInArrow`` stages.  Where the tables are written
depends on ``--out``: a local path (which every executor sees: always so on one
machine, a shared mount on a cluster) is written by the tasks themselves with Arrow
(:class:`~proxy.analytics.output.TableWriter`, moved into place when complete); a
Hadoop URL (``hdfs://``, ``s3a://``, ``file:///``) is written by Spark's own writers,
the tasks handing their rows over as Arrow IPC blobs.  Inputs likewise: local paths
are split into byte ranges read by the tasks, URLs are read by Spark's ``binaryFile``
source, a segment per task.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from proxy.analytics import tables as tb
from proxy.analytics.connections import TimeWindow
from proxy.analytics.decode import SplitOutput
from proxy.analytics.figures import Figures
from proxy.analytics.inputs import DEFAULT_SPLIT_BYTES, SEGMENT_GLOB, AnalyticsError, is_url, local_segments
from proxy.analytics.output import BufferedTableWriter, TableWriter, merge_throughput, resolution_table
from proxy.analytics.segments import Split, plan_splits, segment_index, taper_splits
from proxy.analytics.spark import StageProgress
from proxy.analytics.steps import (
    ALL_TABLES,
    AnalyzeResult,
    decode_content_split,
    decode_local_split,
    finish_edges,
    resolve_staged,
)
from proxy.errors import RecordingError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

#: Extra kinds of :data:`~proxy.analytics.tables.EDGE` rows that only the Spark plan uses.
EDGE_SPLIT: Final = 8      # data = pickle((split_id, frames, skipped ranges))
EDGE_STAGED: Final = 9     # data = a staged table as Arrow IPC, message = its name
#: Up to this many edge rows, the second step runs on the driver instead of as shuffled tasks.
DRIVER_EDGE_ROWS: Final = 2_000_000

#: What the second and third steps return: topic answers, figures, table blobs.
RESULT: Final[tb.Columns] = (("kind", "int"), *tb.RESOLUTION, ("name", "string"), ("data", "binary"))
RESULT_ANSWER: Final = 1
RESULT_FIGURES: Final = 2
RESULT_TABLE: Final = 3


# -- what the executors run ---------------------------------------------------------------------
def _settle() -> None:
    """Move what the worker process holds so far (its imports, mostly) out of the garbage collector's sight.

    A reused PySpark worker runs a full collection after every task, and a full
    collection walks every object: with pyarrow, pandas and protobuf imported that was
    a third of the workers' CPU time on a 100 MiB pass.  Frozen objects are skipped; what
    a task leaves behind is still collected after it, and frozen at the next task's start.
    """
    import gc

    gc.freeze()


def _ipc(table: pa.Table) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _from_ipc(data: bytes) -> pa.Table:
    import pyarrow as pa

    return pa.ipc.open_stream(data).read_all()


def _edge_blob_rows(recording: str, split_id: int, rows: list[tuple[int, str | None, bytes]]) -> pa.RecordBatch:
    import pyarrow as pa

    schema = tb.arrow_schema(tb.EDGE)
    columns: dict[str, Any] = {name: pa.nulls(len(rows), kind) for name, kind in zip(schema.names, schema.types,
                                                                                       strict=True)}
    columns["recording"] = pa.array([recording] * len(rows), pa.string())
    columns["conn_id"] = pa.array([-1] * len(rows), pa.int64())
    columns["seq"] = pa.array([split_id] * len(rows), pa.int64())
    columns["edge"] = pa.array([kind for kind, _, _ in rows], pa.int32())
    columns["message"] = pa.array([name for _, name, _ in rows], pa.string())
    columns["data"] = pa.array([data for _, _, data in rows], pa.binary())
    return pa.RecordBatch.from_pydict(columns, schema=schema)


def _hand_over(output: SplitOutput, staging: str | None) -> Iterator[pa.RecordBatch]:
    """Step 1's output leaves the task: staged rows to ``staging`` (or as blobs), edges to Spark."""

    split = output.split
    blobs: list[tuple[int, str | None, bytes]] = [(EDGE_SPLIT, None, pickle.dumps(_split_summary(output)))]
    if staging is not None:  # the edges too: the driver reads them, they need not pass through the JVM
        _stage(output, staging)
        yield _edge_blob_rows(output.recording, split.split_id, blobs)
        return
    blobs += [(EDGE_STAGED, name, _ipc(table)) for name, table in output.staged.items()]
    yield _edge_blob_rows(output.recording, split.split_id, blobs)
    yield from output.edges.to_batches(max_chunksize=65_536)


def _split_summary(output: SplitOutput) -> tuple[int, int, list[Any], int]:
    """What the driver learns of a decoded split: its id, frames, damaged stretches, edge rows."""
    return output.split.split_id, output.frames, output.skipped, output.edges.num_rows


def _stage(output: SplitOutput, staging: str, *, edges: bool = True) -> None:
    """A split's staged rows and (unless not ``edges``) its edge rows, as files in ``staging`` (read by steps 2, 3)."""
    import pyarrow.feather as feather

    split_id = output.split.split_id
    for name, table in [*output.staged.items(), *([("edges", output.edges)] if edges else [])]:
        feather.write_feather(table, f"{staging}/split-{split_id:05d}-{name}.arrow", compression="lz4")


def _resolve_staged_split(split_id: int, staging: str, resolution: pa.Table, window: TimeWindow,
                          writer: TableWriter) -> Figures:
    """Step 3 for a split whose rows are in ``staging``."""
    import pyarrow.feather as feather

    staged = {name: feather.read_table(f"{staging}/split-{split_id:05d}-{name}.arrow")
              for name in ("frames", "messages", "replication")}
    return resolve_staged(staged, resolution, window, writer, f"s{split_id:05d}")


def task_groups(sizes: Sequence[int], tasks: int) -> list[list[int]]:
    """The indices of ``sizes`` dealt into at most ``tasks`` groups of about equal total size.

    Largest first, each to the group with the least so far; each group in index order.
    A plain task costs the driver's JVM ~10 ms of CPU and ~30 ms of waiting whatever it
    does (an empty 13-task job 0.40-0.45 s, a 2-task one 0.09 s on the 2-core machine),
    so the plain steps run two tasks per core, each over a group of splits, rather than
    one task per split: equal-sized splits keep the cores as evenly busy either way, and
    the second task per core still lets a core that others slow down hand work to the other.
    """
    count = max(1, min(len(sizes), tasks))
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = loads.index(min(loads))
        groups[lightest].append(index)
        loads[lightest] += sizes[index]
    return [sorted(group) for group in groups if group]


def decode_plain_task(groups: Iterator[list[int]], splits: list[Split], staging: str
                      ) -> Iterator[tuple[int, int, list[Any], int]]:
    """Step 1 as a plain Spark task over groups of splits (local, rows staged): a summary per split goes back.

    Without a DataFrame around it Spark plans no query and converts no rows: a job of
    13 such tasks took 0.4-0.9 s on the loaded 2-core machine where ``mapInArrow`` took 0.6-1.2 s.
    """
    _settle()
    for split_ids in groups:
        for split_id in split_ids:
            output = decode_local_split(splits[split_id])
            _stage(output, staging)
            yield _split_summary(output)


def resolve_plain_task(groups: Iterator[list[int]], answers: Any, window: TimeWindow, staging: str, work: str
                       ) -> Iterator[bytes]:
    """Step 3 as a plain Spark task over groups of splits: staged rows given topics and written; figures back."""
    _settle()
    resolution = _from_ipc(answers.value)
    writer = TableWriter(Path(work).parent, Path(work))
    for split_ids in groups:
        for split_id in split_ids:
            yield _resolve_staged_split(split_id, staging, resolution, window, writer).to_bytes()


class SplitClaims:
    """Splits handed to whichever task asks first, largest first: a core that others slow down does fewer.

    A claim is a file created exclusively (``O_EXCL``) in ``directory``, which every
    task sees (the staging directory: a local path, shared on a cluster).  Each task
    walks the same order and takes what no task took before it, so every split is
    decoded exactly once whatever the tasks' speeds.
    """

    def __init__(self, directory: str, sizes: Sequence[int]) -> None:
        self.directory = directory
        self.order = sorted(range(len(sizes)), key=lambda index: (-sizes[index], index))

    def __iter__(self) -> Iterator[int]:
        os.makedirs(self.directory, exist_ok=True)
        for split_id in self.order:
            try:
                os.close(os.open(f"{self.directory}/claim-{split_id:05d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                                 0o600))
            except FileExistsError:
                continue
            yield split_id


def connection_owners(edges: pa.Table, tasks: int) -> Any:
    """Which of ``tasks`` tasks finishes the connection of each of ``edges``' rows (a numpy array of task numbers).

    A connection's key (its recording's CRC-32 plus its id) is mixed (SplitMix64's
    finaliser) before it is dealt: connection ids come in patterns (the synthetic
    recordings make every fourth connection a consumer's, which has no SEND rows), and
    ``key % tasks`` gave one of two tasks all the consumers and so 1.5x the other's SEND
    rows to pair (Fibonacci hashing, ``key * 0x9E3779B97F4A7C15``, kept a period of four).
    """
    import zlib

    import numpy as np
    import pyarrow.compute as pc

    if tasks <= 1 or not edges.num_rows:
        return np.zeros(edges.num_rows, dtype=np.int64)
    recordings = pc.dictionary_encode(edges["recording"].combine_chunks())
    offsets = np.array([zlib.crc32(name.encode()) for name in recordings.dictionary.to_pylist()], dtype=np.uint64)
    keys = offsets[recordings.indices.to_numpy(zero_copy_only=False)] + edges["conn_id"].to_numpy().astype(np.uint64)
    keys ^= keys >> np.uint64(30)  # (the products wrap around 2**64, as they should)
    keys *= np.uint64(0xBF58476D1CE4E5B9)
    keys ^= keys >> np.uint64(27)
    keys *= np.uint64(0x94D049BB133111EB)
    keys ^= keys >> np.uint64(31)
    return (keys % np.uint64(tasks)).astype(np.int64)


def _all_arrived(staging: str, point: str, task: int, count: int, note: str) -> list[str]:
    """Wait until all ``count`` tasks reached ``point``; returns the ``note`` each left there.

    The tasks meet through files in ``staging`` rather than Spark's ``allGather``,
    whose every call waits a second in the JVM (it polls its answer once a second).
    The barrier stage has started every task, so the wait ends unless a task fails, and
    then Spark kills the others.
    """
    directory = Path(staging) / point
    directory.mkdir(exist_ok=True)
    temporary = directory / f".{task:05d}"
    temporary.write_text(note, encoding="utf-8")
    os.replace(temporary, directory / f"{task:05d}")
    names = [f"{index:05d}" for index in range(count)]
    pause = 0.0005
    while not all((directory / name).exists() for name in names):
        time.sleep(pause)
        pause = min(pause * 2, 0.002)  # (a look costs a few stat calls; a late one keeps every core waiting)
    return [(directory / name).read_text(encoding="utf-8") for name in names]


def _mark(marks: list[tuple[str, float, float]], phase: str) -> None:
    """A barrier task's timeline: when it reached ``phase`` (Unix time) and its process's CPU seconds then."""
    marks.append((phase, time.time(), time.process_time()))


#: Staged rows a barrier task keeps in memory for its third step; beyond that they go to the staging directory.
HELD_BYTES: Final = 512 * 2**20


def _deal_edges(edges: pa.Table, staging: str, task: int, count: int) -> None:
    """A barrier task's edge rows as files in ``staging``: SEND rows to the task that owns their connection.

    SEND rows (a SEND, its receipt) are nearly all of them, and only their connection's
    owner reads them (``edges-TASK-to-OWNER``); the rest (control frames, topic look-ups,
    chunks, problems, last times: a few per connection and split) every task reads
    (``edges-TASK-common``), for the topic answers of every connection.
    """
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.feather as feather

    # Each in one piece (a chunk per split made a compressed buffer per column and split: the common rows,
    # ~300 on the 100 MiB pass, took 3.7 ms to write with LZ4, 0.9 ms in one uncompressed piece).
    edges = edges.combine_chunks()
    is_send = pc.equal(edges["edge"], tb.EDGE_SEND)
    feather.write_feather(edges.filter(pc.invert(is_send)), f"{staging}/edges-{task:05d}-common.arrow",
                          compression="uncompressed")
    sends = edges.filter(is_send)
    owners = connection_owners(sends, count)
    for owner in range(count):
        feather.write_feather(sends.filter(np.equal(owners, owner)), f"{staging}/edges-{task:05d}-to-{owner:05d}.arrow",
                              compression="lz4")


def _read_edges(staging: str, names: Sequence[str]) -> pa.Table:
    import pyarrow as pa
    import pyarrow.feather as feather

    return pa.concat_tables([feather.read_table(f"{staging}/{name}.arrow") for name in names])


def barrier_task(partition: Iterator[int], splits: list[Split], staging: str, work: str, window: TimeWindow,
                 strict: bool, count: int) -> Iterator[bytes]:
    """The three steps in one task per core, all tasks started together (Spark's barrier mode).

    Step 1 over the splits this task claims (:class:`SplitClaims`), their edge rows
    dealt into files in ``staging`` (:func:`_deal_edges`); when every task is there,
    step 2 for the connections this task owns (:func:`connection_owners`), which also
    answers the topic look-ups of every other connection from its control frames (a
    few per connection: cheaper than a second meeting to exchange answers, which cost the
    tasks up to ~0.05 s of waiting for each other on the 100 MiB pass), and step 3 for the
    splits it decoded, from memory (all in one go).  Yields one pickled ``(summaries,
    figures, timeline)`` (the timeline: :func:`_mark`).  Run only where a failed task
    fails the job (:func:`_barrier_tasks`): claims and the meeting point are not made for reruns.
    """
    import numpy as np
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    marks: list[tuple[str, float, float]] = []
    _mark(marks, "start")
    _settle()
    del partition  # the task's number says what it does
    task = BarrierTaskContext.get().partitionId()
    held: list[SplitOutput] = []
    staged: list[int] = []
    edges = [tb.arrow_schema(tb.EDGE).empty_table()]
    held_bytes = 0
    summaries = []
    for split_id in SplitClaims(f"{staging}/claims", [s.end - s.start for s in splits]):
        output = decode_local_split(splits[split_id])
        summaries.append(_split_summary(output))
        edges.append(output.edges)
        size = sum(table.nbytes for table in output.staged.values())
        if held_bytes + size > HELD_BYTES:
            _stage(output, staging, edges=False)
            staged.append(split_id)
        else:
            held.append(output)
            held_bytes += size
    _deal_edges(pa.concat_tables(edges), staging, task, count)
    del edges
    _mark(marks, "decoded")
    skipped = _all_arrived(staging, "decoded", task, count, str(sum(len(summary[2]) for summary in summaries)))
    _mark(marks, "met")
    figures = Figures()
    if strict and any(int(ranges) for ranges in skipped):
        yield pickle.dumps((summaries, figures.to_bytes(), marks))  # the driver refuses the recording
        return
    common = _read_edges(staging, [f"edges-{index:05d}-common" for index in range(count)])
    mine = np.equal(connection_owners(common, count), task)
    own = pa.concat_tables([common.filter(mine),
                            _read_edges(staging, [f"edges-{index:05d}-to-{task:05d}" for index in range(count)])])
    writer = BufferedTableWriter(Path(work).parent, Path(work), f"b{task:05d}")
    answers, figures, _rows = finish_edges(own, window, writer, "", others=common.filter(np.logical_not(mine)))
    del common, own, _rows
    resolution = resolution_table(answers)
    _mark(marks, "finished")
    if held:  # the splits held in memory resolved together: a join and its set-up per table, not per split
        together = {name: pa.concat_tables([output.staged[name] for output in held]) for name in held[0].staged}
        del held
        figures.merge(resolve_staged(together, resolution, window, writer, ""))
        del together
    for split_id in staged:
        figures.merge(_resolve_staged_split(split_id, staging, resolution, window, writer))
    _mark(marks, "resolved")
    writer.flush()  # the task's rows, a file per table and partition value
    _mark(marks, "written")
    yield pickle.dumps((summaries, figures.to_bytes(), marks))


def staged_edges_task(batches: Iterator[pa.RecordBatch], staging: str) -> Iterator[pa.RecordBatch]:
    """The edge rows a split left in ``staging``, back as rows (for the shuffled second step)."""
    _settle()
    import pyarrow.feather as feather

    for batch in batches:
        for split_id in batch.column(0).to_pylist():
            yield from feather.read_table(f"{staging}/split-{split_id:05d}-edges.arrow").to_batches(65_536)


def decode_task(batches: Iterator[pa.RecordBatch], splits: list[Split], staging: str | None
                ) -> Iterator[pa.RecordBatch]:
    """Step 1 over local splits (the input rows are split ids)."""
    _settle()
    for batch in batches:
        for split_id in batch.column(0).to_pylist():
            yield from _hand_over(decode_local_split(splits[split_id]), staging)


def decode_content_task(batches: Iterator[pa.RecordBatch], splits: dict[str, Split], staging: str | None
                        ) -> Iterator[pa.RecordBatch]:
    """Step 1 over segments read by Spark's binaryFile source (whole segments)."""
    _settle()
    for batch in batches:
        paths, contents = batch.column("path"), batch.column("content")
        for index, path in enumerate(paths.to_pylist()):
            output = decode_content_split(splits[path], contents[index].as_py())
            yield from _hand_over(output, staging)


def _part() -> str:
    from pyspark import TaskContext

    context = TaskContext.get()
    return f"{context.stageId():03d}-{context.partitionId():05d}" if context is not None else "00000"


class _BlobWriter:
    """Collects what a task would write, as Arrow IPC blobs for Spark's writers."""

    def __init__(self) -> None:
        self.blobs: list[tuple[str, bytes]] = []

    def write(self, name: str, table: pa.Table, part: str) -> None:
        del part
        if table.num_rows:
            self.blobs.append((name, _ipc(table)))


def _result_batch(answers: Sequence[tuple[Any, ...]], figures: Figures, blobs: list[tuple[str, bytes]]
                  ) -> pa.RecordBatch:
    import pyarrow as pa

    rows = [(RESULT_ANSWER, *answer, None, None) for answer in answers]
    rows.append((RESULT_FIGURES, None, None, None, None, None, None, None, figures.to_bytes()))
    rows += [(RESULT_TABLE, None, None, None, None, None, None, name, data) for name, data in blobs]
    schema = tb.arrow_schema(RESULT)
    columns = list(zip(*rows, strict=True))
    return pa.RecordBatch.from_arrays([pa.array(values, type=kind) for values, kind in zip(columns, schema.types,
                                                                                             strict=True)],
                                      schema=schema)


def finish_task(batches: Iterator[pa.RecordBatch], window: TimeWindow, work: str | None, part: str | None = None
                ) -> Iterator[pa.RecordBatch]:
    """Step 2 over the edge rows of the connections hashed to this task (or of all, on the driver)."""
    import pyarrow as pa

    schema = tb.arrow_schema(tb.EDGE)
    received = list(batches)
    edges = pa.Table.from_batches(received).cast(schema) if received else schema.empty_table()
    writer: Any = TableWriter(Path(work).parent, Path(work)) if work is not None else _BlobWriter()
    answers, figures, _rows = finish_edges(edges, window, writer, f"c{part or _part()}")
    yield _result_batch(answers, figures, writer.blobs if isinstance(writer, _BlobWriter) else [])


def resolve_task(batches: Iterator[pa.RecordBatch], answers: Any, window: TimeWindow, staging: str | None,
                 work: str | None) -> Iterator[pa.RecordBatch]:
    """Step 3: staged rows (files in ``staging``, or blob rows) given topics and written."""
    _settle()
    resolution = _from_ipc(answers.value)
    writer: Any = TableWriter(Path(work).parent, Path(work)) if work is not None else _BlobWriter()
    for batch in batches:
        if staging is not None:
            for split_id in batch.column(0).to_pylist():
                yield _result_batch([], _resolve_staged_split(split_id, staging, resolution, window, writer), [])
        else:
            by_split: dict[int, dict[str, pa.Table]] = {}
            for split_id, name, data in zip(batch.column("seq").to_pylist(), batch.column("message").to_pylist(),
                                            batch.column("data").to_pylist(), strict=True):
                by_split.setdefault(split_id, {})[name] = _from_ipc(data)
            for split_id, staged in by_split.items():
                figures = resolve_staged(staged, resolution, window, writer, f"s{split_id:05d}")
                yield _result_batch([], figures, writer.blobs)
                writer.blobs = []


def unblob_task(batches: Iterator[pa.RecordBatch], name: str) -> Iterator[pa.RecordBatch]:
    """Table blobs back into rows, for Spark's writer."""
    _settle()
    schema = tb.arrow_schema(tb.TABLES[name])
    for batch in batches:
        for data in batch.column("data").to_pylist():
            yield from _from_ipc(data).select(schema.names).cast(schema).to_batches(max_chunksize=65_536)


# -- the driver -------------------------------------------------------------------------------
def _listing(spark: SparkSession, inputs: Sequence[str], split_bytes: int) -> tuple[list[Split], dict[str, Split]]:
    """Local splits (byte ranges), and URL segments by path (whole)."""
    local = [i for i in inputs if not is_url(i)]
    urls = [i for i in inputs if is_url(i)]
    splits = plan_splits(local_segments(local), split_bytes) if local else []
    remote: dict[str, Split] = {}
    if urls:
        try:
            listing = (spark.read.format("binaryFile").option("pathGlobFilter", SEGMENT_GLOB)
                       .option("recursiveFileLookup", "true").load(list(urls)).select("path", "length").collect())
        except Exception as exc:  # Py4J and Hadoop errors come in many types
            raise AnalyticsError(f"cannot list {', '.join(urls)}: {str(exc).splitlines()[0]}") from None
        for row in sorted(listing, key=lambda r: r["path"]):
            path = row["path"]
            recording, segment = path.rstrip("/").split("/")[-2:]
            remote[path] = Split(len(splits) + len(remote), recording, segment, segment_index(segment), path, 0,
                                 row["length"], row["length"])
    return splits, remote


def run_pipeline(spark: SparkSession, inputs: Sequence[str], out: str, *, window: TimeWindow | None = None,
                 strict: bool = False, progress: StageProgress | None = None,
                 split_bytes: int = DEFAULT_SPLIT_BYTES) -> AnalyzeResult:
    """Run the three steps on ``spark``; returns what was written and the report's figures."""
    import pyarrow as pa
    from pyspark.sql import functions as F  # noqa: N812 - Spark's customary alias
    from pyspark.storagelevel import StorageLevel

    window = window or TimeWindow()

    def step(label: str) -> None:
        if progress is not None:
            progress.step(label)

    step("listing segments")
    splits, remote = _listing(spark, inputs, split_bytes)
    if not splits and not remote:
        raise AnalyticsError("no segment files found in " + ", ".join(inputs))
    direct = not is_url(out)
    writer = TableWriter(Path(out)) if direct else None
    work = str(writer.work) if writer is not None else None
    staging = f"{work}/staging" if work is not None else None
    if staging is not None:
        Path(staging).mkdir(parents=True)
    result = AnalyzeResult(out, segments=len({(s.recording, s.segment) for s in splits}) + len(remote),
                           splits=len(splits) + len(remote),
                           input_bytes=sum(s.end - s.start for s in [*splits, *remote.values()]))
    edge_ddl = tb.ddl(tb.EDGE)
    # Local splits with the tables written by the tasks need no DataFrame: plain tasks, fewer costs per job.
    plain = (staging, work) if staging is not None and work is not None and not remote else None
    try:
        tasks = _barrier_tasks(spark) if plain is not None else 0
        if plain is not None and tasks:
            step("decoding frames, pairing requests per connection, writing tables")
            _run_barrier(spark, tasks, taper_splits(splits, tasks), plain[0], plain[1], window, strict, result)
            step("publishing tables")
            _publish(writer, result)
            return result
        step("decoding frames")
        summaries: list[tuple[int, int, list[Any], int]] = []
        parts = []
        groups = task_groups([split.end - split.start for split in splits], 2 * spark.sparkContext.defaultParallelism)
        if plain is not None:
            summaries = spark.sparkContext.parallelize(groups, len(groups)).mapPartitions(
                functools.partial(decode_plain_task, splits=splits, staging=plain[0])).collect()
        elif splits:
            ids = spark.range(len(splits), numPartitions=len(splits))
            parts.append(ids.mapInArrow(functools.partial(decode_task, splits=splits, staging=staging), edge_ddl))
        if remote:
            content = (spark.read.format("binaryFile").option("pathGlobFilter", SEGMENT_GLOB)
                       .option("recursiveFileLookup", "true").load([s.location for s in remote.values()]))
            parts.append(content.select("path", "content").mapInArrow(
                functools.partial(decode_content_task, splits=remote, staging=staging), edge_ddl))
        if parts:
            edges = functools.reduce(lambda a, b: a.unionByName(b), parts)
            if staging is None:  # the edge rows (and staged blobs) are read again below: keep them
                edges = edges.persist(StorageLevel.MEMORY_AND_DISK)
            summaries = [pickle.loads(row["data"]) for row in
                         edges.filter(F.col("edge") == EDGE_SPLIT).select("data").collect()]
        edge_rows = 0
        for summary in summaries:
            edge_rows += _add_summary(result, summary)
        if strict and result.figures.skipped:
            raise RecordingError(result.figures.skipped[0] + " (--strict)")

        step("pairing requests per connection")
        count = len(splits) + len(remote)
        if staging is not None:
            connection_rows = spark.range(count, numPartitions=count).mapInArrow(
                functools.partial(staged_edges_task, staging=staging), edge_ddl)
        else:
            connection_rows = edges.filter(F.col("edge") < EDGE_SPLIT)
        if edge_rows <= DRIVER_EDGE_ROWS:
            # Few enough to finish here: a shuffle's stages would cost more than the work.
            if staging is not None:
                import pyarrow.feather as feather

                local = pa.concat_tables([feather.read_table(f"{staging}/split-{i:05d}-edges.arrow")
                                          for i in range(count)])
            else:
                local = connection_rows.toArrow()
            finished_rows = pa.Table.from_batches(list(finish_task(iter(local.to_batches()), window, work,
                                                                   part="driver")))
        else:
            partitions = max(2, 2 * spark.sparkContext.defaultParallelism)
            finished_rows = (connection_rows.repartition(partitions, "recording", "conn_id")
                             .mapInArrow(functools.partial(finish_task, window=window, work=work), tb.ddl(RESULT))
                             .toArrow())
        answers = finished_rows.filter(_of_kind(finished_rows, RESULT_ANSWER)).select(tb.names(tb.RESOLUTION))
        table_blobs = [_collected(finished_rows)]
        for data in finished_rows.filter(_of_kind(finished_rows, RESULT_FIGURES))["data"].to_pylist():
            result.figures.merge(Figures.from_bytes(data))

        step("writing tables")
        broadcast = spark.sparkContext.broadcast(_ipc(answers))
        if plain is not None:
            figures = spark.sparkContext.parallelize(groups, len(groups)).mapPartitions(functools.partial(
                resolve_plain_task, answers=broadcast, window=window, staging=plain[0], work=plain[1])).collect()
        else:
            resolve = functools.partial(resolve_task, answers=broadcast, window=window, staging=staging, work=work)
            if staging is not None:  # every split, local or read by URL, left its rows in staging
                resolved = spark.range(count, numPartitions=count).mapInArrow(resolve, tb.ddl(RESULT))
            else:
                resolved = edges.filter(F.col("edge") == EDGE_STAGED).select("seq", "message", "data").mapInArrow(
                    resolve, tb.ddl(RESULT))
            resolved_rows = resolved.toArrow()
            table_blobs.append(_collected(resolved_rows))
            figures = resolved_rows.filter(_of_kind(resolved_rows, RESULT_FIGURES))["data"].to_pylist()
        for data in figures:
            result.figures.merge(Figures.from_bytes(data))
        if staging is None:
            edges.unpersist()
        step("publishing tables")
        if writer is not None:
            _publish(writer, result)
        else:
            result.written = _write_with_spark(spark, out, table_blobs, _throughput(result))
    finally:
        if writer is not None:
            writer.discard()
    return result


def _barrier_tasks(spark: SparkSession) -> int:
    """How many tasks the one-job plan runs (one per core), or 0 where it does not apply.

    It applies to local masters that do not retry failed tasks (``local``, ``local[N]``,
    ``local[*]``; not ``local[N,F]`` with F > 1): there a task that fails fails the job.
    Where Spark reruns a failed task, or the whole stage of a barrier task (clusters),
    a rerun would find the splits claimed and the meeting points passed by the attempt
    that failed: there the steps run as jobs of their own.
    """
    context = spark.sparkContext
    known = _BARRIER_TASKS.get(context)
    if known is not None:
        return known
    match = re.fullmatch(r"local(?:\[(\d+|\*)(?:,(\d+))?\])?", context.master or "")
    if match is None or int(match.group(2) or 1) > 1:
        tasks = 0
    else:
        conf = context.getConf()
        tasks = max(1, context.defaultParallelism // max(1, int(conf.get("spark.task.cpus", "1") or 1)))
    _BARRIER_TASKS[context] = tasks
    return tasks


#: :func:`_barrier_tasks` per SparkContext: its master and settings do not change, and asking the JVM for them
#: (a copy of the whole configuration) took 10-30 ms of a 1-1.5 s pass.
_BARRIER_TASKS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _run_barrier(spark: SparkSession, tasks: int, splits: list[Split], staging: str, work: str, window: TimeWindow,
                 strict: bool, result: AnalyzeResult) -> None:
    """The three steps as one Spark job of ``tasks`` barrier tasks (:func:`barrier_task`)."""
    task = functools.partial(barrier_task, splits=splits, staging=staging, work=work, window=window, strict=strict,
                             count=tasks)
    submitted = time.time()
    for data in spark.sparkContext.parallelize(range(tasks), tasks).barrier().mapPartitions(task).collect():
        summaries, figures, marks = pickle.loads(data)
        result.timeline.append([(phase, moment - submitted, cpu - marks[0][2]) for phase, moment, cpu in marks])
        for summary in summaries:
            _add_summary(result, summary)
        result.figures.merge(Figures.from_bytes(figures))
    result.timings["job"] = time.time() - submitted
    if strict and result.figures.skipped:
        raise RecordingError(result.figures.skipped[0] + " (--strict)")


def _add_summary(result: AnalyzeResult, summary: tuple[int, int, list[Any], int]) -> int:
    """A split's summary into ``result``; returns its count of edge rows."""
    _split_id, frames, skipped, edge_rows = summary
    result.frames_read += frames
    result.figures.skipped += [r.describe() for r in skipped]
    return edge_rows


def _throughput(result: AnalyzeResult) -> pa.Table:
    throughput = result.figures.throughput if result.figures.throughput is not None else merge_throughput([])
    result.figures.counts["throughput"] = throughput.num_rows
    return throughput


def _publish(writer: TableWriter | None, result: AnalyzeResult) -> None:
    """The throughput table written, then every table moved into place."""
    assert writer is not None
    writer.write("throughput", _throughput(result), "t00000")
    result.written = writer.publish(ALL_TABLES)


def _of_kind(table: pa.Table, kind: int) -> Any:
    import pyarrow.compute as pc

    return pc.equal(table["kind"], kind)


def _collected(rows: pa.Table) -> list[tuple[str, bytes]]:
    blobs = rows.filter(_of_kind(rows, RESULT_TABLE))
    return list(zip(blobs["name"].to_pylist(), blobs["data"].to_pylist(), strict=True))


def _write_with_spark(spark: SparkSession, out: str, blob_groups: list[list[tuple[str, bytes]]],
                      throughput: pa.Table) -> list[str]:
    """Write the tables to a Hadoop URL with Spark's writers; returns the tables written."""
    blobs = [blob for group in blob_groups for blob in group]
    written = []
    for name in ALL_TABLES:
        if name == "throughput":
            frame = spark.createDataFrame(throughput.to_pandas(), schema=tb.ddl(tb.TABLES[name]))
        else:
            mine = [(name, data) for table, data in blobs if table == name]
            source = spark.createDataFrame(mine or [(name, b"")], "name string, data binary")
            if not mine:
                source = source.limit(0)
            frame = source.mapInArrow(functools.partial(unblob_task, name=name), tb.ddl(tb.TABLES[name]))
        writer = frame.write.mode("overwrite")
        if tb.PARTITIONING[name]:
            writer = writer.partitionBy(*tb.PARTITIONING[name])
        try:
            writer.parquet(f"{out.rstrip('/')}/{name}")
        except Exception as exc:  # Py4J and Hadoop errors come in many types
            raise AnalyticsError(f"cannot write {out.rstrip('/')}/{name}: {str(exc).splitlines()[0]}") from None
        written.append(name)
    return written


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


__all__ = ["AnalyzeResult", "SplitClaims", "barrier_task", "connection_owners", "decode_content_task",
           "decode_plain_task", "decode_task", "finish_task", "parse_time", "resolve_plain_task", "resolve_task",
           "run_pipeline", "task_groups", "unblob_task"]
