"""A plain TCP connection's calls that never wait: ``recv_into`` and ``send``/``sendmsg`` on a non-blocking socket.

:class:`PlainSocket` is the synchronous half of :class:`~proxy.server.transport.SocketTransport`:
the receive buffer it holds between a large read and the next wait, the writes it owes
(what the kernel did not take at once, written before anything else), and the reads and
writes the reactor's hop (:mod:`proxy.server.hop`) makes without waiting.  The transport
adds the waiting (Trio) around it.  The hop runs this once per relayed read and write, so
``scripts/setup.sh`` compiles this module with mypyc, in the relay's lane (see :mod:`proxy.compiled`).
OS errors become :class:`PeerLost` (a ``trio.BrokenResourceError``) here, at the edge.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Final, Protocol

import trio

from proxy.core.scanner import Piece

#: bytes asked for per receive; bounds what one direction holds besides its scanner.  Each relayed
#: read costs the proxy's thread a share besides its frames' (reactor, pipeline and scanner calls,
#: a row's array checks, two syscalls): from 256 KiB to 512 KiB a saturated stream's user CPU per
#: MiB fell from ~400 to ~270 us at 16 KiB frames, the proxy's whole CPU per MiB to 0.72-0.87x at
#: 1 KiB and 16 KiB frames and 0.85-0.98x at 512 KiB (1 MiB reads: about the same, twice the memory)
RECV_SIZE: Final = 512 * 1024
#: receive buffers not in use, shared by every connection (bounded, 16 MiB: extras are freed)
BUFFER_POOL: Final[list[bytearray]] = []
_BUFFER_POOL_MAX: Final = 32
#: reads up to this size are returned as a copy (cheap) instead of a view of the buffer
COPY_BELOW: Final = 16 * 1024
#: Most buffers one sendmsg takes (Linux IOV_MAX); more fail with EMSGSIZE.  A receive of
#: many small frames that observers want decoded becomes that many pieces.
_IOV_MAX: Final = 1024


class WriteLock(Protocol):
    """The transport's write lock as seen here: ``busy`` is non-zero while a writer holds or waits for it."""

    @property
    def busy(self) -> int:
        ...


class ReceiveScratch:
    """The receive buffer a reactor's plain sockets read into while they hold none of their own.

    (Only read into in the reactor's thread; a read that keeps its bytes takes the buffer with it.)
    """

    buffer: bytearray
    #: a view of the whole buffer: a small read's copy is one slice of it (``view[:size].tobytes()``)
    view: memoryview

    def __init__(self) -> None:
        self.take(bytearray(RECV_SIZE))

    def take(self, buffer: bytearray) -> None:
        """Read into ``buffer`` from now on (the one before went with a large read)."""
        self.buffer = buffer
        self.view = memoryview(buffer)


class PeerLost(trio.BrokenResourceError):
    """A read from or a write to ``peer`` failed: the connection to that peer is lost (whichever side's task saw it)."""

    def __init__(self, what: str, peer: str, cause: object) -> None:
        super().__init__(f"{what} {peer} failed: {cause}")
        self.peer = peer


class PlainSocket:
    """One non-blocking stdlib socket's reads and writes that never wait (see the module docstring)."""

    def __init__(self, sock: socket.socket, peer: str, write_lock: WriteLock) -> None:
        self.sock = sock
        self.peer = peer
        #: the transport's: a write that waits holds it (then nothing may be written here)
        self.write_lock = write_lock
        self.closed = False
        #: what ``try_send`` could not write at once: owed before anything else is written
        self.owed: list[Piece | bytes] = []
        #: held only between a receive and the next wait: idle connections hold no buffer
        self.buffer: bytearray | None = None

    def failed(self, what: str, exc: OSError) -> trio.ClosedResourceError | trio.BrokenResourceError:
        """What an OS error of a read or write (``what``: "send to", "receive from") is raised as."""
        if self.closed:
            return trio.ClosedResourceError("transport closed")
        return PeerLost(what, self.peer, exc)

    def release_buffer(self) -> None:
        """Give the buffer back to the pool (the next read takes one again)."""
        if self.buffer is not None:
            if len(BUFFER_POOL) < _BUFFER_POOL_MAX:
                BUFFER_POOL.append(self.buffer)
            self.buffer = None

    def try_receive(self, scratch: ReceiveScratch) -> bytes | memoryview | None:
        """The reactor's receive: the next bytes without waiting; None when there are none yet.

        A socket holding no buffer reads into the reactor's ``scratch`` buffer: a small read is
        copied out of it (as from a buffer of its own), a large one keeps that buffer (the view
        handed out points into it) and the scratch takes another from the pool.
        """
        if self.buffer is not None:
            return self._receive_into_own()
        buffer = scratch.buffer
        try:
            size = self.sock.recv_into(buffer)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise self.failed("receive from", exc) from None
        if size <= COPY_BELOW:
            return scratch.view[:size].tobytes()
        self.buffer = buffer
        scratch.take(BUFFER_POOL.pop() if BUFFER_POOL else bytearray(RECV_SIZE))
        return memoryview(buffer)[:size]

    def _receive_into_own(self) -> bytes | memoryview | None:
        """:meth:`try_receive` into the buffer a large read left this socket holding."""
        buffer = self.buffer
        assert buffer is not None
        try:
            size = self.sock.recv_into(buffer)
        except BlockingIOError:
            self.release_buffer()
            return None
        except OSError as exc:
            raise self.failed("receive from", exc) from None
        if size <= COPY_BELOW:
            data = bytes(memoryview(buffer)[:size])
            self.release_buffer()
            return data
        return memoryview(buffer)[:size]

    def try_send(self, pieces: list[Piece | bytes]) -> list[Piece | bytes] | None:
        """The reactor's write: what the kernel takes without waiting, and the rest; None (nothing
        written) while a write waits for the socket (the caller queues behind it with the transport's ``send``).

        The rest stays owed here until a ``send`` (any writer's, ``send([])`` too) writes it
        first: until the caller's task takes the write over, another writer (a keepalive, the
        other direction's answer to this peer) must not slip in between.
        """
        if self.write_lock.busy or self.owed:
            return None
        if len(pieces) == 1:  # (a relayed read's usual write: one send, as send_now would write it)
            piece = pieces[0]
            try:
                sent = self.sock.send(piece)  # type: ignore[arg-type]
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise self.failed("send to", exc) from None
            if sent == len(piece):  # type: ignore[arg-type]
                return []
            rest = self.send_now([memoryview(piece)[sent:]]) if sent else pieces  # type: ignore[arg-type]
        else:
            rest = self.send_now(pieces)
        if rest:
            self.owed = list(rest)  # (its own list: queue_write extends it)
        return rest

    def queue_write(self, pieces: Sequence[Piece | bytes]) -> None:
        """Owe ``pieces`` behind what is owed already: the next ``send`` (anyone's) writes them first."""
        self.owed.extend(pieces)

    def with_owed(self, pieces: Sequence[Piece | bytes]) -> list[Piece | bytes]:
        """``pieces`` behind what is owed (which is then no longer owed here: the caller writes it)."""
        owed, self.owed = self.owed, []
        return [*owed, *pieces] if owed else list(pieces)

    def send_now(self, pieces: list[Piece | bytes]) -> list[Piece | bytes]:
        """Write as much as the kernel takes without waiting; returns what is left."""
        sock = self.sock
        while pieces:
            try:
                sent = sock.sendmsg(pieces if len(pieces) <= _IOV_MAX else pieces[:_IOV_MAX])  # type: ignore[arg-type]
            except BlockingIOError:
                return pieces
            except OSError as exc:
                raise self.failed("send to", exc) from None
            if len(pieces) == 1 and sent == len(pieces[0]):  # type: ignore[arg-type]
                return []  # (one piece, all of it written: a relayed small read's usual case)
            pieces = _advance(pieces, sent)
        return pieces


def _advance(pieces: list[Piece | bytes], sent: int) -> list[Piece | bytes]:
    """The pieces left after ``sent`` bytes of them were written."""
    index = 0
    while index < len(pieces):
        size = len(pieces[index])  # type: ignore[arg-type]
        if sent < size:
            rest = pieces[index:]
            if sent:
                rest[0] = memoryview(rest[0])[sent:]  # type: ignore[arg-type]
            return rest
        sent -= size
        index += 1
    return []
