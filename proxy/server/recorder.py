"""The Trio recorder: the proxy's observer that writes frames into a recording directory.

The proxy calls :meth:`Recorder.record` for every frame it looks at (and again for
every frame it changed or originated, with origin ``proxy``),
:meth:`Recorder.record_run` for each stretch of bytes it passed through unchanged
(cut into frames by the writer process), and
:meth:`Recorder.open_connection` / :meth:`Recorder.close_connection` around each
client connection.  None of these await or touch the disk: they put an item on a
bounded queue and return; a run's bytes are copied into the recording's run ring
(:mod:`proxy.recording.run_ring`, shared memory of ``queue_bytes``), which the writer
process reads them from, so that only their place goes through the queue and the pipe.
When the queue (``queue_size`` frames and runs) or the ring is full the frame (or
run) is dropped and counted (per connection and in total, reported in the index and
in :attr:`Recorder.stats` for /metrics), so a slow disk never stalls traffic.  A
connection's opening and closing records are always queued (two small records per
connection, outside ``queue_size``): a close refused by a full queue had left the
connection's frames begun in the writer uncounted until the recording's end.

One writer task drains the queue in batches (gathering for up to 100 ms after a
batch's first record, so that frames trickling in cost one hand-off per batch rather
than one each) and hands each batch, from a worker thread, to the recording's writer
process (:mod:`proxy.recording.writer_process`), which encodes and appends it
(:meth:`~proxy.recording.writer.SegmentWriter.write`: cutting, redaction, payload
stripping, segment rotation are all there, with no trio) on its own interpreter, so
that none of it holds the interpreter lock the relays need; the ring's space is
released once it has.  A backlog that spreads past the ring's first pages has a worker thread populate the
pages ahead of the newest run (``RunRing.populate_ahead``), so that the relay's copies do not fault them
in.  Once a second the segment is fsynced and the index rewritten
(and an idle ring trimmed).  On exit the queue is drained and the index is
finished with ``end_ns``.

Accounting: every frame the proxy passed is either recorded or counted as dropped,
once.  A dropped run counts the frames that begin in it (as the relay's scanner counted them where it
did, ``RunEvent.frames``: no second walk of the run on the relay's path); the writer counts a frame
begun in a run it wrote and never finished (cut by a dropped run, or by the end of
its connection or of the recording).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final

import structlog
import trio

from proxy.core.run_cutter import count_frame_starts
from proxy.errors import RecordingError
from proxy.recording.run_ring import RunRing
from proxy.recording.writer import (
    Address,
    FrameItem,
    QueueItem,
    RecordConfig,
    RecorderStats,
    RecordingBook,
    RunItem,
    frame_item,
    run_item,
    write_index,
)
from proxy.recording.writer_process import WriterProcess

#: records taken off the queue per write (bounds the memory of one batch)
_BATCH_LIMIT: Final = 2_000
#: bytes of runs per write at most (a run is whole, so a batch may end up to one run past it): a write
#: costs the writer process CPU in proportion, and it pauses after a write only (see writer_process.CpuBudget):
#: a batch of the whole ring took it ~1 s and let it past its share of a core
_BATCH_BYTES: Final = 8 * 1024 * 1024
#: how long the writer keeps gathering after a batch's first record before handing it to the
#: writer process: each hand-off costs wake-ups of a thread, the child and the Trio loop, which
#: cost the proxy far more than encoding the frames did when every frame went on its own.  A batch
#: costs ~4 turns of the Trio loop (the first record, the window's end, the worker thread's return),
#: each one interrupting the reactor's wait in Trio's place: at 20 ms the official client's 150 000
#: messages (bench/replay.py) made ~480 write-loop steps and ~640 turns of the loop (50 with recording
#: off), at 100 ms ~100 and ~170, the write loop's CPU ~0.03 s -> ~0.01 s.  A full batch (records or
#: bytes) is written at once, so a saturated proxy never waits for the window, nor does a run ring half
#: full (``Recorder._hurry``); the data still reaches disk well within the second SPEC.md allows
_GATHER_SECONDS: Final = 0.1

log = structlog.get_logger("pulsar_tap.recording")


async def _gather(receive: trio.MemoryReceiveChannel[QueueItem], batch: list[QueueItem], deadline: float,
                  took: Callable[[QueueItem], None], hurry: trio.Event | None = None) -> bool:
    """Add the records waiting in the queue to ``batch`` until it is full (in records, or in the bytes of
    runs), then once more those that came by ``deadline`` (or by ``hurry``: the run ring is filling up),
    calling ``took`` with each; True at end of channel.

    The queue is read at these two moments, not as records come: a wake-up of this task per
    record was a turn of the Trio loop per relayed read (and, with the reactor waiting in Trio's
    place, a wake-up of its wait), which a client below saturation paid per message.
    """
    run_bytes = sum(len(item.data) for item in batch if type(item) is RunItem)
    for last_look in (False, True):
        while len(batch) < _BATCH_LIMIT and run_bytes < _BATCH_BYTES:
            try:
                item = receive.receive_nowait()
            except trio.WouldBlock:
                break
            except trio.EndOfChannel:
                return True
            took(item)
            batch.append(item)
            if type(item) is RunItem:
                run_bytes += len(item.data)
        else:
            return False  # full
        if last_look:
            break
        if hurry is None:
            await trio.sleep_until(deadline)
        else:
            with trio.move_on_at(deadline):
                await hurry.wait()
    return False


class Recorder:
    """Records frames into ``config.dir/<start>-<pid>/``; use as ``async with Recorder(cfg) as rec``.

    ``record``, ``open_connection`` and ``close_connection`` never block and never
    raise for a full queue; they are safe to call from any task of the proxy.
    """

    def __init__(self, config: RecordConfig, *, clock: Callable[[], int] = time.time_ns,
                 pid: int | None = None) -> None:
        self.config = config
        self.book = RecordingBook(config, clock=clock, pid=pid)
        self._send: trio.MemorySendChannel[QueueItem] | None = None
        self._writer: WriterProcess | None = None
        self._ring: RunRing | None = None
        #: frames and runs in the queue (connection records are not counted: they are always queued)
        self._waiting = 0
        #: the bytes of the runs in the queue, and how many end the write loop's gathering window early
        #: (half the run ring: a window of runs must not fill it)
        self._waiting_bytes = 0
        self._hurry_bytes = max(config.queue_bytes // 2, 1)
        #: set while the write loop gathers a batch (see _gather)
        self._hurry: trio.Event | None = None
        #: set when the newest run in the ring comes near the pages written so far (see _populate_loop); None
        #: when the system cannot populate pages
        self._populate: trio.Event | None = trio.Event()
        self._populate_scope = trio.CancelScope()
        #: why recording stopped early (the writer process failed); the proxy goes on, frames are dropped
        self.failure: str | None = None
        self._stack = contextlib.AsyncExitStack()

    @property
    def stats(self) -> RecorderStats:
        """Counters for /metrics."""
        return self.book.stats

    @property
    def path(self) -> Path:
        """The recording directory (set on entry)."""
        return self.book.path

    @property
    def start_ns(self) -> int:
        return self.book.start_ns

    # -- the observer API (non-blocking) ---------------------------------------------------

    def record(self, conn_id: int, direction: str | enum.Enum, origin: str | enum.Enum, ts_ns: int,
               raw: bytes, rules: Sequence[str] = ()) -> bool:
        """Queue one frame's exact bytes; False when it was dropped (queue full or closed)."""
        if not self._offer_data(frame_item(conn_id, direction, origin, ts_ns, raw, rules)):
            self.book.dropped(conn_id, 1)
            return False
        return True

    def record_run(self, conn_id: int, direction: str | enum.Enum, ts_ns: int, data: bytes | memoryview, lead: int,
                   stream_pos: int, frames: int = -1) -> bool:
        """Queue bytes the proxy passed through unchanged, received at ``ts_ns`` (see ``hooks.RunEvent``).

        They are copied into the run ring (``data`` may be a view of a buffer the relay
        reuses) and cut into frame records by the writer: the first ``lead`` bytes finish a
        frame begun in an earlier run, and a frame cut at the end continues in the next
        run of the same direction.  ``stream_pos`` (the offset of ``data`` in the
        direction's stream) shows the writer when a run in between was dropped.  False
        when it was dropped (ring or queue full, or closed); the frames that begin in it are counted:
        ``frames`` of them when the relay's scanner counted them (``RunEvent.frames``), else counted
        here from ``data`` (``count_frame_starts``: a look at every frame's size, on the relay's path,
        for every run a saturated proxy drops).
        """
        ring = self._ring
        if not data:
            return True
        # the queue's room first: a run it refuses is never copied (at saturation most runs are refused)
        offset = ring.put(data) if ring is not None and self._send is not None \
            and self._waiting < self.config.queue_size else None
        if offset is None:
            return self._run_dropped(conn_id, data, lead, frames)
        assert ring is not None
        if offset + len(data) > ring.populate_at and self._populate is not None:
            self._populate.set()
        if not self._offer_data(run_item(conn_id, direction, ts_ns, ring.view[offset:offset + len(data)], lead,
                                         stream_pos, offset)):
            ring.take_back()  # (the queue is closed)
            return self._run_dropped(conn_id, data, lead, frames)
        self._waiting_bytes += len(data)
        if self._waiting_bytes >= self._hurry_bytes and self._hurry is not None:
            self._hurry.set()
        return True

    def _run_dropped(self, conn_id: int, data: bytes | memoryview, lead: int, frames: int) -> bool:
        """Count the frames that begin in a run not recorded (see :meth:`record_run`); False."""
        self.book.dropped(conn_id, frames if frames >= 0 else count_frame_starts(data, lead))
        return False

    def open_connection(self, conn_id: int, client_addr: Address, broker_addr: Address,
                        lookup_mode: str | enum.Enum | None, ts_ns: int) -> None:
        """A client connection was accepted (and its upstream chosen)."""
        self._offer(self.book.opened(conn_id, client_addr, broker_addr, lookup_mode, ts_ns))

    def close_connection(self, conn_id: int, ts_ns: int) -> None:
        """A client connection ended (either side)."""
        self._offer(self.book.closed_connection(conn_id, ts_ns))

    def _offer_data(self, item: QueueItem) -> bool:
        """Queue a frame or a run if the queue has room for it (``queue_size``)."""
        if self._waiting >= self.config.queue_size or not self._offer(item):
            return False
        self._waiting += 1
        return True

    def _offer(self, item: QueueItem) -> bool:
        if self._send is None:
            return False
        try:
            self._send.send_nowait(item)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    def _took(self, item: QueueItem) -> None:
        """The write loop took ``item`` off the queue: a frame's or a run's room is free again."""
        if type(item) is RunItem:
            self._waiting -= 1
            self._waiting_bytes -= len(item.data)
        elif type(item) is FrameItem:
            self._waiting -= 1

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Recorder:
        await trio.to_thread.run_sync(self.book.create)
        # counting a dropped run's frames uses numpy: imported now, not on the relay's path at the first drop
        # (that stalled traffic for ~0.1 s)
        await trio.to_thread.run_sync(importlib.import_module, "numpy")
        try:
            self._ring = ring = RunRing.create(self.config.queue_bytes)
            await trio.to_thread.run_sync(ring.prefault)
        except OSError as exc:
            raise RecordingError(f"cannot set up the recording's run ring: {exc.strerror or exc}") from None
        try:
            # started from this thread: the writer process dies with it
            self._writer = writer = WriterProcess(self.book.path, self.config, ring)
        finally:
            ring.close_fd()  # the child has its own descriptor now
        try:
            await trio.to_thread.run_sync(writer.started)
        except BaseException:
            await trio.to_thread.run_sync(writer.stop)
            ring.close()
            raise
        # Overflow policy: a full queue drops the frame and counts it (see record()); its bound is kept by
        # _offer_data, so that a connection's records always find room
        send, receive = trio.open_memory_channel[QueueItem](math.inf)
        self._send = send
        nursery = await self._stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(self._write_loop, receive)
        nursery.start_soon(self._populate_loop, ring)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        send, self._send = self._send, None
        if send is not None:
            await send.aclose()
        try:
            return await self._stack.__aexit__(exc_type, exc, tb)
        finally:
            if self._ring is not None:
                self._ring.close()

    async def _write_loop(self, receive: trio.MemoryReceiveChannel[QueueItem]) -> None:
        book, writer = self.book, self._writer
        assert writer is not None
        batch: list[QueueItem] = []
        try:
            async with receive:
                next_sync = trio.current_time() + self.config.flush_interval
                done = False
                while not done:
                    with trio.move_on_at(next_sync):
                        try:
                            item = await receive.receive()
                            self._took(item)
                            batch.append(item)
                        except trio.EndOfChannel:
                            done = True
                    if batch and not done:
                        self._hurry = hurry = trio.Event()
                        if self._waiting_bytes >= self._hurry_bytes:
                            hurry.set()
                        try:
                            done = await _gather(receive, batch,
                                                 min(trio.current_time() + _GATHER_SECONDS, next_sync), self._took,
                                                 hurry)
                        finally:
                            self._hurry = None
                    if batch:
                        # taken out first: a batch whose write failed is not written again on exit
                        pending, batch = batch, []
                        await self._write_batch(pending)
                    if trio.current_time() >= next_sync:
                        assert self._ring is not None
                        self._ring.tick()
                        await self._sync(writer.sync, book.changed_index())
                        next_sync = trio.current_time() + self.config.flush_interval
        finally:
            # Data must be complete on exit, even when the recorder is cancelled.
            with trio.CancelScope(shield=True):
                if batch:
                    await self._write_batch(batch)
                if self.failure is None:
                    await self._end_streams()
                if self.failure is not None:
                    await trio.to_thread.run_sync(writer.stop)
                await self._sync(writer.close, book.finished_index())
                self._populate_scope.cancel()

    async def _populate_loop(self, ring: RunRing) -> None:
        """Have a worker thread write the run ring's next pages ahead of the newest run whenever it comes near
        them (see run_ring): the relay's copies then land in pages already there, instead of faulting each
        in on the relay's thread.  Until the write loop ends."""
        with self._populate_scope:
            while self._populate is not None:
                await self._populate.wait()
                self._populate = trio.Event()
                start = ring.ready_to
                if start >= ring.size:
                    continue
                ring.populating = True
                try:
                    reached = await trio.to_thread.run_sync(ring.populate_ahead, start)
                finally:
                    ring.populating = False
                if reached < 0:
                    self._populate = None  # the system cannot (the copies fault the pages in, as before)
                    return
                ring.populated(reached)

    async def _write_batch(self, batch: list[QueueItem]) -> None:
        assert self._writer is not None and self._ring is not None
        try:
            if self.failure is None:
                try:
                    self.book.account(await trio.to_thread.run_sync(self._writer.write, batch))
                    return
                except RecordingError as exc:
                    self._failed(exc)
            self.book.lost(batch)
        finally:
            # written or given up: the ring's space goes back (its runs are the oldest in it, in order)
            self._ring.release(sum(1 for item in batch if type(item) is RunItem and item.ring_offset >= 0))

    async def _end_streams(self) -> None:
        """Count the frames the writer still holds begun and unfinished (a connection's close that the full
        queue refused leaves them there): every frame is recorded or counted by the time the index is final."""
        assert self._writer is not None
        try:
            self.book.account(await trio.to_thread.run_sync(self._writer.end_streams))
        except RecordingError as exc:
            self._failed(exc)

    async def _sync(self, call: Callable[[bytes | None], None], index: bytes | None) -> None:
        """Have the writer fsync and write ``index``; once it has failed, write the index here."""
        if self.failure is None:
            try:
                await trio.to_thread.run_sync(call, index)
                return
            except RecordingError as exc:
                self._failed(exc)
                index = self.book.index_bytes()
        if index is not None:
            await trio.to_thread.run_sync(write_index, self.book.path, index)

    def _failed(self, exc: RecordingError) -> None:
        # Traffic wins: the proxy goes on, and what it would have recorded is counted as dropped.
        self.failure = str(exc)
        log.error("recording stopped", path=str(self.book.path), error=self.failure)


__all__ = ["Recorder"]
