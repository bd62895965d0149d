"""The run ring: shared memory the recorder copies passed-through bytes into, once.

The proxy's recorder (:class:`proxy.server.recorder.Recorder`) gets each run of bytes the
relay passed through unchanged as a view of the relay's receive buffer, which is reused
as soon as the relay goes on: it has to copy them.  It copies them here, into memory it
shares with the recording's writer process (:mod:`proxy.recording.writer_process`), so
that only a run's place (offset and length) crosses the pipe and the child encodes and
writes the bytes where they lie (the pipe used to cost two more copies).

Runs take contiguous space in order; the space of the oldest runs is released once the
writer process has written them (or, for a run the recorder's queue refused, at once).
When a run does not fit, :meth:`RunRing.put` says so and the recorder drops it (and
counts its frames), as it did when its queue held too many bytes.

Writing to a page of shared memory for the first time costs a page fault: copying every
run into fresh pages took a tenth of the relay's time.  So past its first ``REUSE_FROM``
bytes the ring goes back to its start whenever those are all free: while the writer
keeps up, runs reuse the same few MiB, and the rest of the ring fills only when a
backlog builds up.  Those first MiB are written once when the ring is made
(:meth:`RunRing.prefault`, before traffic); pages stay allocated once written, so the
recorder gives back the pages past them (:meth:`RunRing.tick`) once no run has lain past
them for a while, although runs may still come and go in the first MiB (traffic that
trickles on after a burst): a burst does not leave the proxy holding the ring's size for good.
That while is a tick (about a second) after a lone burst; a burst that comes back into the pages
given back (past ``REUSE_FROM``) less than ``TRIM_AFTER_MOST`` quiet ticks after the one before has the
next trim wait twice that gap (up to ``TRIM_AFTER_MOST``), and one that comes later has it wait a tick
again: pages given back cost a fault each when the next burst writes them again (~3-4 us a page here,
on the relay's thread or the populating worker's; ~0.1 s of CPU for a ring of 128 MiB), which
saturating bursts a few seconds apart (the recording arm's phases in ``bench/passthrough.py
--observers``) paid at each burst.
A backlog that does build up (a saturated proxy: the writer process, niced and held to a share of
a core, falls behind at once and the ring fills) would fault in every page past the first MiB under
the relay's copies (~5 us a page here: ~0.14 s of the relay's time to fill a 128 MiB ring after each
quiet spell).  Instead, once a run lies past the first MiB, the recorder has a worker thread allocate
and map the pages ahead of the newest run, up to ``POPULATE_AHEAD`` past it
(:meth:`RunRing.populate_ahead`: ``fallocate`` and ``MADV_POPULATE_WRITE``, without the interpreter
lock), so that the copies land in pages already there; the pages it populated count as written, and
a trim gives them back as it does the rest.
The memory is a ``memfd`` (an unlinked temporary file where there is none): it has no name,
and goes away when both processes have let go of it, whichever way they end.

A ring no other process maps (:meth:`RunRing.private`: the observer hub's, whose runs are read in the
proxy) is anonymous memory of the proxy's own, in transparent huge pages where the system gives them
(``MADV_HUGEPAGE``): a first write faults in 2 MiB at once, ~5 ms of faults to fill 64 MiB against ~70 ms
in pages of 4 KiB (``memfd`` memory, shared, gets no huge pages here); a trim gives its pages back with
``MADV_DONTNEED``.  It is never populated ahead (its faults are few).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import tempfile
from collections import deque
from collections.abc import Callable
from typing import Final, cast

#: the ring goes back to its start past this many bytes when they are all free (see above)
REUSE_FROM: Final = 16 * 1024 * 1024
#: pages past ``REUSE_FROM`` are populated ahead of the newest run this many bytes at a time (see above): a
#: worker thread takes ~3-8 ms for 4 MiB (``fallocate`` and ``MADV_POPULATE_WRITE``), which the relay fills in
#: 5-15 ms at saturation, faulting each page itself in ~20 ms
POPULATE_BYTES: Final = 4 * 1024 * 1024
#: how far ahead of the newest run they are populated (see populate_ahead); the worker thread is woken when the
#: newest run comes within half of it of the pages populated
POPULATE_AHEAD: Final = 24 * 1024 * 1024
#: the most ticks in a row with no run put past ``REUSE_FROM`` that a trim waits for, and the longest gap between
#: bursts that makes it wait longer than one (see above and ``tick``)
TRIM_AFTER_MOST: Final = 16
#: ``madvise``'s advice to fault pages in writable without writing them (Linux 5.14; not in Python 3.11's mmap)
_MADV_POPULATE_WRITE: Final = 23


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes (which lets go of the interpreter lock while it runs); None without."""
    with contextlib.suppress(OSError, AttributeError):
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        return cast(Callable[[int, int, int], int], madvise)
    return None


def _shared_file(size: int) -> int:
    """A file descriptor of ``size`` bytes of memory nothing else can open (the child maps it)."""
    fd: int | None = None
    create = getattr(os, "memfd_create", None)
    if create is not None:
        with contextlib.suppress(OSError):  # (a sandbox may refuse it)
            fd = create("pulsar-tap-runs")  # close-on-exec: only the writer process gets it (pass_fds)
    if fd is None:
        with tempfile.TemporaryFile() as file:
            fd = os.dup(file.fileno())
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


class RunRing:
    """Shared memory of ``size`` bytes holding runs in order; see the module docstring.

    The proxy creates it (:meth:`create`), hands :attr:`fd` to the writer process (which
    maps it with :func:`attach`), then :meth:`close_fd`.  Used from one thread (the recorder's).
    """

    def __init__(self, fd: int | None, size: int) -> None:
        self.fd: int | None = fd
        self.size = size
        if fd is None:  # (private: see the module docstring)
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            with contextlib.suppress(OSError, AttributeError):  # (no huge pages: pages of 4 KiB, as shared)
                self._map.madvise(mmap.MADV_HUGEPAGE)
        else:
            self._map = mmap.mmap(fd, size)
        self.view = memoryview(self._map)
        self.reuse_from = min(REUSE_FROM, size)
        #: the (start, end) of every run in the ring, oldest first
        self._runs: deque[tuple[int, int]] = deque()
        #: the most of the ring written since it was last trimmed
        self._written_to = 0
        #: runs in the ring that end past ``reuse_from`` (pages a trim would take)
        self._high_runs = 0
        #: runs put in so far that ended past ``reuse_from``, and as of the previous tick
        self._high_puts = self._high_puts_at_tick = 0
        #: ticks in a row that saw no run put past ``reuse_from``, and how many a trim waits for (see ``tick``)
        self._quiet_ticks = 0
        self.trim_after = 1
        #: whether a trim gave pages back since a run last went past ``reuse_from``
        self._trimmed = False
        #: the ring's pages are written (or were populated) up to here: past it, copies fault
        self.ready_to = 0
        #: the end of the newest run put in
        self._head = 0
        #: a run ending past this wants the next pages populated (see populate_ahead)
        self.populate_at = size + 1
        #: set while a worker thread populates pages (a trim waits for the next tick)
        self.populating = False
        self._address = self._address_of(self._map)
        #: the memory's own descriptor (``fd`` goes once the writer process has it): populate allocates through it
        #: (-1: private memory, see the module docstring)
        self._own_fd = os.dup(fd) if fd is not None else -1

    @classmethod
    def create(cls, size: int) -> RunRing:
        fd = _shared_file(size)
        try:
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def private(cls, size: int) -> RunRing:
        """A ring of the proxy's memory alone, which no writer process maps (see the module docstring)."""
        return cls(None, size)

    @staticmethod
    def _address_of(memory: mmap.mmap) -> int | None:
        """Where ``memory`` is mapped (for ``madvise`` through ctypes); None where it cannot be had."""
        with contextlib.suppress(TypeError, ValueError, BufferError):
            pointer = ctypes.c_char.from_buffer(memory)
            try:
                return ctypes.addressof(pointer)
            finally:
                del pointer  # (its export of the map would keep the map from closing)
        return None

    def prefault(self) -> None:
        """Write the pages of the first ``reuse_from`` bytes (blocking; before traffic: no fault then)."""
        zeros = bytes(1 << 20)
        for start in range(0, self.reuse_from, len(zeros)):
            stop = min(start + len(zeros), self.reuse_from)
            self.view[start:stop] = zeros[:stop - start]
        self._set_ready_to(self.reuse_from)

    def _set_ready_to(self, offset: int) -> None:
        self.ready_to = offset
        # (past the first pages only, which prefault wrote: a run there is the sign of a backlog building)
        self.populate_at = max(offset - POPULATE_AHEAD // 2, self.reuse_from) \
            if self.reuse_from <= offset < self.size else self.size + 1

    def populate_ahead(self, start: int) -> int:
        """Allocate the memory from ``start`` on and map its pages writable without writing them, a
        ``POPULATE_BYTES`` at a time, until ``POPULATE_AHEAD`` past the newest run (blocking, for a worker
        thread: the interpreter lock is let go of while the system works); past pages the copies reached
        meanwhile.  Where it got to; -1 where the system cannot allocate ahead (the copies fault the pages in,
        as before).  Call it with ``populating`` set, then :meth:`populated`.

        Allocating (``fallocate``, ~2 us a page) is most of what a first write's fault costs; mapping the
        pages (``MADV_POPULATE_WRITE``, Linux 5.14) the rest, where the system can.
        """
        madvise = _libc_madvise()
        if self._own_fd < 0:
            return -1  # (private memory has no file to allocate in)
        while True:
            head = self._head  # (the relay's, read as it goes)
            if head > start and head < self.size:  # the copies overtook: what lies behind them is written
                start = head
            start -= start % mmap.PAGESIZE  # (madvise takes whole pages; populating pages written is harmless)
            if start >= self.size or start >= head + POPULATE_AHEAD:
                break
            stop = min(start + POPULATE_BYTES, self.size)
            try:
                os.posix_fallocate(self._own_fd, start, stop - start)
            except OSError:
                return -1
            if self._address is not None and madvise is not None:
                madvise(self._address + start, stop - start, _MADV_POPULATE_WRITE)  # (where it fails: faults map)
            start = stop
        return start

    def populated(self, stop: int) -> None:
        """A worker thread populated the pages up to ``stop`` (:meth:`populate_ahead`)."""
        if stop > self._written_to:
            self._written_to = stop
        self._set_ready_to(max(stop, self.ready_to))  # (the copies may have gone past it meanwhile)

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays): once the writer process has mapped it."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def runs(self) -> int:
        """Runs in the ring, not yet released."""
        return len(self._runs)

    def put(self, data: bytes | memoryview) -> int | None:
        """Copy ``data`` (not empty) in after the newest run; its offset, or None when there is no room."""
        size, runs = len(data), self._runs
        if not 0 < size <= self.size:
            return None
        if not runs:
            start = 0
        else:
            head, tail = runs[-1][1], runs[0][0]
            if runs[-1][0] >= tail:  # not wrapped: free after the head, and before the tail
                if head + size <= self.size and not (head >= self.reuse_from and tail >= max(size, self.reuse_from)):
                    start = head
                elif size <= tail:
                    start = 0
                else:
                    return None
            elif head + size <= tail:
                start = head
            else:
                return None
        end = self._head = start + size
        self.view[start:end] = data
        runs.append((start, end))
        if end > self._written_to:
            self._written_to = end
            if end > self.ready_to and self.ready_to >= self.reuse_from:
                self._set_ready_to(end)  # (it faulted them in itself)
        if end > self.reuse_from:
            self._high_runs += 1
            self._high_puts += 1
        return start

    def tick(self) -> None:
        """Call it every second or so: trims the ring when no run lies past ``reuse_from`` and none went
        there in the last ``trim_after`` ticks (runs may come and go before it meanwhile).  Runs back past
        ``reuse_from`` after a trim set ``trim_after`` to twice the quiet ticks before them, or to one when
        those were ``TRIM_AFTER_MOST`` or more."""
        if self._high_puts != self._high_puts_at_tick:
            self._high_puts_at_tick = self._high_puts
            if self._trimmed:
                gap = self._quiet_ticks
                self.trim_after = min(2 * gap, TRIM_AFTER_MOST) if gap < TRIM_AFTER_MOST else 1
                self._trimmed = False
            self._quiet_ticks = 0
            return
        self._quiet_ticks += 1
        if self._quiet_ticks >= self.trim_after and self.trim():
            self._trimmed = True

    def trim(self) -> bool:
        """Give the ring's pages past ``reuse_from`` back to the system when no run lies there (written
        again, they come back as zeros); whether it did."""
        # (Linux; shared memory's pages go back only when removed from its file)
        remove = getattr(mmap, "MADV_REMOVE" if self._own_fd >= 0 else "MADV_DONTNEED", None)
        if self._high_runs or self._written_to <= self.reuse_from or remove is None or self.populating:
            return False
        with contextlib.suppress(OSError):
            # (whole pages: reuse_from is a multiple of the page size unless it is the whole ring)
            self._map.madvise(remove, self.reuse_from, self.size - self.reuse_from)
        self._written_to = self.reuse_from
        if self.ready_to > self.reuse_from:
            self._set_ready_to(self.reuse_from)
        return True

    def take_back(self) -> None:
        """Release the newest run (its item was not queued after all)."""
        if self._runs.pop()[1] > self.reuse_from:
            self._high_runs -= 1

    def release(self, count: int) -> None:
        """Release the ``count`` oldest runs (written, or given up)."""
        runs, reuse_from = self._runs, self.reuse_from
        for _ in range(count):
            if runs.popleft()[1] > reuse_from:
                self._high_runs -= 1

    def close(self) -> None:
        """Unmap (views of it still held elsewhere keep it mapped until they go) and close the descriptor."""
        self.close_fd()
        if self._own_fd >= 0:
            os.close(self._own_fd)
            self._own_fd = -1
        self._runs.clear()
        self._high_runs = 0
        with contextlib.suppress(BufferError):  # runs still viewed somewhere: unmapped when collected
            self.view.release()
            self._map.close()


#: the writer process's mapping of the proxy's ring (see :func:`attach`)
_attached: memoryview | None = None


def attach(fd: int) -> None:
    """In the writer process: map the ring the proxy passed as ``fd`` (runs then arrive as offsets)."""
    global _attached
    size = os.fstat(fd).st_size
    _attached = memoryview(mmap.mmap(fd, size))
    os.close(fd)


def attached(offset: int, length: int) -> memoryview:
    """In the writer process: the ring's bytes at ``offset``, ``length`` long."""
    if _attached is None:
        raise RuntimeError("no run ring attached")
    return _attached[offset:offset + length]


__all__ = ["RunRing", "attach", "attached"]
