"""Chunked messages: one large message split across several SENDs (PIP-37).

Every chunk carries the same ``uuid`` (``<producer_name>-<sequence_id>`` by the
clients' convention), its ``chunk_id`` (0-based), ``num_chunks_from_msg`` and
``total_chunk_msg_size`` (the size of the whole, still compressed, payload).  The
chunks' payloads concatenated give that payload, which then decompresses with the
metadata's ``compression`` and ``uncompressed_size`` like any other.

:class:`ChunkAssembler` reassembles them, keyed by (producer name, uuid).  A
repeated chunk (a resend after reconnect) is ignored; a gap discards the partial
message and raises :class:`~proxy.errors.ChunkError`; the number of partial
messages held is bounded, the oldest being discarded first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final

from proxy.errors import ChunkError
from proxy.pb import PulsarApi_pb2 as api

DEFAULT_MAX_PENDING_MESSAGES: Final = 100


def is_chunk(metadata: api.MessageMetadata) -> bool:
    return bool(metadata.HasField("uuid") and metadata.num_chunks_from_msg > 1)


@dataclass(slots=True)
class _Partial:
    num_chunks: int
    total_size: int
    next_chunk_id: int = 0
    parts: list[bytes] = field(default_factory=list)
    received: int = 0


#: MessageMetadata fields that describe one chunk rather than the whole message
CHUNK_FIELDS: Final = ("uuid", "chunk_id", "num_chunks_from_msg", "total_chunk_msg_size")


@dataclass(frozen=True, slots=True)
class AssembledMessage:
    """A whole message rebuilt from its chunks.

    ``metadata`` is the last chunk's with the chunk fields cleared, so it describes
    the whole payload and decodes like any unchunked message; ``uuid`` is kept apart.
    """

    metadata: api.MessageMetadata
    payload: bytes
    num_chunks: int
    uuid: str


class ChunkAssembler:
    """Rebuild chunked messages from their chunks, in arrival order."""

    def __init__(self, max_pending_messages: int = DEFAULT_MAX_PENDING_MESSAGES) -> None:
        self.max_pending_messages = max_pending_messages
        self._pending: OrderedDict[tuple[str, str], _Partial] = OrderedDict()
        self.discarded = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, metadata: api.MessageMetadata, payload: bytes) -> AssembledMessage | None:
        """Take one chunk; return the whole message when this chunk completes it."""
        if not is_chunk(metadata):
            raise ChunkError("not a chunk: uuid and num_chunks_from_msg > 1 are required")
        key = (metadata.producer_name, metadata.uuid)
        chunk_id, num_chunks, total = metadata.chunk_id, metadata.num_chunks_from_msg, metadata.total_chunk_msg_size
        if not 0 <= chunk_id < num_chunks:
            raise ChunkError(f"chunk id {chunk_id} outside 0..{num_chunks - 1} for {metadata.uuid}")
        partial = self._pending.get(key)
        if chunk_id == 0:
            if partial is not None and partial.next_chunk_id > 0 and partial.received:
                # The producer started over (e.g. resent after a reconnect): restart too.
                del self._pending[key]
            partial = _Partial(num_chunks, total)
            self._pending[key] = partial
            self._evict()
        elif partial is None:
            raise ChunkError(f"chunk {chunk_id} of {metadata.uuid} arrived without its first chunk")
        if chunk_id < partial.next_chunk_id:
            return None
        if chunk_id > partial.next_chunk_id:
            del self._pending[key]
            self.discarded += 1
            raise ChunkError(f"chunk {partial.next_chunk_id} of {metadata.uuid} is missing (got {chunk_id})")
        if num_chunks != partial.num_chunks or total != partial.total_size:
            del self._pending[key]
            self.discarded += 1
            raise ChunkError(f"chunks of {metadata.uuid} disagree on the chunk count or total size")
        partial.parts.append(payload)
        partial.received += len(payload)
        partial.next_chunk_id += 1
        if partial.received > partial.total_size:
            del self._pending[key]
            self.discarded += 1
            raise ChunkError(f"chunks of {metadata.uuid} exceed total_chunk_msg_size {partial.total_size}")
        if partial.next_chunk_id < partial.num_chunks:
            return None
        del self._pending[key]
        if partial.received != partial.total_size:
            self.discarded += 1
            raise ChunkError(f"chunks of {metadata.uuid} sum to {partial.received} bytes, "
                             f"total_chunk_msg_size says {partial.total_size}")
        whole = api.MessageMetadata()
        whole.CopyFrom(metadata)
        for name in CHUNK_FIELDS:
            whole.ClearField(name)
        return AssembledMessage(whole, b"".join(partial.parts), partial.num_chunks, metadata.uuid)

    def _evict(self) -> None:
        while len(self._pending) > self.max_pending_messages:
            self._pending.popitem(last=False)
            self.discarded += 1


def split_into_chunks(payload: bytes, max_chunk_size: int) -> list[bytes]:
    """Cut a (compressed) payload into chunks of at most ``max_chunk_size`` bytes."""
    if max_chunk_size <= 0:
        raise ValueError("max_chunk_size must be positive")
    if not payload:
        return [b""]
    return [payload[i:i + max_chunk_size] for i in range(0, len(payload), max_chunk_size)]
