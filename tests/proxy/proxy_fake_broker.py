"""A scripted broker for relay tests: loopback sockets (``serve``) or any Trio stream
(``handle``, e.g. one end of a memory stream pair), the project's own codec.

It answers CONNECT with CONNECTED (or ``refuse_connect``'s ERROR, then closes or resets), PING
with PONG (unless told not to), SEND with SEND_RECEIPT (after ``receipt_delay``), LOOKUP
with ``lookup_answer``; it keeps the exact bytes it received so tests can compare them
with what the client sent.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, FrameDecoder, encode_command, encode_payload_command

T = api.BaseCommand.Type


@dataclass
class FakeBroker:
    max_message_size: int | None = None
    answer_pings: bool = True
    read_after_handshake: bool = True
    close_after_handshake: bool = False
    #: the ERROR that answers CONNECT (the connection is then closed), as a broker refuses a bad token
    refuse_connect: api.CommandError | None = None
    #: after ``refuse_connect``'s ERROR, wait this long and reset the connection instead of closing it
    reset_after_refusal: float | None = None
    #: an ERROR sent right after CONNECTED (with ``close_after_handshake``: then the connection is closed)
    error_after_handshake: api.CommandError | None = None
    receipt_delay: float = 0.0
    lookup_answer: Callable[[Frame], bytes] | None = None
    received: bytearray = field(default_factory=bytearray)
    frames: list[Frame] = field(default_factory=list)
    connections: int = 0
    open_connections: int = 0
    port: int = 0

    @property
    def url(self) -> str:
        return f"pulsar://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[FakeBroker] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self.handle, listeners)
            task_status.started(self)

    async def handle(self, stream: trio.abc.Stream) -> None:
        """Serve one proxy connection on ``stream`` until it closes."""
        self.connections += 1
        self.open_connections += 1
        decoder = FrameDecoder(64 * 1024 * 1024)
        try:
            async with stream, trio.open_nursery() as nursery:
                while True:
                    data = await stream.receive_some(1 << 20)
                    if not data:
                        return
                    self.received += data
                    for frame in decoder.receive(data):
                        self.frames.append(frame)
                        await self._answer(frame, stream, nursery)
                        if frame.type == T.CONNECT and not self.read_after_handshake:
                            await trio.sleep_forever()
                        if frame.type == T.CONNECT and (self.close_after_handshake or self.refuse_connect):
                            return
        except* (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError):
            pass  # the proxy went away (possibly with a reset, unread receipts in its buffer)
        finally:
            self.open_connections -= 1

    async def _answer(self, frame: Frame, stream: trio.abc.Stream, nursery: trio.Nursery) -> None:
        kind = frame.type
        if kind == T.CONNECT and self.refuse_connect is not None:
            await stream.send_all(encode_command(self.refuse_connect))
            if self.reset_after_refusal is not None:
                await trio.sleep(self.reset_after_refusal)  # (the proxy has read the ERROR: the reset comes after)
                assert isinstance(stream, trio.SocketStream)
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif kind == T.CONNECT:
            connected = api.CommandConnected(server_version="fake", protocol_version=21)
            if self.max_message_size is not None:
                connected.max_message_size = self.max_message_size
            await stream.send_all(encode_command(connected))
            if self.error_after_handshake is not None:
                await stream.send_all(encode_command(self.error_after_handshake))
        elif kind == T.PING and self.answer_pings:
            await stream.send_all(encode_command(api.CommandPong()))
        elif kind == T.SEND:
            send = frame.command.send
            receipt = encode_command(api.CommandSendReceipt(producer_id=send.producer_id,
                                                            sequence_id=send.sequence_id))
            if self.receipt_delay:
                async def later() -> None:
                    await trio.sleep(self.receipt_delay)
                    await stream.send_all(receipt)
                nursery.start_soon(later)
            else:
                await stream.send_all(receipt)
        elif kind == T.LOOKUP and self.lookup_answer is not None:
            await stream.send_all(self.lookup_answer(frame))


CONNECT = encode_command(api.CommandConnect(client_version="relay-test", protocol_version=21))


def send_frame(seq: int, size: int) -> bytes:
    """A SEND of producer 1 with a ``size``-byte payload."""
    return encode_payload_command(api.CommandSend(producer_id=1, sequence_id=seq),
                                  api.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=1),
                                  bytes([seq % 251]) * size)


async def receive_frames(stream: trio.abc.ReceiveStream, decoder: FrameDecoder, count: int) -> list[Frame]:
    """Read until ``count`` frames arrived (raises EOFError if the stream closes first)."""
    frames: list[Frame] = list(decoder.frames())
    while len(frames) < count:
        data = await stream.receive_some(1 << 20)
        if not data:
            raise EOFError(f"closed after {len(frames)} of {count} frames")
        frames.extend(decoder.receive(data))
    return frames


async def handshake(port: int) -> tuple[trio.SocketStream, FrameDecoder]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(CONNECT)
    decoder = FrameDecoder(64 * 1024 * 1024)
    [connected] = await receive_frames(stream, decoder, 1)
    assert connected.type == T.CONNECTED
    return stream, decoder
