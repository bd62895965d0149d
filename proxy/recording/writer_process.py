"""The recording's writer process: encoding and appending away from the proxy's interpreter lock.

Cutting runs into frame records is Python work per frame (most of a microsecond for a
1 KiB frame).  In a thread of the proxy it held the interpreter lock the relay needs
between every read and write, and recording took passthrough of 1 KiB frames down to a
fraction; a child process has its own interpreter and runs on another core, and the proxy
only hands it bytes.

The Trio recorder (:class:`proxy.server.recorder.Recorder`) starts one
:class:`WriterProcess` per recording (from its Trio thread) and calls its blocking
methods from a worker thread, one at a time: :meth:`~WriterProcess.write` sends a batch
of queue items and waits for its :class:`~proxy.recording.writer.BatchResult`;
:meth:`~WriterProcess.end_streams` has the frames still unfinished at the end given up
(and says how many); :meth:`~WriterProcess.sync` and :meth:`~WriterProcess.close` carry
the recorder's fsyncs and index writes.  The child runs a :class:`~proxy.recording.writer.SegmentWriter`.

Requests go down the child's stdin, replies come up its stdout.  A request is a header
(kind, size of the pickled part, number of buffers), each buffer's size, the pickled part,
then the buffers.  The bytes of runs do not travel at all: the recorder copied them into
its run ring (:mod:`proxy.recording.run_ring`), shared memory the child maps at its
start, and a run crosses as its place there.  Runs that are not in a ring travel out of
band (pickle protocol 5): copied only into the pipe, and read into one buffer the child keeps.  A
reply is a size and a pickled ``(ok, value)`` (``value`` the error text when not ok).
The child runs niced and within a share of one core (:class:`CpuBudget`): at saturation
it pauses between writes (and between the pieces of a long one), the run ring fills and
the recorder drops and counts runs, so that the writer never takes the proxy's CPU.  The
child ignores SIGINT and SIGTERM (the proxy says when recording ends), is killed when the
proxy's thread that started it ends (``PR_SET_PDEATHSIG``), and at the end of its input
without a close (the proxy is gone) closes its segments and leaves the index as the proxy
last wrote it.
"""

from __future__ import annotations

import contextlib
import copyreg
import ctypes
import fcntl
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, cast

from proxy.errors import RecordingError
from proxy.native_threads import ONE_THREAD_LIBRARIES
from proxy.pb import recording_pb2 as rpb
from proxy.recording import run_ring
from proxy.recording.run_ring import RunRing
from proxy.recording.writer import BatchResult, QueueItem, RecordConfig, SegmentWriter

_REQUEST_HEAD: Final = struct.Struct(">BII")
_SIZE: Final = struct.Struct(">I")
_START, _WRITE, _SYNC, _CLOSE, _END_STREAMS = 1, 2, 3, 4, 5
#: the pipes' capacity: a batch crosses in few wake-ups of either side
_PIPE_BYTES: Final = 1 << 20
#: buffers per writev (the kernel's IOV_MAX on Linux)
_IOV_MAX: Final = 1024
_PR_SET_PDEATHSIG: Final = 1
#: the child's niceness: when cores are short, the proxy's traffic goes first and the recorder
#: drops (and counts) what it cannot write, as it does when its queue is full
_NICENESS: Final = 10
#: glibc's ``mallopt`` parameters, and the largest allocation the child takes from its heap (a batch's
#: rows of records, ~1 MiB each): see ``keep_freed_memory``
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_ALLOCATIONS_BELOW: Final = 16 * 1024 * 1024
#: the most of one core the child takes for writes (see CpuBudget), and the burst it may take at once: what
#: ``CPU_WINDOW_SECONDS`` earn (6.25 ms of CPU).  With a window of 0.25 s the burst alone took the writer to
#: ~0.4 of a core over a 0.4 s stretch of saturation after a quiet one.  An eighth of a core, not a quarter,
#: since the relay's 100 B frames cost half what they did (the row check): raw SENDs saturating 2 cores, a
#: quarter kept recording at 0.74-0.81x of plain, an eighth 0.89-0.93x, recording 14 % of the frames that
#: passed instead of 19 % (bench/passthrough.py --observers --arms recording, 5 rounds of 1.2 s phases)
CPU_SHARE: Final = 0.125
CPU_WINDOW_SECONDS: Final = 0.05
#: the longest pause, and the longest the pauses within one write come to (a sync or a close waits for them)
MAX_PAUSE_SECONDS: Final = 0.5


def _record_from(data: bytes) -> rpb.Record:
    return rpb.Record.FromString(data)


def _reduce_record(record: rpb.Record) -> tuple[Callable[[bytes], rpb.Record], tuple[bytes]]:
    return _record_from, (record.SerializeToString(),)


# the generated module does not import under the name its classes carry: records cross as their bytes
copyreg.pickle(rpb.Record, _reduce_record)


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """Write ``parts`` in order, gathered (``writev``), whatever the kernel takes per call."""
    index = 0
    while index < len(parts):
        written = os.writev(fd, parts[index:index + _IOV_MAX])
        while written:
            size = len(parts[index])
            if written < size:
                parts[index] = parts[index][written:]
                break
            written -= size
            index += 1


def _read_exact(fd: int, size: int) -> bytearray:
    """``size`` bytes from ``fd``; EOFError when it ends first."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = os.readv(fd, [view[got:]])
        if not count:
            raise EOFError
        got += count
    return buffer


def _send(fd: int, kind: int, value: object) -> None:
    """One request: ``value`` pickled, the buffers it holds (``PickleBuffer``) out of band."""
    buffers: list[pickle.PickleBuffer] = []
    pickled = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    views = [buffer.raw() for buffer in buffers]
    head = _REQUEST_HEAD.pack(kind, len(pickled), len(views)) + b"".join(_SIZE.pack(len(view)) for view in views)
    _write_all(fd, [memoryview(head), memoryview(pickled), *views])


def _receive(fd: int) -> tuple[int, object]:
    """One request: (kind, value), its buffers as views of what was read; EOFError at the end of input."""
    kind, pickled_size, count = _REQUEST_HEAD.unpack(_read_exact(fd, _REQUEST_HEAD.size))
    sizes = struct.unpack(f">{count}I", _read_exact(fd, 4 * count)) if count else ()
    pickled = _read_exact(fd, pickled_size)
    data = memoryview(_read_exact(fd, sum(sizes)))
    buffers, pos = [], 0
    for size in sizes:
        buffers.append(data[pos:pos + size])
        pos += size
    return kind, pickle.loads(pickled, buffers=buffers)


def _reply(fd: int, ok: bool, value: object) -> None:
    pickled = pickle.dumps((ok, value), protocol=5)
    _write_all(fd, [memoryview(_SIZE.pack(len(pickled))), memoryview(pickled)])


class WriterProcess:
    """The proxy's end of a recording's writer process; see the module docstring.

    Create it on the thread that runs the recorder (the child dies with that thread), with the
    recorder's run ring when it has one (the child maps it; close the ring's descriptor after); call
    :meth:`started`, :meth:`write`, :meth:`sync` and :meth:`close` from one worker thread at a time.
    """

    def __init__(self, path: Path, config: RecordConfig, ring: RunRing | None = None) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**ONE_THREAD_LIBRARIES, **os.environ,  # (the child's BLAS on one thread)
               "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        ring_fd = ring.fd if ring is not None and ring.fd is not None else -1
        self._process = subprocess.Popen(
            [sys.executable, "-m", "proxy.recording.writer_process", str(os.getpid()), str(ring_fd)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, pass_fds=(ring_fd,) if ring_fd >= 0 else ())
        assert self._process.stdin is not None and self._process.stdout is not None
        self._requests = self._process.stdin.fileno()
        self._replies = self._process.stdout.fileno()
        set_pipe_size = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux
        for fd in (self._requests, self._replies):
            with contextlib.suppress(OSError):  # a smaller pipe only costs more wake-ups
                if set_pipe_size is not None:
                    fcntl.fcntl(fd, set_pipe_size, _PIPE_BYTES)
        self._path = path
        self._config = config

    def started(self) -> None:
        """Have the child open the recording at ``path`` (blocking); RecordingError when it cannot."""
        self._call(_START, (str(self._path), self._config))

    def write(self, batch: Sequence[QueueItem]) -> BatchResult:
        """Encode and append ``batch`` in the child (blocking); what it wrote."""
        result = self._call(_WRITE, list(batch))
        assert isinstance(result, BatchResult)
        return result

    def end_streams(self) -> BatchResult:
        """Give up the frames still unfinished in the child's streams (blocking); how many, per connection."""
        result = self._call(_END_STREAMS, None)
        assert isinstance(result, BatchResult)
        return result

    def sync(self, index: bytes | None) -> None:
        """fsync the current segment and replace the index when given (blocking)."""
        self._call(_SYNC, index)

    def close(self, index: bytes | None) -> None:
        """Close the segments, write the index when given, and wait for the child to end (blocking)."""
        try:
            self._call(_CLOSE, index)
        finally:
            self.stop()

    def stop(self) -> None:
        """End the child (closing its input ends it; killed if it lingers) and reap it."""
        process = self._process
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _call(self, kind: int, value: object) -> object:
        try:
            _send(self._requests, kind, value)
            (size,) = _SIZE.unpack(_read_exact(self._replies, _SIZE.size))
            ok, answer = pickle.loads(_read_exact(self._replies, size))
        except (EOFError, BrokenPipeError, ValueError) as exc:
            code = self._process.poll()
            raise RecordingError(f"the recording's writer process ended (exit code {code})") from exc
        if not ok:
            raise RecordingError(f"cannot write the recording in {self._path}: {answer}")
        return answer


class CpuBudget:
    """Holds the writer to ``share`` of a core: after a write that took it past, it pauses until it is back.

    At saturation the writer always has a backlog and uses all the CPU it is given; niceness
    alone did not stop it: on two cores it took 0.3-0.6 of one from the proxy and its peers
    (1 KiB frames: recording at 0.65-0.85x of plain; with the writer stopped, 1.0x).  Paused,
    it leaves the run ring to fill, and the recorder drops (and counts) runs, as it does
    whenever its queue is full: traffic goes first.  A proxy that does not saturate needs far
    less (the official client: a few per cent of a core), and never sees a pause.

    A token bucket: the writer earns ``share`` seconds of CPU per second, holds at most what
    ``window`` seconds earn (a burst after a quiet spell goes at once), and spends what each
    write took: :meth:`spent` after a write, :meth:`paced` between the pieces of a long one
    (``SegmentWriter.write``), so that a batch does not take the writer past its share before
    it is asked.  A pause is at most ``max_pause`` seconds, and so are the pauses within one
    write together (a sync or a close waits for a write and the pause after it), and so is
    the debt carried into the next write.  It counts its own thread's CPU time, not the process's: a
    library's thread (as BLAS's, see :mod:`proxy.native_threads`) is not the writes' work.
    """

    def __init__(self, share: float = CPU_SHARE, window: float = CPU_WINDOW_SECONDS,
                 max_pause: float = MAX_PAUSE_SECONDS, *,
                 cpu: Callable[[], float] = time.thread_time, wall: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share {share} is not in (0, 1]")
        self.share, self.max_pause = share, max_pause
        self._cpu, self._wall, self._sleep = cpu, wall, sleep
        self._most = share * window
        self._credit = self._most
        self._cpu_at, self._wall_at = cpu(), wall()
        #: seconds paused so far
        self.paused = 0.0
        #: seconds paused within the write under way (by ``paced``)
        self._paused_in_write = 0.0

    def paced(self) -> None:
        """A piece of a write is done: pause if the writer is past what it earned (while this write's pauses
        come to less than ``max_pause``)."""
        self._paused_in_write += self._settle(self.max_pause - self._paused_in_write)

    def spent(self) -> None:
        """A write is done: pause if it spent more CPU time than the writer had earned."""
        self._settle(self.max_pause)
        self._paused_in_write = 0.0

    def _settle(self, longest: float) -> float:
        """Count the CPU spent since the last call, pausing (``longest`` seconds at most) if in debt; the pause."""
        cpu, wall = self._cpu(), self._wall()
        spent = cpu - self._cpu_at
        # earned while idle (held to the window's worth), then while working (as if idle came first): a write
        # longer than the window is not short-changed, and a burst after a quiet spell is the window's worth
        idle = max(wall - self._wall_at - spent, 0.0)
        credit = min(self._credit + idle * self.share, self._most) - spent * (1.0 - self.share)
        pause = 0.0
        if credit < 0.0 and longest > 0.0:
            pause = min(-credit / self.share, longest)
            self._sleep(pause)
            self.paused += pause
        self._credit = max(credit + pause * self.share, -self.max_pause * self.share)
        self._cpu_at, self._wall_at = self._cpu(), self._wall()
        return pause


def keep_freed_memory() -> None:
    """Have malloc (glibc's) give the next batch the memory the last one freed, instead of fresh pages.

    A batch's records are built in arrays of ~1 MiB (a row per run, see ``writer._encode_row``),
    held until the batch is written and then freed together: malloc maps each from the kernel and
    unmaps it when freed, so every batch touched fresh pages, a page fault each (1 KiB frames: ~1 us
    of the writer's ~2 us per frame).  From the heap, and kept there when freed (up to twice that
    size), the next batch reuses them.  Elsewhere than glibc: nothing to do.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_ALLOCATIONS_BELOW)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _HEAP_ALLOCATIONS_BELOW)


def _die_with_parent(parent: int) -> None:
    """Be killed when the proxy's thread that started this process ends (Linux), or end now if it has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def main(argv: list[str]) -> int:
    """The child: serve requests from stdin until a close or the end of input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(int(argv[0]))
    if len(argv) > 1 and int(argv[1]) >= 0:
        run_ring.attach(int(argv[1]))
    with contextlib.suppress(OSError):
        os.nice(_NICENESS)
    keep_freed_memory()
    requests, replies = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not garble the replies
    writer: SegmentWriter | None = None
    budget = CpuBudget()
    while True:
        try:
            kind, value = _receive(requests)
        except EOFError:
            break
        try:
            answer: object = None
            if kind == _START:
                path, config = cast(tuple[str, RecordConfig], value)
                writer = SegmentWriter(Path(path), config)
            elif writer is None:
                raise RecordingError("the writer was not started")
            elif kind == _WRITE:
                answer = writer.write(cast(list[QueueItem], value), budget.paced)
            elif kind == _SYNC:
                writer.sync(cast(bytes | None, value))
            elif kind == _END_STREAMS:
                answer = writer.end_streams()
            elif kind == _CLOSE:
                writer.close(cast(bytes | None, value))
                writer = None
                _reply(replies, True, None)
                return 0
        except (OSError, RecordingError) as exc:
            _reply(replies, False, exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))
            continue
        _reply(replies, True, answer)
        if kind == _WRITE:
            budget.spent()
    if writer is not None:
        writer.close(None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
