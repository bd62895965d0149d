"""The two byte pipes a relay reads and writes: a plain socket, and a Trio stream (TLS).

:class:`SocketTransport` drives a non-blocking stdlib socket directly, because the
relay's cost is per wake-up: it tries ``recv``/``sendmsg`` first (its
:class:`~proxy.server.plain_socket.PlainSocket`, the calls that never wait, which the
reactor's hop makes itself) and waits for readiness only when the kernel says
EAGAIN, so a round trip through the proxy costs one scheduler pass per hop.  When
data was already there it still yields once (fairness: one busy connection cannot
starve the others).  ``send`` writes all pieces with one ``sendmsg`` (gathered
I/O); writers on the same socket (the two relay directions, keepalive) are
serialised by a lock taken only when a write has to wait, so frames never interleave.

:class:`StreamTransport` wraps any ``trio.abc.Stream`` (``trio.SSLStream`` for TLS;
the memory streams of the relay's timing tests, which pass a half-close on) with the
same interface.  OS errors become ``trio.BrokenResourceError`` here (a plain
socket's in ``plain_socket``), at the edge.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Sequence
from typing import Final, Protocol

import trio

from proxy.core.scanner import Piece
from proxy.server.plain_socket import BUFFER_POOL, COPY_BELOW, RECV_SIZE, PeerLost, PlainSocket

#: receives served one after another without waiting before a direction lets the other
#: connections go first (its own task, and the reactor's handler): 2 MiB a turn
READY_STREAK: Final = 4
#: a TLS read's size, kept as it was: a read returns one record's data (16 KiB at most), yet CPython
#: allocates the whole size asked for each read
_STREAM_RECV_SIZE: Final = 256 * 1024
_LINGER_RESET: Final = struct.pack("ii", 1, 0)


class Transport(Protocol):
    peer: str

    @property
    def local_address(self) -> str:
        ...

    async def receive(self) -> bytes | memoryview:
        """The next bytes from the peer; empty when it closed its side.

        The result may be a view of a buffer reused by the next call: use it first.
        """
        ...

    async def send(self, pieces: Sequence[Piece | bytes], slice_bytes: int = 0) -> None:
        ...

    async def send_eof(self) -> None:
        """Half-close: the peer reads EOF after everything written so far (False: unsupported)."""
        ...

    async def aclose(self, reset: bool = False) -> None:
        ...


def _address(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(addr)


def peer_name(sock: socket.socket) -> str:
    try:
        return _address(sock.getpeername())
    except OSError:
        return "?"


def local_name(sock: socket.socket) -> str:
    try:
        return _address(sock.getsockname())
    except OSError:
        return "?"


def tune(sock: socket.socket) -> None:
    """Non-blocking, and no Nagle delay: a proxy must not hold small frames back."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _WriteLock:
    """A ``trio.Lock`` whose ``busy`` says, as one attribute read, whether a writer holds or waits for it.

    (The reactor's write asks this once per hop; ``trio.Lock.locked()`` is a call.)  ``busy`` counts
    holders and waiters: a waiter is only ever behind a holder, and a release hands the lock straight
    to the next waiter, so it is non-zero exactly while the lock is held.
    """

    __slots__ = ("_lock", "busy")

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self.busy = 0

    def acquire_nowait(self) -> None:
        self._lock.acquire_nowait()
        self.busy += 1

    def release(self) -> None:
        self.busy -= 1
        self._lock.release()

    async def __aenter__(self) -> None:
        self.busy += 1
        try:
            await self._lock.acquire()
        except BaseException:
            self.busy -= 1
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class SocketTransport:
    """A plain TCP connection on a non-blocking stdlib socket."""

    def __init__(self, sock: socket.socket, peer: str | None = None, *, tuned: bool = False) -> None:
        if not tuned:  # (``tuned``: the caller did, e.g. before connecting it)
            tune(sock)
        self.sock = sock
        self.peer = peer or peer_name(sock)
        self._write_lock = _WriteLock()
        #: its calls that never wait (the reactor's hop makes them itself)
        self.plain = PlainSocket(sock, self.peer, self._write_lock)
        self._ready_streak = 0
        self._drained = False

    @property
    def local_address(self) -> str:
        return local_name(self.sock)

    def queue_write(self, pieces: Sequence[Piece | bytes]) -> None:
        """Owe ``pieces`` behind what is owed already: the next ``send`` (anyone's) writes them first."""
        self.plain.queue_write(pieces)

    async def receive(self) -> bytes | memoryview:
        sock, plain = self.sock, self.plain
        if self._drained:
            # The last read did not fill the buffer, so the socket is most likely empty:
            # wait for readiness first instead of paying for a recv that says EAGAIN.
            self._drained = False
            await trio.lowlevel.wait_readable(sock)
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            buffer = plain.buffer
            if buffer is None:
                buffer = plain.buffer = BUFFER_POOL.pop() if BUFFER_POOL else bytearray(RECV_SIZE)
            try:
                size = sock.recv_into(buffer)
            except BlockingIOError:
                self._ready_streak = 0
                plain.release_buffer()
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError as exc:
                raise plain.failed("receive from", exc) from None
            if size < RECV_SIZE:
                self._drained = True
            else:
                self._ready_streak += 1
                if self._ready_streak >= READY_STREAK:
                    # Data kept coming without a wait: yield so no connection starves the others.
                    self._ready_streak = 0
                    await trio.lowlevel.cancel_shielded_checkpoint()
            if size <= COPY_BELOW:
                # Small reads are copied out so the buffer goes back to the pool at once: a
                # connection waiting on its peer (upstream connect, backpressure) holds none.
                data = bytes(memoryview(buffer)[:size])
                plain.release_buffer()
                return data
            return memoryview(buffer)[:size]

    async def send(self, pieces: Sequence[Piece | bytes], slice_bytes: int = 0) -> None:
        if slice_bytes > 0:
            await self._send_sliced(pieces, slice_bytes)
            return
        lock, plain = self._write_lock, self.plain
        if lock.busy:
            async with lock:
                await self._send_waiting(plain.with_owed(pieces))
            return
        # (nobody is writing: what is owed goes first, without a trip through the lock)
        rest = plain.send_now(plain.with_owed(pieces) if plain.owed or not isinstance(pieces, list) else pieces)
        if not rest:
            return
        lock.acquire_nowait()  # no await since the check: nobody can have slipped in
        try:
            await self._send_waiting(rest)
        finally:
            lock.release()

    async def _send_sliced(self, pieces: Sequence[Piece | bytes], slice_bytes: int) -> None:
        async with self._write_lock:
            await self._send_waiting(self.plain.with_owed(()))
            for piece in pieces:
                view = memoryview(piece)  # type: ignore[arg-type]
                for start in range(0, len(view), slice_bytes):
                    await self._send_waiting([view[start:start + slice_bytes]])
                    await trio.sleep(0.001)  # separate TCP segments, not one coalesced write

    async def _send_waiting(self, pieces: list[Piece | bytes]) -> None:
        while True:
            pieces = self.plain.send_now(pieces)
            if not pieces:
                return
            await trio.lowlevel.wait_writable(self.sock)

    async def send_eof(self) -> None:
        if not self._write_lock.busy and not self.plain.owed:
            # (nothing written or owed: the FIN goes at once, without a trip through the lock)
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
            return
        async with self._write_lock:  # after any write still in progress
            await self._send_waiting(self.plain.with_owed(()))
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)

    async def aclose(self, reset: bool = False) -> None:
        self.close(reset)
        await trio.lowlevel.checkpoint()

    def close(self, reset: bool = False) -> None:
        """:meth:`aclose` at once (a plain socket's close never waits)."""
        if self.plain.closed:
            return
        self.plain.closed = True
        self.plain.buffer = None
        with contextlib.suppress(OSError):
            if reset:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()


class StreamTransport:
    """Any Trio stream (TLS: ``trio.SSLStream``) behind the Transport interface."""

    def __init__(self, stream: trio.abc.Stream, peer: str, raw_socket: socket.socket | None = None) -> None:
        self.stream = stream
        self.peer = peer
        self._raw_socket = raw_socket
        self._write_lock = trio.Lock()
        self._closed = False
        #: writes queued in the order they were emitted (``queue_write``): the next ``send`` writes them first
        self._owed: list[bytes] = []

    @property
    def local_address(self) -> str:
        return local_name(self._raw_socket) if self._raw_socket is not None else "?"

    async def receive(self) -> bytes:
        try:
            return bytes(await self.stream.receive_some(_STREAM_RECV_SIZE))
        except trio.BrokenResourceError as exc:
            raise PeerLost("receive from", self.peer, exc.__cause__ or exc) from None

    def queue_write(self, pieces: Sequence[Piece | bytes]) -> None:
        """Owe ``pieces`` (copied) behind what is owed already: the next ``send`` (anyone's) writes them first."""
        self._owed.append(b"".join(pieces))  # type: ignore[arg-type]

    async def send(self, pieces: Sequence[Piece | bytes], slice_bytes: int = 0) -> None:
        data = b"".join(pieces)  # type: ignore[arg-type]
        async with self._write_lock:
            await self._send_owed()
            if not data:
                return
            if slice_bytes > 0:
                for start in range(0, len(data), slice_bytes):
                    await self._send_all(data[start:start + slice_bytes])
                    await trio.sleep(0.001)
            else:
                await self._send_all(data)

    async def _send_owed(self) -> None:
        """(Holding the write lock.)"""
        if self._owed:
            owed, self._owed = self._owed, []
            await self._send_all(b"".join(owed))

    async def _send_all(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except trio.BrokenResourceError as exc:
            raise PeerLost("send to", self.peer, exc.__cause__ or exc) from None

    async def send_eof(self) -> None:
        if isinstance(self.stream, trio.abc.HalfCloseableStream):  # a memory stream in tests
            async with self._write_lock:
                await self._send_owed()
                await self.stream.send_eof()
            return
        # TLS has no half-close here: the caller ends the connection instead.
        raise trio.BrokenResourceError("half-close is not supported over TLS")

    async def aclose(self, reset: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if reset and self._raw_socket is not None:
            with contextlib.suppress(OSError):
                self._raw_socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        with trio.move_on_after(1) as scope:
            scope.shield = True
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await self.stream.aclose()
        if not scope.cancelled_caught:
            return
        await trio.aclose_forcefully(self.stream)
